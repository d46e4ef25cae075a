// Host emulation of ep_core/ll_pack.cuh for test_torch_legacy_ll_kernels.py: one std::thread per CUDA thread of a block
// (reused by the grid's blocks), std::barrier for __syncthreads and the warp collectives (every use in these kernels is
// reached by the whole block / warp).
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

struct dim3e { unsigned x = 1, y = 1, z = 1; };
thread_local dim3e threadIdx, blockIdx;
dim3e blockDim, gridDim;
static std::barrier<>* g_block;
static std::vector<std::barrier<>*> g_warp;
static unsigned g_ballot[32];
static float g_shfl[1024];

#define EP_LL_HOST_EMULATION 1
#define EP_LL_DYNAMIC_SMEM(type, name) static type name[65536]
#define __global__
#define __device__
#define __host__
#define __shared__ static
#define __launch_bounds__(n)
struct int4 { int x, y, z, w; };
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct float4 { float x, y, z, w; };
inline int4 make_int4(int a, int b, int c, int d) { return {a, b, c, d}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline void __syncthreads() { g_block->arrive_and_wait(); }
inline std::barrier<>& warp_bar() { return *g_warp[threadIdx.x / 32]; }
inline unsigned __ballot_sync(unsigned, bool pred) {
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  warp_bar().arrive_and_wait();
  if (pred) __atomic_fetch_or(&g_ballot[w], 1u << l, __ATOMIC_SEQ_CST);
  warp_bar().arrive_and_wait();
  const unsigned r = __atomic_load_n(&g_ballot[w], __ATOMIC_SEQ_CST);
  warp_bar().arrive_and_wait();
  if (l == 0) __atomic_store_n(&g_ballot[w], 0u, __ATOMIC_SEQ_CST);
  warp_bar().arrive_and_wait();
  return r;
}
inline float __shfl_xor_sync(unsigned, float v, int d) {
  warp_bar().arrive_and_wait();
  g_shfl[threadIdx.x] = v;
  warp_bar().arrive_and_wait();
  const float r = g_shfl[(threadIdx.x & ~31u) | ((threadIdx.x & 31u) ^ (unsigned)d)];
  warp_bar().arrive_and_wait();
  return r;
}
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
struct __nv_bfloat162 { uint16_t x, y; };
inline uint16_t bf16_rn(float f) {  // cvt.rn.bf16.f32
  uint32_t b = __float_as_uint(f);
  if (std::isnan(f)) return (uint16_t)((b >> 16) | 0x40);
  return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {bf16_rn(a), bf16_rn(b)}; }

#include <ep_core/ll_pack.cuh>

template <class F>
void launch(dim3e grid, unsigned block, F body) {
  gridDim = grid;
  blockDim = {block, 1, 1};
  // One host thread per CUDA thread of a block, reused by the grid's blocks in turn: a block starts when every thread
  // of the one before has returned (`done`, apart from __syncthreads' barrier), as if each block had threads of its own
  // (a thread a block was 145,000 thread starts a test run).
  std::barrier<> bb(block), done(block);
  std::vector<std::barrier<>*> wb;
  for (unsigned w = 0; w < block / 32; ++w) wb.push_back(new std::barrier<>(32));
  g_block = &bb;
  g_warp = wb;
  std::vector<std::thread> ts;
  for (unsigned t = 0; t < block; ++t)
    ts.emplace_back([=, &done] {
      threadIdx = {t, 0, 0};
      for (unsigned by = 0; by < grid.y; ++by)
        for (unsigned bx = 0; bx < grid.x; ++bx) {
          blockIdx = {bx, by, 0};
          body();
          done.arrive_and_wait();
        }
    });
  for (auto& t : ts) t.join();
  for (auto* b : wb) delete b;
}

static std::string g_dir;
template <class T> std::vector<T> rd(const char* name, size_t n) {
  std::vector<T> v(n);
  FILE* f = std::fopen((g_dir + "/" + name).c_str(), "rb");
  if (!f || std::fread(v.data(), sizeof(T), n, f) != n) { std::fprintf(stderr, "read %s\n", name); std::exit(2); }
  std::fclose(f);
  return v;
}
template <class T> void wr(const std::string& name, const std::vector<T>& v) {
  FILE* f = std::fopen((g_dir + "/" + name).c_str(), "wb");
  std::fwrite(v.data(), sizeof(T), v.size(), f);
  std::fclose(f);
}

// argv: dir R K H epr n M nv by_key T; inputs and outputs are raw files in dir (the test writes and reads them)
int main(int argc, char** argv) {
  if (argc != 11) return 1;
  g_dir = argv[1];
  const int R = std::atoi(argv[2]), K = std::atoi(argv[3]), H = std::atoi(argv[4]), epr = std::atoi(argv[5]);
  const int n = std::atoi(argv[6]), M = std::atoi(argv[7]), nv0 = std::atoi(argv[8]), by_key = std::atoi(argv[9]);
  const int T = std::atoi(argv[10]);
  const int slots = n * M;
  const int nv[1] = {nv0};
  auto x = rd<uint16_t>("recv_x", (size_t)R * H);
  auto idx = rd<int64_t>("recv_idx", (size_t)R * K);
  auto meta = rd<int32_t>("meta", (size_t)R * (K + 2));
  std::vector<int32_t> order(slots);
  std::vector<int64_t> lane_slot((size_t)R * K, -99);  // -99: never written (every lane must be)
  std::vector<uint8_t> lane_ok_b((size_t)R * K);
  bool* lane_ok = reinterpret_cast<bool*>(lane_ok_b.data());
  std::vector<int32_t> src_info((size_t)epr * slots), recv_count(epr);
  std::vector<int64_t> layout_range((size_t)epr * n);
  if (by_key)
    launch({1}, 1024, [&] { ep_ll_order(meta.data(), K + 2, nv, slots, order.data()); });
  launch({(unsigned)epr}, 256, [&] {
    ep_ll_layout(idx.data(), 1, K, meta.data(), K + 2, nv, by_key ? order.data() : nullptr, R, by_key ? slots : R, M, n,
                 slots, lane_slot.data(), lane_ok, src_info.data(), recv_count.data(), layout_range.data());
  });
  wr("lane_slot", lane_slot); wr("lane_ok", lane_ok_b); wr("src_info", src_info); wr("recv_count", recv_count);
  wr("layout_range", layout_range);
  const int vecs = H * 2 / 16;
  std::vector<uint16_t> packed((size_t)epr * slots * H, 0);
  launch({(unsigned)R, (unsigned)((vecs + 255) / 256)}, 256, [&] {
    ep_ll_pack_bf16(reinterpret_cast<const int4*>(x.data()), vecs, lane_slot.data(), lane_ok, K, nv,
                    reinterpret_cast<int4*>(packed.data()));
  });
  wr("packed", packed);
  const int groups = H / 128;
  for (int mode = 0; mode < 3; ++mode) {
    const int rs = mode >= 1, ue = mode == 2;
    std::vector<uint8_t> q((size_t)epr * slots * H, 0);
    std::vector<uint32_t> s((size_t)epr * slots * (ue ? groups / 4 : groups), 0);
    launch({(unsigned)R, (unsigned)((groups + 7) / 8)}, 256, [&] {
      ep_ll_pack_fp8(reinterpret_cast<const uint2*>(x.data()), H, lane_slot.data(), lane_ok, K, nv,
                     reinterpret_cast<uint32_t*>(q.data()), s.data(), slots, rs, ue);
    });
    wr("q" + std::to_string(mode), q); wr("s" + std::to_string(mode), s);
  }
  // combine side: gather of lanes [1, K) (lane0 = 1) from y, and the weighted sum in two groups
  auto y = rd<uint16_t>("y", (size_t)epr * slots * H);
  const int g = K - 1;
  std::vector<uint16_t> wide((size_t)R * g * H, 0xFFFF);
  launch({(unsigned)R, (unsigned)((vecs + 255) / 256)}, 256, [&] {
    ep_ll_gather(reinterpret_cast<const int4*>(y.data()), vecs, lane_slot.data(), lane_ok, K, 1, g, nv,
                 reinterpret_cast<int4*>(wide.data()));
  });
  wr("wide", wide);
  auto yc = rd<uint16_t>("yc", (size_t)T * K * H);
  auto tk = rd<int64_t>("topk", (size_t)T * K);
  auto w = rd<float>("w", (size_t)T * K);
  std::vector<uint16_t> out((size_t)T * H), out1((size_t)T * H);
  std::vector<float> acc((size_t)T * H);
  const int h8 = H / 8;
  launch({(unsigned)((h8 + 127) / 128), (unsigned)T}, 128, [&] {  // all K lanes at once
    ep_ll_weighted_sum(reinterpret_cast<const uint4*>(yc.data()), H, tk.data(), 1, w.data(), K, 0, K, nullptr, 1, 1,
                       reinterpret_cast<uint4*>(out.data()));
  });
  // lanes [0, 2) then [2, K): y split into two [T, lanes, H] arrays, chained through acc
  std::vector<uint16_t> ya((size_t)T * 2 * H), yb((size_t)T * (K - 2) * H);
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k)
      std::memcpy(k < 2 ? &ya[((size_t)t * 2 + k) * H] : &yb[((size_t)t * (K - 2) + k - 2) * H],
                  &yc[((size_t)t * K + k) * H], 2 * H);
  launch({(unsigned)((h8 + 127) / 128), (unsigned)T}, 128, [&] {
    ep_ll_weighted_sum(reinterpret_cast<const uint4*>(ya.data()), H, tk.data(), 1, w.data(), K, 0, 2,
                       reinterpret_cast<float4*>(acc.data()), 1, 0, nullptr);
  });
  launch({(unsigned)((h8 + 127) / 128), (unsigned)T}, 128, [&] {
    ep_ll_weighted_sum(reinterpret_cast<const uint4*>(yb.data()), H, tk.data(), 1, w.data(), K, 2, K - 2,
                       reinterpret_cast<float4*>(acc.data()), 0, 1, reinterpret_cast<uint4*>(out1.data()));
  });
  wr("wsum", out); wr("wsum2", out1);
  return 0;
}
