// Host emulation of include/ep_core/lb_copy.cuh's span functions (test_core_lb_copy.py): every thread of a grid run
// one after another, against a plain copy and a sequential fp32 sum (bitwise), aligned and unaligned.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
#include <ep_core/lb_copy.cuh>

static int copy_case(int64_t nbytes, int shift, int64_t nthreads, std::mt19937& g) {
  std::vector<uint8_t> src(nbytes + 32), dst(nbytes + 32, 0xcd), want;
  for (auto& b : src) b = g() & 0xff;
  want = dst;
  std::memcpy(want.data() + 16 + shift, src.data() + 16, nbytes);
  int64_t tasks[3] = {(int64_t)(dst.data() + 16 + shift), (int64_t)(src.data() + 16), nbytes};
  for (int64_t t = 0; t < nthreads; ++t) ep_core::lb::copy_tasks(tasks, 1, t, nthreads);
  if (dst != want) { printf("FAIL copy %lld shift %d\n", (long long)nbytes, shift); return 1; }
  return 0;
}

static int reduce_case(int64_t hidden, int count, int shift, int64_t nthreads, std::mt19937& g) {
  std::normal_distribution<float> d(0.f, 3.f);
  std::vector<std::vector<float>> rows(count, std::vector<float>(hidden + 8));
  for (auto& r : rows) for (auto& v : r) v = d(g);
  std::vector<float> dst(hidden + 8), want;
  for (auto& v : dst) v = d(g);
  want = dst;
  for (int c = 0; c < count; ++c)
    for (int64_t i = 0; i < hidden; ++i) want[shift + i] = want[shift + i] + rows[c][i];
  std::vector<int64_t> table = {(int64_t)(dst.data() + shift), 0, count};
  for (int c = 0; c < count; ++c) table.push_back((int64_t)(rows[c].data() + (c == 1 ? shift : 0)));
  if (shift && count > 1)  // source 1 moved by `shift` floats: its address only 4-byte aligned
    for (int64_t i = hidden - 1; i >= 0; --i) rows[1][i + shift] = rows[1][i];
  for (int64_t t = 0; t < nthreads; ++t) ep_core::lb::reduce_table(table.data(), 1, hidden, t, nthreads);
  if (std::memcmp(dst.data(), want.data(), dst.size() * 4) != 0) {
    printf("FAIL reduce hidden %lld count %d shift %d\n", (long long)hidden, count, shift);
    return 1;
  }
  return 0;
}

// Two entries in one table (the layout the host builds: [E][3] then the sources, `first` indexing them) and two
// copy tasks: every task and entry is reached.
static int table_case(std::mt19937& g) {
  const int64_t hidden = 64;
  std::vector<float> a(hidden), b(hidden), s0(hidden), s1(hidden), s2(hidden);
  for (auto* v : {&a, &b, &s0, &s1, &s2}) for (auto& x : *v) x = (float)(g() % 1000) / 7.f;
  std::vector<float> wa = a, wb = b;
  for (int64_t i = 0; i < hidden; ++i) { wa[i] = wa[i] + s0[i]; wb[i] = (wb[i] + s1[i]) + s2[i]; }
  std::vector<int64_t> table = {(int64_t)a.data(), 0, 1, (int64_t)b.data(), 1, 2,
                                (int64_t)s0.data(), (int64_t)s1.data(), (int64_t)s2.data()};
  for (int64_t t = 0; t < 40; ++t) ep_core::lb::reduce_table(table.data(), 2, hidden, t, 40);
  if (std::memcmp(a.data(), wa.data(), hidden * 4) || std::memcmp(b.data(), wb.data(), hidden * 4)) {
    printf("FAIL reduce table\n");
    return 1;
  }
  std::vector<uint8_t> x(256), y(256), z(512, 0);
  for (auto& v : x) v = g() & 0xff;
  for (auto& v : y) v = g() & 0xff;
  int64_t tasks[6] = {(int64_t)z.data(), (int64_t)x.data(), 256, (int64_t)(z.data() + 256), (int64_t)y.data(), 256};
  for (int64_t t = 0; t < 7; ++t) ep_core::lb::copy_tasks(tasks, 2, t, 7);
  if (std::memcmp(z.data(), x.data(), 256) || std::memcmp(z.data() + 256, y.data(), 256)) {
    printf("FAIL copy tasks\n");
    return 1;
  }
  return 0;
}

int main() {
  std::mt19937 g(42);
  int bad = 0;
  bad |= copy_case(16 * 1000, 0, 64, g);      // vectors, unrolled and tail
  bad |= copy_case(16 * 8 * 64 * 3, 0, 64, g);  // exactly unrolled
  bad |= copy_case(48, 0, 1024, g);           // fewer vectors than threads
  bad |= copy_case(16 * 77, 4, 96, g);        // unaligned: byte by byte
  bad |= copy_case(7, 0, 32, g);
  bad |= reduce_case(1024, 3, 0, 64, g);
  bad |= reduce_case(4 * 8 * 64 * 2 + 12, 1, 0, 64, g);
  bad |= reduce_case(256, 4, 1, 96, g);       // one source 4-byte aligned only: fp32 by fp32
  bad |= reduce_case(6, 2, 0, 32, g);         // hidden not a multiple of 4
  bad |= table_case(g);
  printf(bad ? "FAILED\n" : "ok\n");
  return bad;
}
