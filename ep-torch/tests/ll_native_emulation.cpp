// Host emulation of ep_core/ll_native.cuh for test_torch_legacy_ll_mask_native.py: the native low-latency kernels
// (dispatch send (bf16, FP8) and receive, combine send/recv and the LogFMT twins, ep_lln_clean) of N ranks whose
// regions are host buffers, one std::thread per CUDA thread of a block (reused by the grid's blocks), std::barrier for
// __syncthreads and the warp collectives. Blocks and ranks run one after another (every send of a step before its
// receives), except ep_lln_clean, whose device barriers need the N ranks at once (one host thread per rank).
#include <atomic>
#include <random>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

struct dim3e { unsigned x = 1, y = 1, z = 1; };
struct BlockState {
  std::barrier<>* block;
  std::vector<std::barrier<>*> warps;
  int or_acc = 0;
  unsigned ballot[32] = {};
  unsigned vals[1024] = {};
};
thread_local dim3e threadIdx, blockIdx, blockDim, gridDim;
thread_local BlockState* g_b;

inline uint64_t ep_ll_host_now_ns() {
  return (uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

#define EP_LL_HOST_EMULATION 1
#define EP_LL_DYNAMIC_SMEM(type, name) static type name[65536]
#define __global__
#define __device__
#define __host__
#define __forceinline__
#define __shared__ static
#define __launch_bounds__(...)
struct int4 { int x, y, z, w; };
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct float4 { float x, y, z, w; };
inline int4 make_int4(int a, int b, int c, int d) { return {a, b, c, d}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline void __syncthreads() { g_b->block->arrive_and_wait(); }
inline int __syncthreads_or(int pred) {
  g_b->block->arrive_and_wait();
  if (pred) __atomic_store_n(&g_b->or_acc, 1, __ATOMIC_SEQ_CST);
  g_b->block->arrive_and_wait();
  const int r = __atomic_load_n(&g_b->or_acc, __ATOMIC_SEQ_CST);
  g_b->block->arrive_and_wait();
  if (threadIdx.x == 0) __atomic_store_n(&g_b->or_acc, 0, __ATOMIC_SEQ_CST);
  g_b->block->arrive_and_wait();
  return r;
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline std::barrier<>& warp_bar() { return *g_b->warps[threadIdx.x / 32]; }
inline unsigned exchange(unsigned v, unsigned src_lane) {
  const unsigned base = threadIdx.x & ~31u;
  warp_bar().arrive_and_wait();
  g_b->vals[threadIdx.x] = v;
  warp_bar().arrive_and_wait();
  const unsigned r = g_b->vals[base + src_lane];
  warp_bar().arrive_and_wait();
  return r;
}
inline unsigned __ballot_sync(unsigned, bool pred) {  // every lane's predicate in one exchange (3 barrier phases)
  const unsigned base = threadIdx.x & ~31u;
  warp_bar().arrive_and_wait();
  g_b->vals[threadIdx.x] = pred ? 1u : 0u;
  warp_bar().arrive_and_wait();
  unsigned r = 0;
  for (unsigned l = 0; l < 32; ++l) r |= (g_b->vals[base + l] & 1u) << l;
  warp_bar().arrive_and_wait();
  return r;
}
inline void __syncwarp(unsigned = 0xFFFFFFFFu) { warp_bar().arrive_and_wait(); }
inline bool __all_sync(unsigned m, bool pred) { return __ballot_sync(m, !pred) == 0u; }
inline bool __any_sync(unsigned m, bool pred) { return __ballot_sync(m, pred) != 0u; }
inline unsigned __shfl_xor_sync(unsigned, unsigned v, int d) { return exchange(v, (threadIdx.x & 31u) ^ (unsigned)d); }
inline float __shfl_xor_sync(unsigned, float v, int d) {
  return __uint_as_float(exchange(__float_as_uint(v), (threadIdx.x & 31u) ^ (unsigned)d));
}
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
struct __nv_bfloat162 { uint16_t x, y; };
inline uint16_t bf16_rn(float f) {  // cvt.rn.bf16.f32
  uint32_t b = __float_as_uint(f);
  if (std::isnan(f)) return (uint16_t)((b >> 16) | 0x40);
  return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {bf16_rn(a), bf16_rn(b)}; }

#include <ep_core/ll_native.cuh>

// One host thread per CUDA thread of a block, reused by the grid's blocks in turn: a block starts when every thread of
// the one before has returned (`done`, apart from __syncthreads' barrier), as if each block had threads of its own.
template <class F>
void launch(unsigned grid, unsigned block, F body) {
  std::barrier<> bb(block), done(block);
  BlockState st;
  st.block = &bb;
  for (unsigned w = 0; w < block / 32; ++w) st.warps.push_back(new std::barrier<>(32));
  std::vector<std::thread> ts;
  for (unsigned t = 0; t < block; ++t)
    ts.emplace_back([=, &st, &done] {
      threadIdx = {t, 0, 0};
      blockDim = {block, 1, 1};
      gridDim = {grid, 1, 1};
      g_b = &st;
      for (unsigned bx = 0; bx < grid; ++bx) {
        blockIdx = {bx, 0, 0};
        body();
        done.arrive_and_wait();
      }
    });
  for (auto& t : ts) t.join();
  for (auto* b : st.warps) delete b;
}

static std::string g_dir;
// EP_EMU_OWN_BY_TOKEN=1: every receive with local_direct runs it as 2 (own rows by token; EPKIT_LL_OWN_BY_TOKEN)
static int recv_direct(int direct) {
  const char* v = std::getenv("EP_EMU_OWN_BY_TOKEN");
  return direct && v != nullptr && v[0] == '1' ? 2 : direct;
}
template <class T> std::vector<T> rd(const std::string& name, size_t n) {
  std::vector<T> v(n);
  FILE* f = std::fopen((g_dir + "/" + name).c_str(), "rb");
  if (!f || std::fread(v.data(), sizeof(T), n, f) != n) { std::fprintf(stderr, "read %s\n", name.c_str()); std::exit(2); }
  std::fclose(f);
  return v;
}
template <class T> void wr(const std::string& name, const std::vector<T>& v) {
  FILE* f = std::fopen((g_dir + "/" + name).c_str(), "wb");
  std::fwrite(v.data(), sizeof(T), v.size(), f);
  std::fclose(f);
}

// The concurrent mode (argv: concurrent dir N E T K H M local_direct rounds seed): each rank a process of its own
// (the N regions in one shared mapping, so every rank's peer table holds the same addresses), running its own
// stream's sequence of calls the way the host issues them (every call the other half; a round is D, C or, every
// third round, D, D, C with the combine on the second dispatch's handle), with random pauses before each kernel
// (the stand-in for other work on the stream, a GEMM, a late host): the ranks' kernels interleave as on a GPU shared
// by the ranks. Inputs x{q}, idx{q}, w{q} as below; outputs c{q}_{count,range,src,recv,comb}_{rank}, err_{rank}.
int run_concurrent(char** argv) {
  g_dir = argv[2];
  const int n = atoi(argv[3]), ne = atoi(argv[4]), nt = atoi(argv[5]), nk = atoi(argv[6]), h = atoi(argv[7]);
  const int m = atoi(argv[8]), direct = atoi(argv[9]), rounds = atoi(argv[10]), seed = atoi(argv[11]);
  const int epr = ne / n, slots = n * m, block = 64, timeout_ms = 20000;
  const ep_lln::Layout L(epr, n, ne, m, nk, h);
  const int64_t front = ep_lln::header_bytes(n), per = (front + 2 * L.half_bytes + 255) / 256 * 256;
  void* mem = mmap(nullptr, (size_t)(per * n), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return 3;
  auto base = [&](int r) { return static_cast<uint8_t*>(mem) + per * r; };
  std::vector<uint64_t> peers(n);
  for (int r = 0; r < n; ++r) {
    peers[r] = (uint64_t)(uintptr_t)base(r);
    for (int hf = 0; hf < 2; ++hf)  // stale bytes in every slot (only the flags start at 0)
      std::memset(base(r) + front + hf * L.half_bytes + L.ddata, 0x5A, L.half_bytes - L.ddata);
  }
  std::vector<pid_t> kids;
  for (int r = 0; r < n; ++r) {
    const pid_t pid = fork();
    if (pid < 0) return 4;
    if (pid > 0) {
      kids.push_back(pid);
      continue;
    }
    std::mt19937 rng(seed * 131 + r);
    auto pause = [&] { std::this_thread::sleep_for(std::chrono::microseconds(rng() % 3000)); };
    int* err = reinterpret_cast<int*>(base(r));
    std::vector<int> herr(4 + n + 5, 0);
    int half = 0;  // the host's toggle: every call takes the other half
    std::vector<int> lane_pos((size_t)nt * nk + 1), count(epr);
    std::vector<uint16_t> recv((size_t)epr * slots * h), y((size_t)epr * slots * h), comb((size_t)nt * h);
    std::vector<int> src((size_t)epr * slots), lanes((size_t)epr * slots);
    std::vector<int64_t> range((size_t)epr * n);
    for (int q = 1; q <= rounds; ++q) {
      auto x = rd<uint16_t>("x" + std::to_string(q), (size_t)n * nt * h);
      auto idx = rd<int64_t>("idx" + std::to_string(q), (size_t)n * nt * nk);
      auto w = rd<float>("w" + std::to_string(q), (size_t)n * nt * nk);
      const uint16_t* xr = x.data() + (size_t)r * nt * h;
      const int64_t* ir = idx.data() + (size_t)r * nt * nk;
      const float* wr_ = w.data() + (size_t)r * nt * nk;
      for (int d = 0; d < (q % 3 == 0 ? 2 : 1); ++d) {  // the dispatch (twice every third round)
        uint8_t* own = base(r) + front + half * L.half_bytes;
        half ^= 1;
        pause();
        if (n > 1 || !direct)
          launch(ne, block, [&] {
            ep_lln_dispatch_send(reinterpret_cast<const uint8_t*>(xr), h * 2, 0, ir, 1, nt, nk, h, ne, n, r, m,
                                 peers.data(), base(r), own, 0, direct, lane_pos.data(), err, herr.data(), nullptr, 0);
          });
        pause();
        launch(epr, block, [&] {
          ep_lln_dispatch_recv(nk, h, ne, n, r, m, own, 0, 0, recv.data(), nullptr, src.data(), lanes.data(),
                               count.data(), range.data(), nullptr, reinterpret_cast<const uint8_t*>(xr), h * 2, 0,
                               ir, 1, nt, recv_direct(direct), lane_pos.data(), timeout_ms, err, herr.data(), nullptr,
                               0);
        });
      }
      for (int e = 0; e < epr; ++e)  // the experts: y = bf16(fp32(row) * (1 + g / 8))
        for (int j = 0; j < count[e]; ++j)
          for (int c = 0; c < h; ++c) {
            const size_t i = ((size_t)e * slots + j) * h + c;
            y[i] = bf16_rn(ep_ll::mul_rn(__uint_as_float((uint32_t)recv[i] << 16), 1.0f + (r * epr + e) / 8.0f));
          }
      uint8_t* own = base(r) + front + half * L.half_bytes;
      half ^= 1;
      pause();
      if (n > 1 || !direct)
        launch(epr, block, [&] {
          ep_lln_combine_send(reinterpret_cast<const uint4*>(y.data()), src.data(), lanes.data(), range.data(), nk,
                              h, ne, n, r, m, peers.data(), base(r), own, direct, err, herr.data(), nullptr, 0);
        });
      pause();
      launch(2, 64, [&] {
        ep_lln_combine_recv(ir, 1, wr_, nt, nk, h, ne, n, r, m, own, reinterpret_cast<uint4*>(comb.data()),
                            reinterpret_cast<const uint4*>(y.data()), range.data(), lane_pos.data(), direct,
                            timeout_ms, err, herr.data(), nullptr, 0);
      });
      const std::string p = "c" + std::to_string(q) + "_";
      wr(p + "count_" + std::to_string(r), count);
      wr(p + "range_" + std::to_string(r), range);
      wr(p + "src_" + std::to_string(r), src);
      wr(p + "recv_" + std::to_string(r), recv);
      wr(p + "comb_" + std::to_string(r), comb);
    }
    wr("err_" + std::to_string(r), std::vector<int>{*err, herr[0], herr[1], herr[2], herr[3]});
    std::_Exit(0);
  }
  int bad = 0;
  for (pid_t pid : kids) {
    int st = 0;
    waitpid(pid, &st, 0);
    bad |= !WIFEXITED(st) || WEXITSTATUS(st) != 0;
  }
  munmap(mem, (size_t)(per * n));
  return bad ? 5 : 0;
}

// The dispatch mode (argv: dispatch dir N E T K H M local_direct round_scale ue8m0 by_token fp8): one dispatch of
// every rank, FP8: ep_lln_cast_fp8 into a staging buffer, ep_lln_dispatch_send copying it, ep_lln_dispatch_recv
// copying the messages and (by_token 0) this rank's staged rows or (by_token 1, with local_direct: local_direct 2)
// casting them from x token by token; bf16 (fp8 0): the same with x for the staging. Inputs x1, idx1 as below;
// outputs f_count_{rank}, f_q_{rank} (uint8 [E_local][N*M][H], bf16: uint16), f_s_{rank} (float32
// [E_local][H/128][N*M], ue8m0: int32 [E_local][H/512][N*M]), f_src_{rank}, f_lanes_{rank}, f_range_{rank},
// f_pos_{rank} (lane_pos), f_err_{rank}.
int run_dispatch(char** argv) {
  g_dir = argv[2];
  const int n = atoi(argv[3]), ne = atoi(argv[4]), nt = atoi(argv[5]), nk = atoi(argv[6]), h = atoi(argv[7]);
  const int m = atoi(argv[8]), direct = atoi(argv[9]), rs = atoi(argv[10]), ue = atoi(argv[11]);
  const int by_token = atoi(argv[12]) && direct, fp8 = atoi(argv[13]), epr = ne / n, slots = n * m, block = 64;
  const int sig = fp8 << 16 | rs << 17 | ue << 18, stride = fp8 ? (h + 4 * (h / 128) + 15) / 16 * 16 : h * 2;
  const ep_lln::Layout L(epr, n, ne, m, nk, h);
  const int64_t front = ep_lln::header_bytes(n);
  std::vector<std::vector<uint64_t>> region(n, std::vector<uint64_t>((front + 2 * L.half_bytes) / 8 + 2, 0));
  std::vector<uint64_t> peers(n);
  auto base = [&](int r) { return reinterpret_cast<uint8_t*>(region[r].data()); };
  for (int r = 0; r < n; ++r) {
    peers[r] = (uint64_t)(uintptr_t)base(r);
    std::memset(base(r) + front + L.ddata, 0x5A, L.half_bytes - L.ddata);  // stale message bytes
  }
  auto x = rd<uint16_t>("x1", (size_t)n * nt * h);
  auto idx = rd<int64_t>("idx1", (size_t)n * nt * nk);
  std::vector<std::vector<uint64_t>> staging(n, std::vector<uint64_t>((size_t)nt * stride / 8 + 1, ~0ull));
  auto xr = [&](int r) { return reinterpret_cast<const uint8_t*>(x.data() + (size_t)r * nt * h); };
  auto staged = [&](int r) { return fp8 ? reinterpret_cast<const uint8_t*>(staging[r].data()) : xr(r); };
  std::vector<std::vector<int>> lane_pos(n, std::vector<int>((size_t)nt * nk + 1, -7));
  std::vector<std::vector<int>> herr(n, std::vector<int>(9 + n));
  for (int r = 0; r < n && fp8; ++r)
    launch(nt, block, [&] {
      ep_lln_cast_fp8(reinterpret_cast<const uint4*>(x.data() + (size_t)r * nt * h), h, rs,
                      reinterpret_cast<uint8_t*>(staging[r].data()), stride);
    });
  for (int r = 0; r < n && (n > 1 || !direct); ++r)
    launch(ne, block, [&] {
      ep_lln_dispatch_send(staged(r), stride, rs, idx.data() + (size_t)r * nt * nk, 1, nt, nk, h, ne, n, r, m,
                           peers.data(), base(r), base(r) + front, fp8, direct, lane_pos[r].data(),
                           reinterpret_cast<int*>(base(r)), herr[r].data(), nullptr, sig);
    });
  for (int r = 0; r < n; ++r) {
    std::vector<uint8_t> q((size_t)epr * slots * h * (fp8 ? 1 : 2), 0xEE);
    std::vector<uint8_t> sc((size_t)epr * slots * (h / 128) * (ue ? 1 : 4), 0xEE);
    std::vector<int> count(epr), src((size_t)epr * slots), lanes(src);
    std::vector<int64_t> range((size_t)epr * n);
    launch(epr, block, [&] {
      ep_lln_dispatch_recv(nk, h, ne, n, r, m, base(r) + front, fp8, ue, q.data(), fp8 ? sc.data() : nullptr,
                           src.data(), lanes.data(), count.data(), range.data(), nullptr, by_token ? xr(r) : staged(r),
                           by_token ? h * 2 : stride, rs,
                           idx.data() + (size_t)r * nt * nk, 1, nt, by_token ? 2 : direct, lane_pos[r].data(), 2000,
                           reinterpret_cast<int*>(base(r)), herr[r].data(), nullptr, sig);
    });
    wr("f_count_" + std::to_string(r), count);
    wr("f_q_" + std::to_string(r), q);
    wr("f_s_" + std::to_string(r), sc);
    wr("f_src_" + std::to_string(r), src);
    wr("f_lanes_" + std::to_string(r), lanes);
    wr("f_range_" + std::to_string(r), range);
    wr("f_pos_" + std::to_string(r), lane_pos[r]);
    wr("f_err_" + std::to_string(r), std::vector<int>{*reinterpret_cast<int*>(base(r)), herr[r][0], herr[r][4 + n]});
  }
  return 0;
}

// The envelope mode (issue 41; argv: envelope dir N E T K H M local_direct culprit fault): three rounds of every rank
// with no ep_lln_clean between them; in round 1 `culprit` makes the fault: 1 its dispatch with another signature word
// (the FP8 bit), 2 ep_lln_abort instead of its dispatch (then no rank combines: every host raised at the dispatch),
// 3 its combine with another signature word (the LogFMT bit), 4 ep_lln_abort instead of its combine. Outputs as below.
static int g_culprit = -1, g_fault = 0, g_no_clean = 0;

// argv: dir N E T K H M use_mask lost local_direct logfmt timeout_ms rounds late
// inputs (per round q = 1, 2): x{q} bf16 [N][T][H], idx{q} int64 [N][T][K], w{q} f32 [N][T][K]; umask int32 [N][N]
// (round 1's user masks; `lost` sits out round 1, or with `late` runs it after the others' whole step). Round 2 (rounds == 2) follows ep_lln_clean on every rank, with
// every rank and no mask. Outputs r{q}_{count,range,src,recv,comb}_{rank}, then mask_{rank}, herr_{rank}, err_{rank}.
int main(int argc, char** argv) {
  if (argc == 12 && std::string(argv[1]) == "concurrent") return run_concurrent(argv);
  if (argc == 14 && std::string(argv[1]) == "dispatch") return run_dispatch(argv);
  if (argc == 12 && std::string(argv[1]) == "envelope") {
    g_culprit = atoi(argv[10]);
    g_fault = atoi(argv[11]);
    g_no_clean = 1;
    std::string dir = argv[2], d = argv[9];
    const char* args[] = {argv[0], dir.c_str(), argv[3], argv[4], argv[5], argv[6], argv[7], argv[8], "0", "-1",
                          d.c_str(), "0", "2000", "3", "0"};
    return main(15, const_cast<char**>(args));
  }
  if (argc != 15) return 1;
  g_dir = argv[1];
  const int n = atoi(argv[2]), ne = atoi(argv[3]), nt = atoi(argv[4]), nk = atoi(argv[5]), h = atoi(argv[6]);
  const int m = atoi(argv[7]), use_mask = atoi(argv[8]), lost = atoi(argv[9]), direct = atoi(argv[10]);
  const int logfmt = atoi(argv[11]), timeout_ms = atoi(argv[12]), rounds = atoi(argv[13]), late = atoi(argv[14]);
  const int epr = ne / n, slots = n * m, block = 64;
  const ep_lln::Layout L(epr, n, ne, m, nk, h);
  const int64_t front = ep_lln::header_bytes(n), total = front + 2 * L.half_bytes;
  std::vector<std::vector<uint64_t>> region(n, std::vector<uint64_t>(total / 8 + 2, 0));
  std::vector<uint64_t> peers(n);
  for (int r = 0; r < n; ++r) peers[r] = (uint64_t)(uintptr_t)region[r].data();
  auto base = [&](int r) { return reinterpret_cast<uint8_t*>(region[r].data()); };
  for (int r = 0; r < n; ++r)  // stale bytes in every slot (only the flags start at 0): a lane read by mistake shows
    for (int hf = 0; hf < 2; ++hf)
      std::memset(base(r) + front + hf * L.half_bytes + L.ddata, 0x5A, L.half_bytes - L.ddata);
  std::vector<std::vector<int>> mask(n, std::vector<int>(n + 1, 0)), herr(n, std::vector<int>(4 + n + 5, 0));
  auto umask = rd<int32_t>("umask", (size_t)n * n);
  for (int r = 0; r < n; ++r)
    for (int p = 0; p < n; ++p) mask[r][p] = umask[r * n + p];
  auto mp = [&](int r) { return use_mask ? mask[r].data() : (int*)nullptr; };
  auto err = [&](int r) { return reinterpret_cast<int*>(base(r)); };
  for (int q = 1; q <= rounds; ++q) {
    auto x = rd<uint16_t>("x" + std::to_string(q), (size_t)n * nt * h);
    auto idx = rd<int64_t>("idx" + std::to_string(q), (size_t)n * nt * nk);
    auto w = rd<float>("w" + std::to_string(q), (size_t)n * nt * nk);
    std::vector<std::vector<int>> lane_pos(n, std::vector<int>((size_t)nt * nk + 1));
    std::vector<std::vector<uint16_t>> recv(n, std::vector<uint16_t>((size_t)epr * slots * h));
    std::vector<std::vector<int>> src(n, std::vector<int>((size_t)epr * slots)), lanes = src;
    std::vector<std::vector<int>> count(n, std::vector<int>(epr));
    std::vector<std::vector<int64_t>> range(n, std::vector<int64_t>((size_t)epr * n));
    std::vector<std::vector<uint16_t>> y(n, std::vector<uint16_t>((size_t)epr * slots * h, 0));
    std::vector<std::vector<uint16_t>> comb(n, std::vector<uint16_t>((size_t)nt * h + 8));
    // the envelope mode's fault of round 1 (`g_fault`): the culprit's signature words, its aborts
    auto fault = [&](int r, int f) { return q == 1 && r == g_culprit && g_fault == f; };
    auto abort_call = [&](int r, int which, uint8_t* half) {
      launch(1, block, [&] {
        ep_lln_abort(peers.data(), base(r), half, nk, h, ne, n, r, m, which, (int)0x80000001u, err(r));
      });
    };
    auto step = [&](const std::vector<int>& group) {
      // a step uses half 0 for the dispatch, half 1 for the combine (the host's toggle; clean restarts at half 0)
      for (int r : group) {  // one rank with the local shortcut: no send (ll_kernels.native_dispatch)
        if (fault(r, 2)) {
          abort_call(r, 0, base(r) + front);
          continue;
        }
        if (n == 1 && direct) continue;
        const uint16_t* xr = x.data() + (size_t)r * nt * h;
        const int64_t* ir = idx.data() + (size_t)r * nt * nk;
        launch(ne, block, [&] {
          ep_lln_dispatch_send(reinterpret_cast<const uint8_t*>(xr), h * 2, 0, ir, 1, nt, nk, h, ne, n, r, m,
                               peers.data(), base(r), base(r) + front, 0, direct, lane_pos[r].data(), err(r),
                               herr[r].data(), mp(r), fault(r, 1) ? 1 << 16 : 0);
        });
      }
      for (int r : group) {
        if (fault(r, 2)) continue;  // its receive does not run
        const uint16_t* xr = x.data() + (size_t)r * nt * h;
        const int64_t* ir = idx.data() + (size_t)r * nt * nk;
        launch(epr, block, [&] {
          ep_lln_dispatch_recv(nk, h, ne, n, r, m, base(r) + front, 0, 0, recv[r].data(), nullptr, src[r].data(),
                               lanes[r].data(), count[r].data(), range[r].data(), nullptr,
                               reinterpret_cast<const uint8_t*>(xr), h * 2, 0, ir, 1, nt, recv_direct(direct),
                               lane_pos[r].data(), timeout_ms, err(r), herr[r].data(), mp(r), fault(r, 1) ? 1 << 16 : 0);
        });
      }
      if (g_fault == 2 && q == 1) return;  // every rank raised at the dispatch: no combine
      // the experts: y = bf16(fp32(row) * (1 + g / 8))
      for (int r : group)
        for (int e = 0; e < epr; ++e)
          for (int j = 0; j < count[r][e]; ++j)
            for (int c = 0; c < h; ++c) {
              const size_t i = ((size_t)e * slots + j) * h + c;
              y[r][i] = bf16_rn(ep_ll::mul_rn(__uint_as_float((uint32_t)recv[r][i] << 16), 1.0f + (r * epr + e) / 8.0f));
            }
      for (int r : group) {
        if (fault(r, 4)) {
          abort_call(r, 1, base(r) + front + L.half_bytes);
          continue;
        }
        auto body = [&] {
          auto f = logfmt ? ep_lln_combine_send_logfmt : ep_lln_combine_send;
          f(reinterpret_cast<const uint4*>(y[r].data()), src[r].data(), lanes[r].data(), range[r].data(), nk, h, ne,
            n, r, m, peers.data(), base(r), base(r) + front + L.half_bytes, direct && !logfmt, err(r), herr[r].data(),
            mp(r), fault(r, 3) ? 1 << 18 : 0);
        };
        if (n > 1 || !direct || logfmt) launch(epr, block, body);
      }
      for (int r : group) {
        if (fault(r, 4)) continue;
        const int chunks = (h / 8 + block - 1) / block, items = nt * chunks;
        const int64_t* ir = idx.data() + (size_t)r * nt * nk;
        const float* wr_ = w.data() + (size_t)r * nt * nk;
        launch(items > 0 ? items : 1, block, [&] {
          auto f = logfmt ? ep_lln_combine_recv_logfmt : ep_lln_combine_recv;
          f(ir, 1, wr_, nt, nk, h, ne, n, r, m, base(r) + front + L.half_bytes,
            reinterpret_cast<uint4*>(comb[r].data()), reinterpret_cast<const uint4*>(y[r].data()), range[r].data(),
            lane_pos[r].data(), direct && !logfmt, timeout_ms, err(r), herr[r].data(), mp(r),
            fault(r, 3) ? 1 << 18 : 0);
        });
      }
    };
    // round 1: `lost` sits out (late == 0) or runs its whole step after the others finished theirs (late == 1)
    std::vector<int> others, all;
    for (int r = 0; r < n; ++r) {
      all.push_back(r);
      if (r != lost) others.push_back(r);
    }
    if (q == 2 || lost < 0) {
      step(all);
    } else {
      step(others);
      if (late) step({lost});
    }
    const std::string p = "r" + std::to_string(q) + "_";
    for (int r = 0; r < n; ++r) {
      wr(p + "count_" + std::to_string(r), count[r]);
      wr(p + "range_" + std::to_string(r), range[r]);
      wr(p + "src_" + std::to_string(r), src[r]);
      wr(p + "recv_" + std::to_string(r), recv[r]);
      comb[r].resize((size_t)nt * h);
      wr(p + "comb_" + std::to_string(r), comb[r]);
      wr("mask" + std::to_string(q) + "_" + std::to_string(r), mask[r]);
      wr("herr" + std::to_string(q) + "_" + std::to_string(r), herr[r]);
      wr("err" + std::to_string(q) + "_" + std::to_string(r), std::vector<int>{*err(r)});
    }
    if (q < rounds && !g_no_clean) {  // rejoin: ep_lln_clean on every rank at once (its barriers; a generous bound: host threads), gen 1
      std::vector<std::thread> ranks;
      for (int r = 0; r < n; ++r)
        ranks.emplace_back([&, r] {
          launch(1, block, [&] {
            ep_lln_clean(peers.data(), base(r), nk, h, ne, n, r, m, 1, 20000, err(r), herr[r].data(), mask[r].data());
          });
        });
      for (auto& t : ranks) t.join();
    }
  }
  return 0;
}
