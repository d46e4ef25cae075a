// Host emulation of include/ep_core/engram_gather.cuh (test_core_engram_gather.py): every (block, thread) of the
// grid run one after another with CUDA's names shimmed, against a plain gather.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
#include <random>
struct dim3_ { unsigned x; };
static dim3_ threadIdx, blockIdx, blockDim, gridDim;
struct int4 { int x, y, z, w; };
struct int2 { int x, y; };
#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(n)
template <typename T> T __ldg(const T* p) { return *p; }
#include <ep_core/engram_gather.cuh>

int run(int vec, long long rows, long long epr, int nr, long long eb, int grid) {
  std::mt19937 g(rows * 7 + eb);
  std::vector<std::vector<uint8_t>> store(nr, std::vector<uint8_t>(epr * eb));
  for (auto& s : store) for (auto& b : s) b = g() & 0xff;
  std::vector<uint64_t> bases(nr);
  for (int r = 0; r < nr; ++r) bases[r] = (uint64_t)store[r].data();
  std::vector<int> idx(rows);
  for (auto& i : idx) { i = (int)(g() % (nr * epr + 3)) - 1; }  // some out of range
  std::vector<uint8_t> out(rows * eb, 0xcd);
  blockDim.x = 512; gridDim.x = grid;
  for (unsigned b = 0; b < (unsigned)grid; ++b) for (unsigned t = 0; t < 512; ++t) {
    blockIdx.x = b; threadIdx.x = t;
    switch (vec) {
      case 16: ep_engram_gather_16(bases.data(), idx.data(), out.data(), rows, epr, nr, eb); break;
      case 8: ep_engram_gather_8(bases.data(), idx.data(), out.data(), rows, epr, nr, eb); break;
      case 4: ep_engram_gather_4(bases.data(), idx.data(), out.data(), rows, epr, nr, eb); break;
      default: ep_engram_gather_1(bases.data(), idx.data(), out.data(), rows, epr, nr, eb); break;
    }
  }
  for (long long r = 0; r < rows; ++r) {
    long long gi = idx[r];
    for (long long c = 0; c < eb; ++c) {
      uint8_t want = (gi < 0 || gi >= nr * epr) ? 0 : store[gi / epr][(gi % epr) * eb + c];
      if (out[r * eb + c] != want) { printf("FAIL vec=%d row %lld byte %lld\n", vec, r, c); return 1; }
    }
  }
  return 0;
}
int main() {
  int bad = 0;
  bad |= run(16, 100, 37, 3, 14336, 2);   // hidden 7168 bf16, grid-stride over rows
  bad |= run(16, 5, 9, 2, 512 + 16 * 3, 66);  // chunk tail not a multiple of 32*4
  bad |= run(8, 33, 11, 4, 8 * 77, 1);
  bad |= run(4, 17, 5, 2, 12, 3);
  bad |= run(1, 9, 4, 3, 7, 2);
  printf(bad ? "FAILED\n" : "ok\n");
  return bad;
}
