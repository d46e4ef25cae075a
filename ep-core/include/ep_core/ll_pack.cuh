// V1 low-latency mode's kernels around ep's dispatch and combine (ep_core.ll_pack compiles and launches them for
// ep_torch.legacy_ll_kernels, which passes its tensors' addresses; framework-agnostic: pointers and ints only).
// Bit for bit the torch composition in ep_torch.legacy_ll (its reference in the tests): the same packed order,
// the same FP8 cast (torch's float -> e4m3 conversion), the same fp32 lane sum (separate multiply and add).
//
// Dispatch epilogue, after ep's non-expand dispatch (rows `r < num_valid` are real):
//   ep_ll_order   (rows not in V1's order: hybrid, non-deterministic; one block) order[key] = r for
//                 key = src_rank * M + src_token: scanning `order` visits rows in V1's order
//   ep_ll_layout  (one block per local expert) the expert's packed positions by a block-wide prefix over rows
//                 in (source rank, source token) order; lane_slot, lane_ok, src_info, recv_count, layout_range
//   ep_ll_pack_bf16 / ep_ll_pack_fp8 (one block row per received row) the row copied (or cast once) into the
//                 slot of each of its lanes on this rank; scales column-major [E_local, G, N*M]
// Combine:
//   ep_ll_gather  each received row's lanes [lane0, lane0 + lanes) from the packed layout into one wide row
//   ep_ll_weighted_sum  acc = +0 then acc = acc + fp32(y) * w per lane in ascending order, one bf16 rounding
// Shapes are fixed (worst case) and counts are read on the GPU: no host sync, capturable in a CUDA graph.
#pragma once

#ifndef EP_LL_HOST_EMULATION  // the CPU tests run these kernels on host threads with CUDA's names shimmed
#include <cuda_bf16.h>
#endif
#include <stdint.h>

#ifndef EP_LL_DYNAMIC_SMEM
#define EP_LL_DYNAMIC_SMEM(type, name) extern __shared__ type name[]
#endif

#ifndef EP_LL_MAX_TOPK
#define EP_LL_MAX_TOPK 128  // lanes of one row kept in shared memory (ep_core.ll_pack.MAX_TOPK; callers check num_topk)
#endif

namespace ep_ll {

__host__ __device__ inline uint32_t f2u(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
#endif
}

__host__ __device__ inline float u2f(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
#endif
}

// IEEE round-to-nearest fp32 ops the compiler may not contract or approximate (host: SSE, also exact).
__host__ __device__ inline float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  volatile float s = a + b;
  return s;
#endif
}

__host__ __device__ inline float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  volatile float p = a * b;
  return p;
#endif
}

__host__ __device__ inline float div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  volatile float q = a / b;
  return q;
#endif
}

// torch's float -> float8_e4m3fn (c10 fp8e4m3fn_from_fp32_value): round to nearest even on the bits, NaN stays
// NaN, finite overflow saturates (unreachable here: |x / scale| <= 448 up to one rounding).
__host__ __device__ inline uint32_t e4m3_bits(float f) {
  const uint32_t fp8_max = 1087u << 20;      // 480.0f: the first value past e4m3's range
  const uint32_t denorm_mask = 141u << 23;  // ((127 - 7) + (23 - 3) + 1) << 23
  uint32_t b = f2u(f);
  const uint32_t sign = b & 0x80000000u;
  b ^= sign;
  uint32_t res;
  if (b >= fp8_max) {
    res = b > 0x7F800000u ? 0x7Fu : 0x7Eu;
  } else if (b < (121u << 23)) {  // below 2^-6, e4m3's smallest normal: denormal through one fp32 add
    b = f2u(add_rn(u2f(b), u2f(denorm_mask)));
    res = (b - denorm_mask) & 0xFFu;
  } else {
    const uint32_t odd = (b >> 20) & 1u;
    b += (uint32_t)(7 - 127) * (1u << 23) + 0x7FFFFu;
    b += odd;
    res = (b >> 20) & 0xFFu;
    if (res == 0x7Fu) res = 0x7Eu;
  }
  return res | (sign >> 24);
}

// The scale of one 128-channel group: max(amax, 1e-4) / 448 (one correctly rounded division), with round_scale
// rounded up to a power of two on its bits (exponent + 1 when any mantissa bit is set). NaN amax stays NaN.
__host__ __device__ inline float fp8_scale(float amax, bool round_scale) {
  amax = amax < 1e-4f ? 1e-4f : amax;  // torch's clamp(min=1e-4): NaN compares false and stays
  float scale = div_rn(amax, 448.0f);
  if (round_scale) {
    const uint32_t bits = f2u(scale);
    const uint32_t exp = ((bits >> 23) & 0xFFu) + ((bits & 0x7FFFFFu) != 0u ? 1u : 0u);
    scale = u2f(exp << 23);
  }
  return scale;
}

// max that propagates NaN like torch's amax (order independent)
__host__ __device__ inline float nan_max(float a, float b) { return (a != a || a > b) ? a : b; }

__device__ inline int64_t load_idx(const void* p, int64_t i, int idx64) {
  return idx64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

__device__ inline float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ inline float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

// A row's source key (src_rank * M + src_token) is in range. Rows whose key or lanes are out of range (only an
// aborted dispatch leaves such garbage: its outputs are undefined) get no slot, so nothing is written out of bounds.
__host__ __device__ inline bool key_ok(int key, int tokens_per_rank, int num_ranks) {
  return key >= 0 && (int64_t)key < (int64_t)tokens_per_rank * num_ranks;
}

// The slots of row r's lanes on this rank, compacted into shared memory; returns how many (all threads).
__device__ inline int row_slots(const int64_t* lane_slot, const bool* lane_ok, int num_topk, int r,
                                int64_t* s_slot, int* s_n) {
  if (threadIdx.x == 0) {
    int n = 0;
    for (int k = 0; k < num_topk; ++k)
      if (lane_ok[(int64_t)r * num_topk + k]) s_slot[n++] = lane_slot[(int64_t)r * num_topk + k];
    *s_n = n;
  }
  __syncthreads();
  return *s_n;
}

}  // namespace ep_ll

// order[key] = row for each real row (key = recv_src_metadata[r, 0] = src_rank * M + src_token, unique per
// row), -1 where no row: scanning `order` visits rows in V1's (source rank, source token) order. One block.
extern "C" __global__ void __launch_bounds__(1024)
    ep_ll_order(const int* __restrict__ meta, int meta_stride, const int* __restrict__ num_valid, int num_keys,
                int* __restrict__ order) {
  const int nv = *num_valid;
  for (int p = threadIdx.x; p < num_keys; p += blockDim.x) order[p] = -1;
  __syncthreads();
  for (int r = threadIdx.x; r < nv; r += blockDim.x) {
    const int key = meta[(int64_t)r * meta_stride];
    if (key >= 0 && key < num_keys) order[key] = r;
  }
}

// Block e (local expert e): a prefix over rows (row order, or `order`'s when given) of "row has a lane on e" gives
// each member row its packed position. Also writes the lane slots of the rows r = e (mod E_local) whose lanes are
// not here (the dump slot E_local * slots, lane_ok false), so every lane is written exactly once.
extern "C" __global__ void __launch_bounds__(256)
    ep_ll_layout(const void* __restrict__ recv_idx, int idx64, int num_topk, const int* __restrict__ meta,
                 int meta_stride, const int* __restrict__ num_valid, const int* __restrict__ order, int num_rows,
                 int scan_len, int tokens_per_rank, int num_ranks, int slots, int64_t* __restrict__ lane_slot,
                 bool* __restrict__ lane_ok, int* __restrict__ src_info, int* __restrict__ recv_count,
                 int64_t* __restrict__ layout_range) {
  EP_LL_DYNAMIC_SMEM(int, per_src);  // [num_ranks]: this expert's rows from each source rank
  __shared__ int warp_sums[32];
  const int e = blockIdx.x, epr = gridDim.x;
  const int nv = *num_valid;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int s = threadIdx.x; s < num_ranks; s += blockDim.x) per_src[s] = 0;
  __syncthreads();
  int running = 0;  // member rows before this chunk (the same in every thread)
  for (int p0 = 0; p0 < scan_len; p0 += blockDim.x) {
    const int p = p0 + threadIdx.x;
    int r = -1;
    if (p < scan_len) r = order != nullptr ? order[p] : (p < nv ? p : -1);
    if (r >= 0 && !ep_ll::key_ok(meta[(int64_t)r * meta_stride], tokens_per_rank, num_ranks)) r = -1;
    bool member = false;
    if (r >= 0)
      for (int k = 0; k < num_topk; ++k) member |= ep_ll::load_idx(recv_idx, (int64_t)r * num_topk + k, idx64) == e;
    const unsigned ballot = __ballot_sync(0xFFFFFFFFu, member);
    if (lane == 0) warp_sums[warp] = __popc(ballot);
    __syncthreads();
    int before = running, total = 0;
    for (int w = 0; w < nwarps; ++w) {
      const int c = warp_sums[w];
      before += w < warp ? c : 0;
      total += c;
    }
    if (member) {
      const int pos = before + __popc(ballot & ((1u << lane) - 1u));
      const int64_t slot = (int64_t)e * slots + pos;
      const int key = meta[(int64_t)r * meta_stride];
      src_info[slot] = key % tokens_per_rank;
      for (int k = 0; k < num_topk; ++k) {
        const int64_t i = (int64_t)r * num_topk + k;
        if (ep_ll::load_idx(recv_idx, i, idx64) == e) {
          lane_slot[i] = slot;
          lane_ok[i] = true;
        }
      }
      atomicAdd(&per_src[key / tokens_per_rank], 1);
    }
    running += total;
    __syncthreads();  // warp_sums is rewritten by the next chunk
  }
  const int count = running;
  if (threadIdx.x == 0) {
    recv_count[e] = count;
    int64_t off = 0;
    for (int s = 0; s < num_ranks; ++s) {
      const int c = per_src[s];
      layout_range[(int64_t)e * num_ranks + s] = (off << 32) | (int64_t)c;
      off += c;
    }
  }
  for (int p = count + threadIdx.x; p < slots; p += blockDim.x) src_info[(int64_t)e * slots + p] = -1;
  const int64_t dump = (int64_t)epr * slots;
  const int owned = num_rows > e ? (num_rows - e + epr - 1) / epr : 0;  // rows e, e + E_local, ...
  for (int64_t i = threadIdx.x; i < (int64_t)owned * num_topk; i += blockDim.x) {
    const int64_t r = e + (i / num_topk) * epr;
    const int64_t li = r * num_topk + i % num_topk;
    const int64_t x = r < nv ? ep_ll::load_idx(recv_idx, li, idx64) : -1;
    if (!(x >= 0 && x < epr && ep_ll::key_ok(meta[r * meta_stride], tokens_per_rank, num_ranks))) {
      lane_slot[li] = dump;
      lane_ok[li] = false;
    }
  }
}

// Row r (blockIdx.x) copied into the packed slot of each of its lanes here: 16-byte vectors, `row_vecs` per row.
// Rows past num_valid and rows without a lane here write nothing (their slots are unspecified, as in V1).
extern "C" __global__ void __launch_bounds__(256)
    ep_ll_pack_bf16(const int4* __restrict__ x, int row_vecs, const int64_t* __restrict__ lane_slot,
                    const bool* __restrict__ lane_ok, int num_topk, const int* __restrict__ num_valid,
                    int4* __restrict__ out) {
  __shared__ int64_t s_slot[EP_LL_MAX_TOPK];
  __shared__ int s_n;
  const int r = blockIdx.x;
  if (r >= *num_valid) return;
  const int n = ep_ll::row_slots(lane_slot, lane_ok, num_topk, r, s_slot, &s_n);
  for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < row_vecs; c += gridDim.y * blockDim.x) {
    const int4 v = x[(int64_t)r * row_vecs + c];
    for (int j = 0; j < n; ++j) out[s_slot[j] * row_vecs + c] = v;
  }
}

// Row r (blockIdx.x) cast to FP8 once per 128-channel group (one warp per group, four channels per lane) and
// written to each of its lanes' slots. Scales: float32 [E_local, G, slots] (G = hidden / 128), or with ue8m0 the
// exponent byte of group g at byte g % 4 of int32 [E_local, G / 4, slots] (little-endian: V1's packing).
extern "C" __global__ void __launch_bounds__(256)
    ep_ll_pack_fp8(const uint2* __restrict__ x, int hidden, const int64_t* __restrict__ lane_slot,
                   const bool* __restrict__ lane_ok, int num_topk, const int* __restrict__ num_valid,
                   uint32_t* __restrict__ q, void* __restrict__ scales, int slots, int round_scale, int ue8m0) {
  __shared__ int64_t s_slot[EP_LL_MAX_TOPK];
  __shared__ int s_n;
  const int r = blockIdx.x;
  if (r >= *num_valid) return;
  const int n = ep_ll::row_slots(lane_slot, lane_ok, num_topk, r, s_slot, &s_n);
  if (n == 0) return;
  const int lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  const int groups = hidden / 128;
  for (int g = blockIdx.y * nwarps + (threadIdx.x >> 5); g < groups; g += gridDim.y * nwarps) {
    const uint2 v = x[((int64_t)r * hidden + g * 128) / 4 + lane];
    const float f[4] = {ep_ll::bf16_lo(v.x), ep_ll::bf16_hi(v.x), ep_ll::bf16_lo(v.y), ep_ll::bf16_hi(v.y)};
    float amax = ep_ll::nan_max(ep_ll::nan_max(fabsf(f[0]), fabsf(f[1])), ep_ll::nan_max(fabsf(f[2]), fabsf(f[3])));
    for (int d = 16; d > 0; d >>= 1) amax = ep_ll::nan_max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, d));
    const float scale = ep_ll::fp8_scale(amax, round_scale != 0);
    uint32_t packed = 0;
    for (int i = 0; i < 4; ++i) packed |= ep_ll::e4m3_bits(ep_ll::div_rn(f[i], scale)) << (8 * i);
    for (int j = 0; j < n; ++j) {
      const int64_t slot = s_slot[j];
      q[(slot * hidden + g * 128) / 4 + lane] = packed;
      if (lane == 0) {
        const int64_t e = slot / slots, s = slot - e * slots;
        if (ue8m0) {
          const int64_t word = (e * (groups / 4) + g / 4) * slots + s;
          static_cast<uint8_t*>(scales)[word * 4 + (g % 4)] = (uint8_t)((ep_ll::f2u(scale) >> 23) & 0xFFu);
        } else {
          static_cast<float*>(scales)[(e * groups + g) * slots + s] = scale;
        }
      }
    }
  }
}

// Wide combine rows: row r (blockIdx.x) gets lanes [lane0, lane0 + lanes) of its expert outputs, each the packed
// row at its lane slot, zeros for lanes not here (ep's combine then sums exactly one non-zero per lane slot).
// Rows past num_valid are not read by ep's combine and are left as they are.
extern "C" __global__ void __launch_bounds__(256)
    ep_ll_gather(const int4* __restrict__ x, int row_vecs, const int64_t* __restrict__ lane_slot,
                 const bool* __restrict__ lane_ok, int num_topk, int lane0, int lanes,
                 const int* __restrict__ num_valid, int4* __restrict__ wide) {
  const int r = blockIdx.x;
  if (r >= *num_valid) return;
  for (int j = 0; j < lanes; ++j) {
    const int64_t li = (int64_t)r * num_topk + lane0 + j;
    const bool ok = lane_ok[li];
    const int4* src = x + (ok ? lane_slot[li] : 0) * row_vecs;
    int4* dst = wide + ((int64_t)r * lanes + j) * row_vecs;
    for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < row_vecs; c += gridDim.y * blockDim.x)
      dst[c] = ok ? src[c] : make_int4(0, 0, 0, 0);
  }
}

// out[t] = bf16(acc), acc = +0 (or acc_in) then acc = acc + fp32(y[t, j]) * w[t, lane0 + j] for each lane with an
// expert, j ascending: separate correctly rounded fp32 multiply and add (no FMA), one round to nearest even at
// the end. y [T, lanes, hidden] bf16 (one combine's output); groups of lanes chain through the fp32 `acc`
// (exact). Eight channels per thread, blockIdx.y = token.
extern "C" __global__ void __launch_bounds__(128)
    ep_ll_weighted_sum(const uint4* __restrict__ y, int hidden, const void* __restrict__ topk_idx, int idx64,
                       const float* __restrict__ w, int num_topk, int lane0, int lanes, float4* __restrict__ acc,
                       int first, int last, uint4* __restrict__ out) {
  const int vecs = hidden / 8;
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t t = blockIdx.y;
  if (c >= vecs) return;
  float a[8];
  if (first) {
    for (int i = 0; i < 8; ++i) a[i] = 0.0f;
  } else {
    const float4 a0 = acc[(t * vecs + c) * 2], a1 = acc[(t * vecs + c) * 2 + 1];
    a[0] = a0.x, a[1] = a0.y, a[2] = a0.z, a[3] = a0.w, a[4] = a1.x, a[5] = a1.y, a[6] = a1.z, a[7] = a1.w;
  }
  for (int j = 0; j < lanes; ++j) {
    const int64_t li = t * num_topk + lane0 + j;
    if (ep_ll::load_idx(topk_idx, li, idx64) < 0) continue;
    const float wk = w[li];
    const uint4 v = y[(t * lanes + j) * vecs + c];
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
    for (int i = 0; i < 4; ++i) {
      a[2 * i] = ep_ll::add_rn(a[2 * i], ep_ll::mul_rn(ep_ll::bf16_lo(words[i]), wk));
      a[2 * i + 1] = ep_ll::add_rn(a[2 * i + 1], ep_ll::mul_rn(ep_ll::bf16_hi(words[i]), wk));
    }
  }
  if (last) {
    uint32_t o[4];
    for (int i = 0; i < 4; ++i) {
      const __nv_bfloat162 b = __floats2bfloat162_rn(a[2 * i], a[2 * i + 1]);  // .x = low half
      o[i] = *reinterpret_cast<const uint32_t*>(&b);
    }
    out[t * vecs + c] = make_uint4(o[0], o[1], o[2], o[3]);
  } else {
    acc[(t * vecs + c) * 2] = make_float4(a[0], a[1], a[2], a[3]);
    acc[(t * vecs + c) * 2 + 1] = make_float4(a[4], a[5], a[6], a[7]);
  }
}
