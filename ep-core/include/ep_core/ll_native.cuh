// SPDX-License-Identifier: Apache-2.0
// V1 low-latency mode's own kernels over ep's symmetric memory (ep_core.ll_native compiles and launches them for
// ep_torch.legacy.ll_kernels; framework-agnostic: pointers and ints only). A peer's byte is reached like every ep
// kernel reaches it (transport.cuh's ipc concept): `peers[p] + (local address - own_base)`, `peers` the device table
// of every rank's data base as mapped in this process (ep-symmem's VMM mappings, or the loopback domain's N
// allocations of one process).
//
// The symmetric LL region (per rank: a front of `header_bytes(N)` (the error word int32 [4] at 0, the clean
// barrier's sync words int64 [N] at 64), then two halves; a call uses one half, the next call the other, V1's double
// buffer):
//   half = [ctrl 64 B | dispatch flags int64 [E_local][N] | combine flags int64 [E] | dispatch slots
//           [E_local][N][M] x msg | combine slots [M][K] x hidden bf16 | LogFMT meta [M][K][hidden / 128] uint32]
//   msg = 16-byte header (source token, lane) + payload (bf16 row, or FP8 row then fp32 scales [hidden / 128])
//   ctrl: int32 [0] dispatch epoch, [1] combine epoch, [2] dispatch done blocks, [3] combine done blocks
// A flag carries the epoch of the call that wrote it in its high 32 bits: a receiver waits for `epoch + 1`, so no
// flag is ever cleaned; the receive kernel's last block advances the local epoch. The low 32 bits are the call's
// signature word (below), the dispatch's with the count in its low 16 bits. All ranks run the same sequence of calls, so their epochs agree. Fixed shapes, counts read on the GPU:
// capturable in a CUDA graph.
//
// Dispatch: send (one block per global expert, grid-stride): the source tokens selecting the expert (first lane
//   with it; duplicates are one message) in ascending token order, each message written straight into its slot
//   (expert, this rank, position) on the expert's rank; then the count flag with release semantics. Receive (one
//   block per local expert): waits for the N counts, packs the rows contiguously in source rank order (V1's
//   `recv_x[e, :recv_count[e]]`), fills src_info, the lanes (for combine), layout_range, recv_count and cumulative
//   stats. local_direct: this rank's own rows come from the send's payload, no message. FP8: `ep_lln_cast_fp8` casts
//   each token once into a staging buffer, the payload of both. Own rows by token (local_direct 2, the receive only;
//   EPKIT_LL_OWN_BY_TOKEN, under evaluation): each receive block takes a contiguous share of this rank's tokens (or
//   of their channel groups, when there are more blocks than tokens), each row read from bf16 x once (FP8: cast
//   once) and written to the packed slot of each of its local experts (the counts of the sources before this rank
//   plus the tokens before it selecting the expert: a per-block count of the tokens before its share, then a running
//   one), instead of one block per expert copying its rows (at EP1 the busiest expert bounded the kernel; no staging
//   launch when nothing is sent). The expert blocks still list the tokens for the counts, src_info, lanes, lane_pos.
// Combine: send (one block per local expert): each packed row written straight into its token's lane slot on the
//   token's home rank, then the expert's flag there. Receive (per token and channel chunk): waits for the flags of
//   the token's experts, then acc = +0, acc = acc + fp32(y_k) * w_k for each lane k ascending with an expert
//   (separate correctly rounded multiply and add), one bf16 rounding: legacy.reference's numerics.
//   The `_logfmt` twins (template kLogFMT): the send writes each row LogFMT-10 encoded (ll_logfmt.cuh: a warp per
//   chunk, the group words into the slot's meta, each chunk at its bf16 offset, 10 bits a value when encoded) and
//   the receive decodes it to float32 for the same sum (legacy.logfmt's model, bitwise); no local shortcut.
// Signature (issue 41): `sig` is the host's word of what every rank must agree on for the call (ll_kernels.dispatch_sig
// / combine_sig: FP8 / round_scale / ue8m0 or LogFMT, a digest of the sizes, the combine's dispatch), bit 31 clear;
// the sends write it into their flags, each receive compares every arrived flag's word with its own (`envelope_bad`).
// A rank that refuses a call on the host runs `ep_lln_abort` instead of its kernels: its flags of that call get the
// abort word (bit 31 set, the reason below) and its epoch advances as if the call had run. A receive that sees a
// word of another signature or an abort records it (`envelope_record`: the first block of the call writes (token,
// peer, tag, their word, this one) into herr [4 + N, 9 + N)) and goes on as for a source without rows: the call's
// outputs are undefined, every flag of the call is still consumed and the epochs stay in step on every rank (no
// early exit, no later pairing); the host raises the record after the receive or at its next call.
// Waits are bounded by `timeout_ms` (%globaltimer): a wait that expires raises the device word `err[0]` (every
// later kernel that sees it returns at once, outputs left undefined) and writes (1, rank, peer, tag) to the host
// mapped `herr` words (the host raises EPTimeoutError at its next call, without a sync).
//
// Rank masking (V1's enable_shrink; legacy.ll_shrink is the CPU twin): `mask` (null: none) is int32 [N + 1] in
// device memory, mask[r] != 0 when rank r is masked, mask[N] the mask generation (the count of
// `ep_lln_clean` runs). A masked rank is neither sent to nor waited for: the dispatch send skips its experts, the
// dispatch receive counts its blocks 0 (recv_count, layout_range), the combine send skips its tokens' rows and
// flags, the combine receive drops the lanes of its experts (zero contribution, as an expert id of -1) and its
// final wait skips it. A wait that expires with a mask masks the peer instead of raising `err` (atomic: the block
// that flips mask[peer] writes herr[4 + peer] = generation + 1, which the host merges into its RankMask with a
// warning) and goes on without it. A peer masked by a timeout during a call: each block decides on its own (the
// mask is read before the flag), so that call's outputs for its experts are unspecified.
// Rejoin: the epochs of a rank that sat out lag the others', so unmasking is `ep_lln_clean`, a collective kernel of
// every rank (two device barriers over the header's sync words, between them each rank zeroes its flags and
// epochs, both halves); the host restarts at half 0.
#pragma once

#include "ll_logfmt.cuh"
#include "ll_pack.cuh"

namespace ep_lln {

struct Layout {
  int64_t ctrl, dflag, cflag, ddata, cdata, half_bytes, msg, cmeta;

  __host__ __device__ Layout(int epr, int num_ranks, int num_experts, int m, int num_topk, int hidden) {
    msg = 16 + ((int64_t)hidden * 2 + 15) / 16 * 16;
    ctrl = 0;
    dflag = 64;
    cflag = dflag + (int64_t)epr * num_ranks * 8;
    ddata = (cflag + (int64_t)num_experts * 8 + 127) / 128 * 128;
    cdata = ddata + (int64_t)epr * num_ranks * m * msg;
    cmeta = cdata + (int64_t)m * num_topk * hidden * 2;
    half_bytes = (cmeta + (int64_t)m * num_topk * (hidden / 128) * 4 + 4095) / 4096 * 4096;
  }
};

#ifndef EP_LL_HOST_EMULATION
__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ int64_t ld_acquire_sys(const int64_t* p) {
  int64_t v;
  asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(int64_t* p, int64_t v) {
  asm volatile("st.release.sys.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
#else  // the CPU tests run these kernels on host threads (ll_native_emulation.cpp)
inline uint64_t now_ns() { return ep_ll_host_now_ns(); }
inline int64_t ld_acquire_sys(const int64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void st_release_sys(int64_t* p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
#endif

__device__ __forceinline__ int ld_volatile(const volatile int* p) { return *p; }

// The region's front (before the two halves): err int32 [4] at 0, the clean barrier's sync words int64 [N] at 64.
__host__ __device__ inline int64_t header_bytes(int num_ranks) { return (64 + 8 * (int64_t)num_ranks + 255) / 256 * 256; }

enum WaitResult { kArrived = 0, kFailed = 1, kMasked = 2 };

// Rank masking's decisions (host and device: test_core_ll_native.py runs them on the host).
__host__ __device__ __forceinline__ bool masked(const int* mask, int r) {
  return mask != nullptr && *reinterpret_cast<const volatile int*>(mask + r) != 0;
}

__host__ __device__ __forceinline__ int mask_flip(int* p) {
#ifdef __CUDA_ARCH__
  return atomicExch(p, 1);
#else
  return __atomic_exchange_n(p, 1, __ATOMIC_SEQ_CST);
#endif
}

__host__ __device__ __forceinline__ int err_raise(int* p) {
#ifdef __CUDA_ARCH__
  return atomicCAS(p, 0, 1);
#else
  int zero = 0;
  return __atomic_compare_exchange_n(p, &zero, 1, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST) ? 0 : zero;
#endif
}

__host__ __device__ __forceinline__ void fence_system() {
#ifdef __CUDA_ARCH__
  __threadfence_system();
#else
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

// A wait on `peer` expired. With a mask: mask the peer (the block that flips it records herr[4 + peer] =
// generation + 1 for the host) and go on without it (kMasked). Without: raise the error word (the first expiry
// records (1, rank, peer, tag)) and fail (kFailed).
__host__ __device__ inline int expire(int* mask, int num_ranks, int* err, volatile int* herr, int rank, int peer,
                                      int tag) {
  if (mask != nullptr) {
    if (mask_flip(mask + peer) == 0 && herr != nullptr) {
      herr[4 + peer] = *reinterpret_cast<const volatile int*>(mask + num_ranks) + 1;
      fence_system();
    }
    return kMasked;
  }
  if (err_raise(err) == 0 && herr != nullptr) {
    herr[1] = rank;
    herr[2] = peer;
    herr[3] = tag;
    fence_system();
    herr[0] = 1;
    fence_system();
  }
  return kFailed;
}

// The signature bits a receive compares (ll_kernels mirrors them): the dispatch's word is above its count.
constexpr uint32_t kDispatchSigBits = 0xFFFF0000u, kCombineSigBits = 0xFFFFFFFFu, kAbortBit = 0x80000000u;

// Whether an arrived flag's word differs from this call's `sig` (within `bits`), an abort included.
__host__ __device__ __forceinline__ bool envelope_bad(int64_t flag, int sig, uint32_t bits) {
  return (((uint32_t)flag ^ (uint32_t)sig) & bits) != 0u;
}

// This call's token in the record: unique per (epoch, half, op) of a region's life (epoch >= 1, so never 0).
__host__ __device__ __forceinline__ int envelope_token(int64_t epoch, const uint8_t* own_half, const int* err,
                                                       int num_ranks, int64_t half_bytes, int op) {
  const int64_t half = ((own_half - reinterpret_cast<const uint8_t*>(err)) - header_bytes(num_ranks)) / half_bytes;
  return (int)((epoch * 2 + half) * 2 + op);
}

// Record that `peer`'s word `theirs` differs from this call's `mine` (the first block of the call to see one: err[1]
// holds the token of the call that recorded last). herr [4 + N, 9 + N): token (written last), peer, tag, theirs, mine.
__host__ __device__ inline void envelope_record(int* err, volatile int* herr, int num_ranks, int token, int peer,
                                                int tag, int64_t theirs, int mine) {
#ifdef __CUDA_ARCH__
  const int old = atomicExch(err + 1, token);
#else
  const int old = __atomic_exchange_n(err + 1, token, __ATOMIC_SEQ_CST);
#endif
  if (old == token || herr == nullptr) return;
  volatile int* rec = herr + 4 + num_ranks;
  rec[1] = peer;
  rec[2] = tag;
  rec[3] = (int)(uint32_t)theirs;
  rec[4] = mine;
  fence_system();
  rec[0] = token;
  fence_system();
}

// The combine receive's lane: the lane whose slot holds its expert's output (`src`, -1 none), or -1 when that
// lane's expert is on a masked rank (`dead[src]`): zero contribution, as an expert id of -1.
__host__ __device__ __forceinline__ int lane_source(int src, const int* dead) {
  return src >= 0 && dead[src] ? -1 : src;
}

// The dispatch receive's layout of one expert from its N source counts (in s_off[0..N)): layout_range[r] =
// (offset << 32) | count, s_off[r] the offset, s_off[N] the total (returned).
__host__ __device__ inline int block_layout(int* s_off, int num_ranks, int64_t* range) {
  int off = 0;
  for (int r = 0; r < num_ranks; ++r) {
    const int c = s_off[r];
    range[r] = ((int64_t)off << 32) | (int64_t)c;
    s_off[r] = off;
    off += c;
  }
  s_off[num_ranks] = off;
  return off;
}

// The dispatch receive's count of source `peer`'s block: the flag's low 16 bits when it arrived, else 0 (masked, or a
// word of another signature: `envelope_bad`).
__host__ __device__ __forceinline__ int source_count(int result, int64_t flag) {
  return result == kArrived ? (int)(flag & 0xFFFFll) : 0;
}

// Spin until (*flag >> shift) >= want (shift 32: dispatch, the epoch in the high half). One thread. kArrived (the
// flag in *seen); kMasked: `peer` is masked (before the wait, meanwhile by another block, or now by this wait's
// timeout: `expire`); kFailed: timeout without a mask (recorded in err) or err already raised.
__device__ inline int wait_flag(const int64_t* flag, int64_t want, int shift, int timeout_ms, int* err,
                                volatile int* herr, int rank, int peer, int tag, int64_t* seen, int* mask,
                                int num_ranks) {
  if (masked(mask, peer)) return kMasked;
  const uint64_t start = now_ns();
  for (uint32_t it = 0;; ++it) {
    const int64_t v = ld_acquire_sys(flag);
    if ((v >> shift) >= want) {
      *seen = v;
      return kArrived;
    }
    if ((it & 255u) == 255u) {
      if (*reinterpret_cast<volatile int*>(err) != 0) return kFailed;
      if (masked(mask, peer)) return kMasked;
      if (now_ns() - start > (uint64_t)timeout_ms * 1000000ull)
        return expire(mask, num_ranks, err, herr, rank, peer, tag);
    }
  }
}

// The block's "I am done with this call's flags" vote; the last block advances the epoch and resets the count.
__device__ inline void finish_epoch(int* ctrl, int which) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const int total = gridDim.x * gridDim.y;
    if (atomicAdd(&ctrl[2 + which], 1) == total - 1) {
      ctrl[2 + which] = 0;
      ctrl[which] = ctrl[which] + 1;
      __threadfence();
    }
  }
}

__device__ __forceinline__ uint8_t* peer_addr(const uint64_t* peers, int p, const uint8_t* own_base,
                                              const uint8_t* local) {
  return reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(peers[p] + (uint64_t)(local - own_base)));
}

}  // namespace ep_lln

// The tokens selecting expert g, in ascending order (a lane's first occurrence: duplicates are one message), listed
// into s_list[0..count) (tokens) and s_list[m..m+count) (their first lane) by a block-wide prefix. All threads.
__device__ inline int ep_lln_list_tokens(const void* topk, int idx64, int num_tokens, int num_topk, int64_t g,
                                         int m, int* s_list, int* warp_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  int running = 0;
  for (int t0 = 0; t0 < num_tokens; t0 += blockDim.x) {
    const int t = t0 + threadIdx.x;
    int first = -1;
    if (t < num_tokens) {
      if (idx64) {
        const int64_t* row = static_cast<const int64_t*>(topk) + (int64_t)t * num_topk;
        for (int k = num_topk - 1; k >= 0; --k) first = row[k] == g ? k : first;
      } else {
        const int32_t* row = static_cast<const int32_t*>(topk) + (int64_t)t * num_topk;
        for (int k = num_topk - 1; k >= 0; --k) first = row[k] == g ? k : first;
      }
    }
    const unsigned ballot = __ballot_sync(0xFFFFFFFFu, first >= 0);
    if (lane == 0) warp_sums[warp] = __popc(ballot);
    __syncthreads();
    int before = running, total = 0;
    for (int w = 0; w < nwarps; ++w) {
      const int c = warp_sums[w];
      before += w < warp ? c : 0;
      total += c;
    }
    if (first >= 0) {
      const int pos = before + __popc(ballot & ((1u << lane) - 1u));
      s_list[pos] = t;
      s_list[m + pos] = first;
    }
    running += total;
    __syncthreads();
  }
  return running;
}

// Copy `rows` rows of `vecs` 16-byte vectors with the whole block: dst(j)[c] = src(j)[c]. A warp per (row, chunk of
// 32 * kUnroll vectors) item, items round-robin over the warps: one round of kUnroll loads in flight per lane an item,
// `src_row(j)` / `dst_row(j)` (the rows' first vectors; a lookup each) once an item. (Cutting each row into
// nwarps / rows parts instead left warps idle when rows does not divide nwarps: 9 rows of 896 vectors took 9 of 16
// warps, 7 rounds each at kUnroll 4; chunks take 4.) A row whose src_row is null is skipped. All threads.
template <int kUnroll = 8, typename Src, typename Dst>
__device__ __forceinline__ void ep_lln_copy_rows(int rows, int vecs, Src src_row, Dst dst_row) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int parts = (vecs + 32 * kUnroll - 1) / (32 * kUnroll);
  for (int item = warp; item < rows * parts; item += nwarps) {
    const int j = item / parts, c = (item - j * parts) * 32 * kUnroll + lane;
    const uint4* src = src_row(j);
    if (src == nullptr) continue;  // a row the caller writes otherwise
    uint4* dst = dst_row(j);
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (c + 32 * u < vecs) v[u] = src[c + 32 * u];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (c + 32 * u < vecs) dst[c + 32 * u] = v[u];
  }
}

// FP8 cast of eight channels `v` (bf16) of a 128-channel group held by a half warp (`ok`: the group exists; every
// lane of the warp calls it: the group's amax is a half-warp reduction). Returns the e4m3 bytes, the scale in *scale.
__device__ __forceinline__ uint2 ep_lln_cast8(uint4 v, bool ok, int round_scale, float* scale) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  float f[8];
  for (int i = 0; i < 4; ++i) f[2 * i] = ep_ll::bf16_lo(w[i]), f[2 * i + 1] = ep_ll::bf16_hi(w[i]);
  float amax = fabsf(f[0]);
  for (int i = 1; i < 8; ++i) amax = ep_ll::nan_max(amax, fabsf(f[i]));
  for (int d = 8; d > 0; d >>= 1) amax = ep_ll::nan_max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, d));
  uint32_t lo = 0, hi = 0;
  *scale = 1.0f;
  if (ok) {
    const float sc = ep_ll::fp8_scale(amax, round_scale != 0);
    for (int i = 0; i < 4; ++i) lo |= ep_ll::e4m3_bits(ep_ll::div_rn(f[i], sc)) << (8 * i);
    for (int i = 0; i < 4; ++i) hi |= ep_ll::e4m3_bits(ep_ll::div_rn(f[4 + i], sc)) << (8 * i);
    *scale = sc;
  }
  return make_uint2(lo, hi);
}

// FP8 cast of `rows` bf16 rows of `groups` 128-channel groups as they are moved, with the whole block: row j read
// at src_row(j) (uint4: eight bf16), put(j, g, hl, bits, scale) given the e4m3 bytes (uint2: eight) of vector hl of
// its group g (16 a group; each lane its own, the scale alike on every lane). A warp per (row, chunk of 8 groups)
// item as in ep_lln_copy_rows, a half warp per group (ep_lln_cast8: the bytes of ep_ll_pack_fp8 and
// legacy.reference), four groups' loads in flight per half warp. All threads.
template <typename Src, typename Put>
__device__ __forceinline__ void ep_lln_cast_rows(int rows, int groups, int round_scale, Src src_row, Put put) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int half = lane >> 4, hl = lane & 15, parts = (groups + 7) / 8;
  for (int item = warp; item < rows * parts; item += nwarps) {
    const int j = item / parts, g0 = (item - j * parts) * 8 + half;  // this half warp's groups: g0, g0 + 2, ...
    const uint4* src = src_row(j);
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = g0 + 2 * u < groups ? src[(g0 + 2 * u) * 16 + hl] : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int g = g0 + 2 * u;
      if (g - half >= groups) break;  // warp-uniform (the cast's amax is a half-warp shuffle)
      float scale;
      const uint2 bits = ep_lln_cast8(v[u], g < groups, round_scale, &scale);
      if (g < groups) put(j, g, hl, bits, scale);
    }
  }
}

// FP8 cast of every token once (before the send): staging row t = e4m3 bytes [hidden] then
// fp32 scales [hidden / 128], row stride `stride` bytes (16-byte multiple); blockIdx.x = token.
extern "C" __global__ void __launch_bounds__(256)
    ep_lln_cast_fp8(const uint4* __restrict__ x, int hidden, int round_scale, uint8_t* __restrict__ staging,
                    int stride) {
  uint8_t* row = staging + (int64_t)blockIdx.x * stride;
  ep_lln_cast_rows(1, hidden / 128, round_scale, [&](int) { return x + (int64_t)blockIdx.x * (hidden / 8); },
                   [&](int, int g, int hl, uint2 bits, float sc) {
                     reinterpret_cast<uint2*>(row)[g * 16 + hl] = bits;
                     if (hl == 0) reinterpret_cast<float*>(row + hidden)[g] = sc;
                   });
}

// Dispatch send. Payload rows (row stride `stride` bytes): bf16 x, or with `use_fp8` the FP8 staging of
// ep_lln_cast_fp8 (`round_scale`: unused, the staging's). topk [T, K] (int32 or int64 by idx64). Block g (grid stride
// over num_experts) sends expert g's tokens to rank g / E_local, then the count (nothing to a masked rank). Dynamic
// shared memory: 8 * M bytes.
extern "C" __global__ void __launch_bounds__(512, 2)
    ep_lln_dispatch_send(const uint8_t* __restrict__ payload, int stride, int round_scale,
                         const void* __restrict__ topk, int idx64, int num_tokens, int num_topk, int hidden,
                         int num_experts, int num_ranks, int rank, int m, const uint64_t* __restrict__ peers,
                         const uint8_t* own_base, uint8_t* own_half, int use_fp8, int local_direct,
                         int* __restrict__ lane_pos, int* err, volatile int* herr, int* mask, int sig) {
  EP_LL_DYNAMIC_SMEM(int, s_list);  // [M] token, [M] lane
  __shared__ int warp_sums[32];
  if (*reinterpret_cast<volatile int*>(err) != 0) return;
  const int epr = num_experts / num_ranks;
  const ep_lln::Layout L(epr, num_ranks, num_experts, m, num_topk, hidden);
  const int* ctrl = reinterpret_cast<const int*>(own_half + L.ctrl);
  const int64_t epoch = (int64_t)ctrl[0] + 1;
  const int vecs = use_fp8 ? (hidden + hidden / 128 * 4 + 15) / 16 : hidden / 8;
  for (int g = blockIdx.x; g < num_experts; g += gridDim.x) {
    const int dst = g / epr, e = g - dst * epr;
    // block-uniform (another block's timeout may flip the word meanwhile)
    if (mask != nullptr && __syncthreads_or(threadIdx.x == 0 && ep_lln::masked(mask, dst))) continue;
    const int count = ep_lln_list_tokens(topk, idx64, num_tokens, num_topk, g, m, s_list, warp_sums);
    uint8_t* local_slots = own_half + L.ddata + ((int64_t)e * num_ranks + rank) * m * L.msg;
    uint8_t* slots = ep_lln::peer_addr(peers, dst, own_base, local_slots);
    if (lane_pos != nullptr)  // each (token, first lane)'s position in this rank's block of its expert (combine)
      for (int j = threadIdx.x; j < count; j += blockDim.x) lane_pos[s_list[j] * num_topk + s_list[m + j]] = j;
    // local_direct: this rank's own experts read their rows from the payload in the receive (no message)
    const int sent = local_direct && dst == rank ? 0 : count;
    for (int j = threadIdx.x; j < sent; j += blockDim.x)
      *reinterpret_cast<int4*>(slots + (int64_t)j * L.msg) = make_int4(s_list[j], s_list[m + j], 0, 0);
    const int64_t msg = L.msg;
    ep_lln_copy_rows(
        sent, vecs, [&](int j) { return reinterpret_cast<const uint4*>(payload + (int64_t)s_list[j] * stride); },
        [&](int j) { return reinterpret_cast<uint4*>(slots + (int64_t)j * msg + 16); });
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence_system();
      int64_t* flag = reinterpret_cast<int64_t*>(own_half + L.dflag) + (int64_t)e * num_ranks + rank;
      ep_lln::st_release_sys(reinterpret_cast<int64_t*>(ep_lln::peer_addr(peers, dst, own_base,
                                                                          reinterpret_cast<uint8_t*>(flag))),
                             (epoch << 32) | (int64_t)(uint32_t)(sig & (int)ep_lln::kDispatchSigBits) | (int64_t)count);
    }
  }
}

// Dispatch receive. Block e (grid stride over E_local): waits for the counts of the N source ranks, then packs the
// rows. Outputs: bf16 out [E_local, N*M, hidden], or FP8 q [E_local, N*M, hidden] with scales float32
// [E_local, G, N*M] (ue8m0: int32 [E_local, G/4, N*M], exponent byte of group g at byte g % 4); src_info and lanes
// int32 [E_local, N*M] (-1 past the count); recv_count int32 [E_local]; layout_range int64 [E_local, N]; stats
// int32 [E_local] (added to; may be null). local_direct: this rank's own block takes its rows from `payload` (the
// send's, row stride `stride` bytes: bf16 x or the FP8 staging); 2 (own rows by token): `payload` is bf16 x, each
// own token's row written by the token pass below (FP8: cast here with `round_scale`, bitwise ep_lln_cast_fp8).
extern "C" __global__ void __launch_bounds__(512, 2)
    ep_lln_dispatch_recv(int num_topk, int hidden, int num_experts, int num_ranks, int rank, int m,
                         uint8_t* own_half, int use_fp8, int ue8m0, void* __restrict__ out,
                         void* __restrict__ scales, int* __restrict__ src_info, int* __restrict__ lanes,
                         int* __restrict__ recv_count, int64_t* __restrict__ layout_range, int* __restrict__ stats,
                         const uint8_t* __restrict__ payload, int stride, int round_scale,
                         const void* __restrict__ topk, int idx64, int num_tokens, int local_direct,
                         int* __restrict__ lane_pos, int timeout_ms, int* err, volatile int* herr, int* mask,
                         int sig) {
  EP_LL_DYNAMIC_SMEM(int, s_off);  // [N + 1]: offsets of the source ranks' blocks, then the total; [2M]; [E_local]
  __shared__ int s_fail;
  __shared__ int warp_sums[32];
  __shared__ int s_dst[2 * EP_LL_MAX_TOPK];  // the token pass: each lane's local expert (or -1), then its packed row
  int* s_list = s_off + num_ranks + 1;  // local_direct: this rank's tokens of the expert, then their lanes
  if (*reinterpret_cast<volatile int*>(err) != 0) return;
  const int epr = num_experts / num_ranks;
  const ep_lln::Layout L(epr, num_ranks, num_experts, m, num_topk, hidden);
  int* ctrl = reinterpret_cast<int*>(own_half + L.ctrl);
  const int64_t epoch = (int64_t)ctrl[0] + 1;
  const int slots = num_ranks * m;
  const int row_vecs = hidden * 2 / 16, groups = hidden / 128;
  // source r's count of local expert e (its flag's wait; -1: failed), 0 when masked or of another signature (no rows
  // of it: the call's outputs are undefined, its flags all consumed)
  auto count_of = [&](int e, int r) {
    int64_t v = 0;
    const int64_t* flag = reinterpret_cast<const int64_t*>(own_half + L.dflag) + (int64_t)e * num_ranks + r;
    int res = ep_lln::wait_flag(flag, epoch, 32, timeout_ms, err, herr, rank, r, 1, &v, mask, num_ranks);
    if (res == ep_lln::kArrived && ep_lln::envelope_bad(v, sig, ep_lln::kDispatchSigBits)) {
      ep_lln::envelope_record(err, herr, num_ranks, ep_lln::envelope_token(epoch, own_half, err, num_ranks,
                                                                           L.half_bytes, 0), r, 1, v, sig);
      res = ep_lln::kMasked;
    }
    return res == ep_lln::kFailed ? -1 : ep_lln::source_count(res, v);
  };
  const int qvecs = use_fp8 ? hidden / 16 : row_vecs;
  auto put_scale = [&](int64_t e, int j, int g, float s) {  // row j of local expert e
    if (ue8m0) {
      const int64_t word = (e * (groups / 4) + g / 4) * slots + j;
      static_cast<uint8_t*>(scales)[word * 4 + (g % 4)] = (uint8_t)((ep_ll::f2u(s) >> 23) & 0xFFu);
    } else {
      static_cast<float*>(scales)[(e * groups + g) * slots + j] = s;
    }
  };
  if (threadIdx.x == 0) s_fail = 0;
  __syncthreads();
  for (int e = blockIdx.x; e < epr; e += gridDim.x) {
    // local_direct: this rank's own block is listed here (its count and rows need no message; the host may skip
    // the send altogether at one rank), and each (token, first lane)'s position goes to lane_pos for the combine
    const int own = local_direct ? ep_lln_list_tokens(topk, idx64, num_tokens, num_topk, (int64_t)rank * epr + e,
                                                      m, s_list, warp_sums)
                                 : 0;
    if (local_direct && lane_pos != nullptr)
      for (int j = threadIdx.x; j < own; j += blockDim.x) lane_pos[s_list[j] * num_topk + s_list[m + j]] = j;
    for (int r = threadIdx.x; r < num_ranks; r += blockDim.x) {
      const int c = local_direct && r == rank ? (ep_lln::masked(mask, r) ? 0 : own) : count_of(e, r);
      if (c < 0) s_fail = 1;
      s_off[r] = c < 0 ? 0 : c;
    }
    __syncthreads();
    if (s_fail) return;
    if (threadIdx.x == 0) {
      const int off = ep_lln::block_layout(s_off, num_ranks, layout_range + (int64_t)e * num_ranks);
      recv_count[e] = off;
      if (stats != nullptr) stats[e] += off;
    }
    __syncthreads();
    const int total = s_off[num_ranks];
    // packed row j: source rank r by a binary search over the block offsets; its payload is the message's, or with
    // local_direct for this rank's own block its token's payload row (null by token: the token pass writes it)
    auto rank_of = [&](int j) {
      int lo = 0, hi = num_ranks - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (s_off[mid] <= j) lo = mid; else hi = mid - 1;
      }
      return lo;
    };
    auto src_of = [&](int j) -> const uint8_t* {
      const int r = rank_of(j);
      if (local_direct && r == rank)
        return local_direct == 2 ? nullptr : payload + (int64_t)s_list[j - s_off[r]] * stride;
      return own_half + L.ddata + (((int64_t)e * num_ranks + r) * m + (j - s_off[r])) * L.msg + 16;
    };
    for (int j = threadIdx.x; j < total; j += blockDim.x) {
      const int r = rank_of(j);
      int tok, lane;
      if (local_direct && r == rank) {
        tok = s_list[j - s_off[r]];
        lane = s_list[m + j - s_off[r]];
      } else {
        const int4 hdr = *reinterpret_cast<const int4*>(src_of(j) - 16);
        tok = hdr.x;
        lane = hdr.y;
      }
      src_info[(int64_t)e * slots + j] = tok;
      lanes[(int64_t)e * slots + j] = lane;
    }
    uint4* out4 = static_cast<uint4*>(out) + (int64_t)e * slots * qvecs;
    ep_lln_copy_rows<4>(
        total, qvecs, [&](int j) { return reinterpret_cast<const uint4*>(src_of(j)); },
        [&](int j) { return out4 + (int64_t)j * qvecs; });
    for (int i = threadIdx.x; use_fp8 && i < total * groups; i += blockDim.x) {
      const int g = i / total, j = i - g * total;  // consecutive threads: consecutive rows (column-major out)
      const uint8_t* src = src_of(j);
      if (src != nullptr) put_scale(e, j, g, reinterpret_cast<const float*>(src + hidden)[g]);
    }
    for (int j = total + threadIdx.x; j < slots; j += blockDim.x) {
      src_info[(int64_t)e * slots + j] = -1;
      lanes[(int64_t)e * slots + j] = -1;
    }
    __syncthreads();  // s_off is rewritten by the next expert
  }
  // own rows by token (local_direct 2): block b takes a contiguous share [i0, i1) of the (token, part) items (a part:
  // groups / parts channel groups; parts = blocks per token, the blocks a token would leave idle); token t's part
  // goes to packed row s_next[e] of each local expert e it selects (its first lane with e), s_next[e] = the counts of
  // the sources before this rank plus the tokens before t selecting e (the order of ep_lln_list_tokens in the expert
  // blocks above, which write src_info and lanes): the tokens before the share counted once, then a token at a time
  const int64_t g0 = (int64_t)rank * epr;
  auto first_local = [&](int u, int k) {  // lane k of token u: its local expert where the lane is its first, or -1
    const int64_t g = ep_ll::load_idx(topk, (int64_t)u * num_topk + k, idx64);
    bool first = g >= g0 && g < g0 + epr;
    for (int j = 0; j < k && first; ++j) first = ep_ll::load_idx(topk, (int64_t)u * num_topk + j, idx64) != g;
    return first ? (int)(g - g0) : -1;
  };
  int parts = num_tokens > 0 ? (int)gridDim.x / num_tokens : 1;
  parts = parts < 1 ? 1 : (parts > groups ? groups : parts);
  const int items = num_tokens * parts, per = (items + gridDim.x - 1) / gridDim.x, i0 = blockIdx.x * per;
  const int i1 = i0 + per < items ? i0 + per : items, t0 = i0 / parts;
  if (local_direct != 2 || ep_lln::masked(mask, rank) || i0 >= i1) {
    ep_lln::finish_epoch(ctrl, 0);
    return;
  }
  int* s_next = s_list + 2 * m;  // [E_local]
  for (int e = threadIdx.x; e < epr; e += blockDim.x) {
    int own0 = 0;
    for (int r = 0; r < rank; ++r) {
      const int c = count_of(e, r);
      if (c < 0) s_fail = 1;
      own0 += c < 0 ? 0 : c;
    }
    s_next[e] = own0;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < t0 * num_topk; i += blockDim.x) {
    const int e = first_local(i / num_topk, i % num_topk);
    if (e >= 0) atomicAdd(&s_next[e], 1);
  }
  __syncthreads();
  if (s_fail) return;
  uint4* out4 = static_cast<uint4*>(out);
  auto dst_row = [&](int k) { return ((int64_t)s_dst[k] * slots + s_dst[EP_LL_MAX_TOPK + k]) * qvecs; };
  for (int t = t0; t * parts < i1; ++t) {
    const int pa = i0 - t * parts > 0 ? i0 - t * parts : 0, pb = i1 - t * parts < parts ? i1 - t * parts : parts;
    const int ga = pa * groups / parts, gb = pb * groups / parts;  // this share's groups of the token
    for (int k = threadIdx.x; k < num_topk; k += blockDim.x) {
      const int e = first_local(t, k);
      s_dst[k] = e;
      s_dst[EP_LL_MAX_TOPK + k] = e < 0 ? -1 : s_next[e];
    }
    __syncthreads();
    const uint4* row = reinterpret_cast<const uint4*>(payload + (int64_t)t * stride);
    auto put = [&](int, int g, int hl, uint2 bits, float sc) {  // the token's cast, once, to each of its experts
      g += ga;
      for (int k = 0; k < num_topk; ++k) {
        if (s_dst[k] < 0) continue;
        reinterpret_cast<uint2*>(out4 + dst_row(k))[g * 16 + hl] = bits;
        if (hl == 0) put_scale(s_dst[k], s_dst[EP_LL_MAX_TOPK + k], g, sc);
      }
    };
    if (use_fp8)
      ep_lln_cast_rows(1, gb - ga, round_scale, [&](int) { return row + ga * 16; }, put);
    else
      for (int c = ga * 16 + threadIdx.x; c < gb * 16; c += blockDim.x) {
        const uint4 v = row[c];
        for (int k = 0; k < num_topk; ++k)
          if (s_dst[k] >= 0) out4[dst_row(k) + c] = v;
      }
    for (int k = threadIdx.x; k < num_topk; k += blockDim.x)
      if (s_dst[k] >= 0) ++s_next[s_dst[k]];  // a lane each expert (first lanes)
    __syncthreads();  // s_dst is rewritten by the next token
  }
  ep_lln::finish_epoch(ctrl, 0);
}

// LogFMT combine send of one expert's `total` packed rows (row j: x_rows + j * hidden / 8, token src_info[j], lane
// lanes[j], source rank by s_off): a warp per (row, chunk), ep_lfmt::encode_chunk_warp into the slot and its group
// words on the token's rank. Rows with garbage (an aborted dispatch) are skipped.
__device__ inline void ep_lln_logfmt_send_rows(const uint4* x_rows, const int* src_info, const int* lanes, int total,
                                               const int* s_off, int num_topk, int hidden, int num_ranks, int m,
                                               const uint64_t* peers, const uint8_t* own_base, uint8_t* cdata,
                                               uint8_t* cmeta, const int* mask) {
  const int ch = ep_lfmt::chunk_size(hidden), nch = hidden / ch, groups = hidden / 128;
  for (int u = threadIdx.x >> 5; u < total * nch; u += blockDim.x >> 5) {  // warp-uniform
    const int j = u / nch, c = u - j * nch;
    const int t = src_info[j], k = lanes[j];
    if (t < 0 || t >= m || k < 0 || k >= num_topk) continue;
    int lo = 0, hi = num_ranks - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (s_off[mid] <= j) lo = mid; else hi = mid - 1;
    }
    if (mask != nullptr && __any_sync(0xFFFFFFFFu, ep_lln::masked(mask, lo))) continue;  // warp-uniform
    const int64_t slot = (int64_t)t * num_topk + k;
    uint8_t* row = ep_lln::peer_addr(peers, lo, own_base, cdata + slot * hidden * 2);
    uint32_t* meta = reinterpret_cast<uint32_t*>(ep_lln::peer_addr(peers, lo, own_base, cmeta + slot * groups * 4));
    ep_lfmt::encode_chunk_warp(x_rows + (int64_t)j * (hidden / 8), row, meta, hidden, c, threadIdx.x & 31);
  }
}

// Combine send. x [E_local, N*M, hidden] bf16; src_info, lanes, layout_range: the dispatch's. Block e (grid stride
// over E_local) writes each packed row into slot (token, lane) of the token's home rank, then the expert's flag
// there. Dynamic shared memory: 4 * (N + 1) bytes. kLogFMT: the rows LogFMT-10 encoded (ep_lln_combine_send_logfmt).
template <bool kLogFMT>
__device__ __forceinline__ void ep_lln_combine_send_t(const uint4* __restrict__ x, const int* __restrict__ src_info,
                                                      const int* __restrict__ lanes,
                                                      const int64_t* __restrict__ layout_range, int num_topk,
                                                      int hidden, int num_experts, int num_ranks, int rank, int m,
                                                      const uint64_t* __restrict__ peers, const uint8_t* own_base,
                                                      uint8_t* own_half, int local_direct, int* err,
                                                      volatile int* herr, const int* mask, int sig) {
  EP_LL_DYNAMIC_SMEM(int, s_off);  // [N + 1]
  if (*reinterpret_cast<volatile int*>(err) != 0) return;
  const int epr = num_experts / num_ranks;
  const ep_lln::Layout L(epr, num_ranks, num_experts, m, num_topk, hidden);
  const int* ctrl = reinterpret_cast<const int*>(own_half + L.ctrl);
  const int64_t epoch = (int64_t)ctrl[1] + 1;
  const int slots = num_ranks * m;
  const int row_vecs = hidden * 2 / 16;
  for (int e = blockIdx.x; e < epr; e += gridDim.x) {
    if (threadIdx.x == 0) {
      int total = 0;
      for (int r = 0; r < num_ranks; ++r) {
        const int64_t v = layout_range[(int64_t)e * num_ranks + r];
        s_off[r] = (int)(v >> 32);
        total += (int)(v & 0xFFFFFFFFll);
      }
      s_off[num_ranks] = total;
    }
    __syncthreads();
    const int total = s_off[num_ranks];
    const int64_t base_row = (int64_t)e * slots;
    // destination of packed row j: slot (token, lane) on the row's source rank (binary search over the offsets);
    // rows with garbage (an aborted dispatch) or of a masked source go nowhere: they read and write their own row
    auto dst_of = [&](int j) -> uint4* {
      const int t = src_info[base_row + j], k = lanes[base_row + j];
      uint4* self = const_cast<uint4*>(x + (base_row + j) * row_vecs);
      if (t < 0 || t >= m || k < 0 || k >= num_topk) return self;
      int lo = 0, hi = num_ranks - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (s_off[mid] <= j) lo = mid; else hi = mid - 1;
      }
      if (ep_lln::masked(mask, lo)) return self;
      uint8_t* local = own_half + L.cdata + ((int64_t)t * num_topk + k) * hidden * 2;
      return reinterpret_cast<uint4*>(ep_lln::peer_addr(peers, lo, own_base, local));
    };
    if constexpr (kLogFMT) {
      ep_lln_logfmt_send_rows(x + base_row * row_vecs, src_info + base_row, lanes + base_row, total, s_off,
                              num_topk, hidden, num_ranks, m, peers, own_base, own_half + L.cdata,
                              own_half + L.cmeta, mask);
    } else if (!local_direct) {
      ep_lln_copy_rows(
          total, row_vecs, [&](int j) { return x + (base_row + j) * row_vecs; }, dst_of);
    } else {  // this rank's own tokens' rows stay: the receive reads them in x
      const int own0 = s_off[rank], own1 = rank + 1 < num_ranks ? s_off[rank + 1] : total;
      ep_lln_copy_rows(
          own0, row_vecs, [&](int j) { return x + (base_row + j) * row_vecs; }, dst_of);
      ep_lln_copy_rows(
          total - own1, row_vecs, [&](int j) { return x + (base_row + own1 + j) * row_vecs; },
          [&](int j) { return dst_of(own1 + j); });
    }
    __syncthreads();
    for (int r = threadIdx.x; r < num_ranks; r += blockDim.x) {
      if (ep_lln::masked(mask, r)) continue;
      __threadfence_system();
      int64_t* flag = reinterpret_cast<int64_t*>(own_half + L.cflag) + (int64_t)rank * epr + e;
      // the LogFMT send reads its epoch again here (held across its encode loop, it could make ptxas spill)
      ep_lln::st_release_sys(
          reinterpret_cast<int64_t*>(ep_lln::peer_addr(peers, r, own_base, reinterpret_cast<uint8_t*>(flag))),
          ((kLogFMT ? (int64_t)ctrl[1] + 1 : epoch) << 32) | (int64_t)(uint32_t)sig);
    }
    __syncthreads();
  }
}

// Combine receive: a warp per work item (token t, a part of its hidden vectors; a token is cut into as many parts as
// keep every warp of the grid busy, at least 32 vectors a part), grid stride, no block-wide step per item. The
// warp's lanes read t's lanes (expert ids, weights) and wait for the flags of t's experts, then each lane sums its
// vectors in ascending lane order into out [T, hidden] bf16 (lanes repeating an earlier lane's expert read that
// lane's slot: one message per (token, expert)). kLogFMT: the slots hold LogFMT-10 rows, decoded to float32 for the
// same sum (ep_lln_combine_recv_logfmt; every row came through the slots: local_direct is ignored, as by the LogFMT
// send). Dynamic shared memory: (blockDim.x / 32) * num_topk * 20 bytes (each warp's lanes of its token).
template <bool kLogFMT>
__device__ __forceinline__ void ep_lln_combine_recv_t(const void* __restrict__ topk, int idx64,
                                                      const float* __restrict__ w, int num_tokens, int num_topk,
                                                      int hidden, int num_experts, int num_ranks, int rank, int m,
                                                      uint8_t* own_half,
                                                      uint4* __restrict__ out, const uint4* __restrict__ x,
                                                      const int64_t* __restrict__ layout_range,
                                                      const int* __restrict__ lane_pos, int local_direct,
                                                      int timeout_ms, int* err, volatile int* herr, int* mask,
                                                      int sig) {
  EP_LL_DYNAMIC_SMEM(int64_t, s_lanes);
  __shared__ int s_fail;
  if (*reinterpret_cast<volatile int*>(err) != 0) return;
  const int epr = num_experts / num_ranks;
  const ep_lln::Layout L(epr, num_ranks, num_experts, m, num_topk, hidden);
  int* ctrl = reinterpret_cast<int*>(own_half + L.ctrl);
  const int64_t epoch = (int64_t)ctrl[1] + 1;
  const int vecs = hidden / 8;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wpb = blockDim.x >> 5;
  const int all_warps = gridDim.x * wpb;
  int parts = num_tokens > 0 ? all_warps / num_tokens : 1;
  const int most = vecs / 32 > 1 ? vecs / 32 : 1;
  parts = parts < 1 ? 1 : (parts > most ? most : parts);
  const int per = (vecs + parts - 1) / parts;
  const int64_t* flags = reinterpret_cast<const int64_t*>(own_half + L.cflag);
  const uint4* slots = reinterpret_cast<const uint4*>(own_half + L.cdata);
  // each warp's lanes of its token: row of x (local_direct) int64 [K], then (src, dead) int32 [K][2], then weights
  int64_t* s_row = s_lanes + (int64_t)warp * num_topk;
  int* s_src = reinterpret_cast<int*>(s_lanes + (int64_t)wpb * num_topk) + (int64_t)warp * num_topk * 2;
  float* s_w = reinterpret_cast<float*>(reinterpret_cast<int*>(s_lanes + (int64_t)wpb * num_topk) +
                                        (int64_t)wpb * num_topk * 2) + (int64_t)warp * num_topk;
  if (threadIdx.x == 0) s_fail = 0;
  __syncthreads();
  int failed = 0, warp_failed = 0;
  for (int item = blockIdx.x * wpb + warp; item < num_tokens * parts; item += all_warps) {
    const int t = item / parts, c0 = (item - t * parts) * per;
    const int c1 = c0 + per < vecs ? c0 + per : vecs;
    for (int k = lane; k < num_topk; k += 32) {
      const int64_t g = ep_ll::load_idx(topk, (int64_t)t * num_topk + k, idx64);
      int src = -1, dead = 0;
      if (g >= 0 && g < num_experts) {
        src = k;
        for (int j = 0; j < k; ++j)
          if (ep_ll::load_idx(topk, (int64_t)t * num_topk + j, idx64) == g) {
            src = j;
            break;
          }
        int64_t v;
        if (src == k && local_direct && g / epr == rank) {  // its rows are read in x: no message, no flag
          dead = ep_lln::masked(mask, rank);
        } else if (src == k) {
          const int res =
              ep_lln::wait_flag(flags + g, epoch, 32, timeout_ms, err, herr, rank, (int)(g / epr), 2, &v, mask, num_ranks);
          if (res == ep_lln::kArrived && ep_lln::envelope_bad(v, sig, ep_lln::kCombineSigBits))
            ep_lln::envelope_record(err, herr, num_ranks,
                                    ep_lln::envelope_token(epoch, own_half, err, num_ranks, L.half_bytes, 1),
                                    (int)(g / epr), 2, v, sig);  // its rows are summed: undefined output, raised
          failed |= res == ep_lln::kFailed;
          dead = res == ep_lln::kMasked;
        }
      }
      s_src[2 * k] = src;
      s_src[2 * k + 1] = dead;
      s_w[k] = w[(int64_t)t * num_topk + k];
      s_row[k] = -1;
      if (local_direct && src >= 0 && g / epr == rank) {
        const int e = (int)(g - (int64_t)rank * epr);
        const int64_t off = layout_range[(int64_t)e * num_ranks + rank] >> 32;
        s_row[k] = (int64_t)e * num_ranks * m + off + lane_pos[(int64_t)t * num_topk + src];
      }
    }
    warp_failed = __any_sync(0xFFFFFFFFu, failed);
    if (warp_failed) break;  // warp-uniform
    __syncwarp();
    if (mask != nullptr) {  // lanes repeating a dropped lane's expert are dropped with it
      int src[4];  // read every lane's first, then write (the warp's lanes share the array)
      for (int k = lane, u = 0; k < num_topk; k += 32, ++u)
        if (u < 4) src[u] = s_src[2 * k] >= 0 && s_src[2 * s_src[2 * k] + 1] ? -1 : s_src[2 * k];
      __syncwarp();
      for (int k = lane, u = 0; k < num_topk; k += 32, ++u)
        if (u < 4) s_src[2 * k] = src[u];
      __syncwarp();
    }
    for (int c = c0 + lane; c < c1; c += 32) {
      float a[8];
      for (int i = 0; i < 8; ++i) a[i] = 0.0f;
      if constexpr (kLogFMT) {
        for (int k = 0; k < num_topk; ++k) {
          const int src = s_src[2 * k];
          if (src < 0) continue;
          float f[8];
          const int64_t slot = (int64_t)t * num_topk + src;
          ep_lfmt::load8(own_half + L.cdata + slot * hidden * 2,
                         reinterpret_cast<const uint32_t*>(own_half + L.cmeta) + slot * (hidden / 128), hidden, c, f);
          const float wk = s_w[k];
          for (int i = 0; i < 8; ++i) a[i] = ep_ll::add_rn(a[i], ep_ll::mul_rn(f[i], wk));
        }
      } else
      for (int k0 = 0; k0 < num_topk; k0 += 4) {  // four lanes' loads in flight, then their sum in lane order
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int k = k0 + u;
          const int src = k < num_topk ? s_src[2 * k] : -1;
          if (src >= 0) {
            const int64_t row = s_row[k];
            v[u] = row >= 0 ? x[row * vecs + c] : slots[((int64_t)t * num_topk + src) * vecs + c];
          }
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int k = k0 + u;
          if (k >= num_topk || s_src[2 * k] < 0) continue;
          const float wk = s_w[k];
          const uint32_t words[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
          for (int i = 0; i < 4; ++i) {
            a[2 * i] = ep_ll::add_rn(a[2 * i], ep_ll::mul_rn(ep_ll::bf16_lo(words[i]), wk));
            a[2 * i + 1] = ep_ll::add_rn(a[2 * i + 1], ep_ll::mul_rn(ep_ll::bf16_hi(words[i]), wk));
          }
        }
      }
      uint32_t o[4];
      for (int i = 0; i < 4; ++i) {
        const __nv_bfloat162 b = __floats2bfloat162_rn(a[2 * i], a[2 * i + 1]);
        o[i] = *reinterpret_cast<const uint32_t*>(&b);
      }
      out[(int64_t)t * vecs + c] = make_uint4(o[0], o[1], o[2], o[3]);
    }
    __syncwarp();  // the next item rewrites the warp's lanes
  }
  if (warp_failed && lane == 0) s_fail = 1;
  __syncthreads();
  if (s_fail) return;
  if (blockIdx.x == 0) {
    // every expert's flag of this call, whether or not this rank's tokens use it: the kernel completes only after
    // every rank's combine send, hence after every rank's dispatch receive (V1's rule; the double buffer relies on
    // it: the next dispatch into a peer's half must not overtake that peer's reading of it)
    for (int g = threadIdx.x; g < num_experts; g += blockDim.x) {
      if (local_direct && g / epr == rank) continue;  // this rank's own send came first on this stream
      int64_t v;  // a masked rank's flags are not waited for
      const int res = ep_lln::wait_flag(flags + g, epoch, 32, timeout_ms, err, herr, rank, g / epr, 2, &v, mask,
                                        num_ranks);
      if (res == ep_lln::kFailed) break;
      if (res == ep_lln::kArrived && ep_lln::envelope_bad(v, sig, ep_lln::kCombineSigBits))
        ep_lln::envelope_record(err, herr, num_ranks,
                                ep_lln::envelope_token(epoch, own_half, err, num_ranks, L.half_bytes, 1), g / epr,
                                2, v, sig);
    }
  }
  ep_lln::finish_epoch(ctrl, 1);
}

extern "C" __global__ void __launch_bounds__(512, 2)
    ep_lln_combine_send(const uint4* __restrict__ x, const int* __restrict__ src_info,
                        const int* __restrict__ lanes, const int64_t* __restrict__ layout_range, int num_topk,
                        int hidden, int num_experts, int num_ranks, int rank, int m,
                        const uint64_t* __restrict__ peers, const uint8_t* own_base, uint8_t* own_half,
                        int local_direct, int* err, volatile int* herr, const int* mask, int sig) {
  ep_lln_combine_send_t<false>(x, src_info, lanes, layout_range, num_topk, hidden, num_experts, num_ranks, rank, m,
                               peers, own_base, own_half, local_direct, err, herr, mask, sig);
}

extern "C" __global__ void __launch_bounds__(512, 2)
    ep_lln_combine_send_logfmt(const uint4* __restrict__ x, const int* __restrict__ src_info,
                               const int* __restrict__ lanes, const int64_t* __restrict__ layout_range, int num_topk,
                               int hidden, int num_experts, int num_ranks, int rank, int m,
                               const uint64_t* __restrict__ peers, const uint8_t* own_base, uint8_t* own_half,
                               int local_direct, int* err, volatile int* herr, const int* mask, int sig) {
  ep_lln_combine_send_t<true>(x, src_info, lanes, layout_range, num_topk, hidden, num_experts, num_ranks, rank, m,
                              peers, own_base, own_half, local_direct, err, herr, mask, sig);
}

extern "C" __global__ void __launch_bounds__(256, 4)
    ep_lln_combine_recv(const void* __restrict__ topk, int idx64, const float* __restrict__ w, int num_tokens,
                        int num_topk, int hidden, int num_experts, int num_ranks, int rank, int m,
                        uint8_t* own_half, uint4* __restrict__ out, const uint4* __restrict__ x,
                        const int64_t* __restrict__ layout_range, const int* __restrict__ lane_pos,
                        int local_direct, int timeout_ms, int* err, volatile int* herr, int* mask, int sig) {
  ep_lln_combine_recv_t<false>(topk, idx64, w, num_tokens, num_topk, hidden, num_experts, num_ranks, rank, m,
                               own_half, out, x, layout_range, lane_pos, local_direct, timeout_ms, err, herr, mask,
                               sig);
}

extern "C" __global__ void __launch_bounds__(256, 4)
    ep_lln_combine_recv_logfmt(const void* __restrict__ topk, int idx64, const float* __restrict__ w, int num_tokens,
                               int num_topk, int hidden, int num_experts, int num_ranks, int rank, int m,
                               uint8_t* own_half, uint4* __restrict__ out, const uint4* __restrict__ x,
                               const int64_t* __restrict__ layout_range, const int* __restrict__ lane_pos,
                               int local_direct, int timeout_ms, int* err, volatile int* herr, int* mask, int sig) {
  ep_lln_combine_recv_t<true>(topk, idx64, w, num_tokens, num_topk, hidden, num_experts, num_ranks, rank, m,
                              own_half, out, x, layout_range, lane_pos, local_direct, timeout_ms, err, herr, mask,
                              sig);
}

// Rank masking's rejoin (V1's low_latency_clean_mask_buffer under ep's epoch flags): a collective of every rank, one
// block. Unmasks every rank (mask[0..N) = 0, mask[N] = generation `gen`, the count of cleans so far, equal on every
// rank), then two barriers over the header's sync words (int64 [N] at own_base + 64; peer r's word [rank] gets
// 2 gen - 1, then 2 gen). After the first, no rank's kernel from before its clean writes anywhere (stream order); each
// rank then zeroes the ctrl words and flags of both its halves (the epochs restart at 0, a rank that sat out while
// masked included); after the second, every rank's next call may send. A rank that does not arrive within the
// timeout is masked again (`expire`). The caller's next call uses half 0.
extern "C" __global__ void __launch_bounds__(256)
    ep_lln_clean(const uint64_t* __restrict__ peers, uint8_t* own_base, int num_topk, int hidden, int num_experts,
                 int num_ranks, int rank, int m, int gen, int timeout_ms, int* err, volatile int* herr, int* mask) {
  if (*reinterpret_cast<volatile int*>(err) != 0) return;
  const int epr = num_experts / num_ranks;
  const ep_lln::Layout L(epr, num_ranks, num_experts, m, num_topk, hidden);
  const int64_t header = ep_lln::header_bytes(num_ranks);
  int64_t* sync = reinterpret_cast<int64_t*>(own_base + 64);
  for (int r = threadIdx.x; r < num_ranks; r += blockDim.x) mask[r] = 0;
  if (threadIdx.x == 0) mask[num_ranks] = gen;
  if (threadIdx.x == 0) err[1] = 0;  // the envelope record's last token: the epochs (its tokens) restart
  __threadfence();
  __syncthreads();
  for (int phase = 1; phase >= 0; --phase) {
    const int64_t want = 2 * (int64_t)gen - phase;
    for (int r = threadIdx.x; r < num_ranks; r += blockDim.x) {
      if (ep_lln::masked(mask, r)) continue;  // did not arrive at the first barrier
      __threadfence_system();
      ep_lln::st_release_sys(
          reinterpret_cast<int64_t*>(ep_lln::peer_addr(peers, r, own_base, reinterpret_cast<uint8_t*>(sync + rank))),
          want);
    }
    for (int r = threadIdx.x; r < num_ranks; r += blockDim.x) {
      int64_t v;
      ep_lln::wait_flag(sync + r, want, 0, timeout_ms, err, herr, rank, r, 3, &v, mask, num_ranks);
    }
    __syncthreads();
    if (phase == 1) {  // ctrl, dispatch and combine flags of both halves (the bytes before the dispatch slots)
      const int64_t words = L.ddata / 8;
      for (int64_t i = threadIdx.x; i < 2 * words; i += blockDim.x) {
        const int h = (int)(i / words);
        reinterpret_cast<int64_t*>(own_base + header + h * L.half_bytes)[i - h * words] = 0;
      }
      __threadfence_system();
      __syncthreads();
    }
  }
}

// A refused call (issue 41): the host refused this rank's dispatch (`which` 0) or combine (1) before its kernels ran
// and launches this instead, on the stream its kernels would have run on. One block: every flag this rank's send
// would have written for that call (dispatch: [e][rank] of each peer's local experts; combine: each peer's flags of
// this rank's experts) gets this call's epoch and `word` (kAbortBit | the reason), then this half's epoch advances as
// the receive's last block would have advanced it. The peers' receives of the call record the abort
// (`envelope_record`) and end with every flag consumed; the epochs stay in step. Nothing when the error word is
// raised (a wait expired: the region is unusable until rebuilt).
extern "C" __global__ void __launch_bounds__(256)
    ep_lln_abort(const uint64_t* __restrict__ peers, const uint8_t* own_base, uint8_t* own_half, int num_topk,
                 int hidden, int num_experts, int num_ranks, int rank, int m, int which, int word, int* err) {
  if (*reinterpret_cast<volatile int*>(err) != 0) return;
  const int epr = num_experts / num_ranks;
  const ep_lln::Layout L(epr, num_ranks, num_experts, m, num_topk, hidden);
  int* ctrl = reinterpret_cast<int*>(own_half + L.ctrl);
  const int64_t epoch = (int64_t)ctrl[which] + 1;
  const int64_t value = (epoch << 32) | (int64_t)(uint32_t)word;
  for (int i = threadIdx.x; i < num_ranks * epr; i += blockDim.x) {
    const int p = i / epr, e = i - p * epr;
    if (p == rank) continue;  // this rank's own receive of the call does not run
    const int64_t slot = which == 0 ? (int64_t)e * num_ranks + rank : (int64_t)rank * epr + e;
    int64_t* flag = reinterpret_cast<int64_t*>(own_half + (which == 0 ? L.dflag : L.cflag)) + slot;
    __threadfence_system();
    ep_lln::st_release_sys(
        reinterpret_cast<int64_t*>(ep_lln::peer_addr(peers, p, own_base, reinterpret_cast<uint8_t*>(flag))), value);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    ctrl[which] = (int)epoch;
    __threadfence();
  }
}
