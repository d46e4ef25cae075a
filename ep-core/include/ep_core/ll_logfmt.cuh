// SPDX-License-Identifier: Apache-2.0
// LogFMT-10, V1's encoding of the low-latency combine payload (low_latency_combine(use_logfmt=True)): the arithmetic
// of ep_torch.legacy.logfmt (its numpy model is the contract; the format is documented there), host and device,
// bit for bit: every float operation is a correctly rounded IEEE one (add_rn/mul_rn/div_rn, no contraction),
// log2 of a bf16 magnitude is exponent + a table, 2**y a fixed polynomial. ll_native.cuh's combine kernels use it.
//   group  128 channels, meta word amax | amin << 16 (magnitude bits); chunk 1024 channels (512 if hidden % 1024)
//   an encoded chunk: 5 uint32 per 16 values (nine-bit codes little-endian in bits 0..143, signs in 144..159)
#pragma once

#include <math.h>

#include "ll_pack.cuh"

#define EP_LFMT_LOG2_TABLE \
    0x00000000u, 0x3C37F286u, 0x3CB73CB4u, 0x3D08E68Fu, 0x3D35D69Cu, 0x3D626FD6u, 0x3D8759C5u, 0x3D9D517Fu, \
    0x3DB31FB8u, 0x3DC8C50Bu, 0x3DDE4212u, 0x3DF39761u, 0x3E0462C4u, 0x3E0EE68Du, 0x3E19574Fu, 0x3E23B550u, \
    0x3E2E00D2u, 0x3E383A17u, 0x3E42615Fu, 0x3E4C76E8u, 0x3E567AF1u, 0x3E606DB6u, 0x3E6A4F72u, 0x3E74205Fu, \
    0x3E7DE0B6u, 0x3E83C857u, 0x3E88983Fu, 0x3E8D602Eu, 0x3E92203Du, 0x3E96D888u, 0x3E9B8926u, 0x3EA03232u, \
    0x3EA4D3C2u, 0x3EA96DF0u, 0x3EAE00D2u, 0x3EB28C7Fu, 0x3EB7110Eu, 0x3EBB8E96u, 0x3EC0052Bu, 0x3EC474E4u, \
    0x3EC8DDD4u, 0x3ECD4012u, 0x3ED19BB0u, 0x3ED5F0C4u, 0x3EDA3F60u, 0x3EDE8797u, 0x3EE2C97Du, 0x3EE70525u, \
    0x3EEB3A9Fu, 0x3EEF69FFu, 0x3EF39355u, 0x3EF7B6B4u, 0x3EFBD42Bu, 0x3EFFEBCDu, 0x3F01FED4u, 0x3F0404E8u, \
    0x3F060828u, 0x3F08089Eu, 0x3F0A0650u, 0x3F0C0146u, 0x3F0DF989u, 0x3F0FEF1Fu, 0x3F11E20Fu, 0x3F13D260u, \
    0x3F15C01Au, 0x3F17AB44u, 0x3F1993E3u, 0x3F1B7A00u, 0x3F1D5DA0u, 0x3F1F3ECAu, 0x3F211D84u, 0x3F22F9D5u, \
    0x3F24D3C2u, 0x3F26AB53u, 0x3F28808Cu, 0x3F2A5374u, 0x3F2C2411u, 0x3F2DF268u, 0x3F2FBE80u, 0x3F31885Cu, \
    0x3F335004u, 0x3F35157Du, 0x3F36D8CBu, 0x3F3899F5u, 0x3F3A58FFu, 0x3F3C15EEu, 0x3F3DD0C8u, 0x3F3F8991u, \
    0x3F41404Fu, 0x3F42F506u, 0x3F44A7BAu, 0x3F465872u, 0x3F480731u, 0x3F49B3FBu, 0x3F4B5ED7u, 0x3F4D07C7u, \
    0x3F4EAED0u, 0x3F5053F7u, 0x3F51F740u, 0x3F5398AFu, 0x3F553848u, 0x3F56D60Fu, 0x3F587209u, 0x3F5A0C3Au, \
    0x3F5BA4A4u, 0x3F5D3B4Eu, 0x3F5ED039u, 0x3F60636Au, 0x3F61F4E5u, 0x3F6384ADu, 0x3F6512C7u, 0x3F669F35u, \
    0x3F6829FBu, 0x3F69B31Eu, 0x3F6B3A9Fu, 0x3F6CC083u, 0x3F6E44CDu, 0x3F6FC781u, 0x3F7148A1u, 0x3F72C832u, \
    0x3F744636u, 0x3F75C2B0u, 0x3F773DA4u, 0x3F78B714u, 0x3F7A2F04u, 0x3F7BA578u, 0x3F7D1A71u, 0x3F7E8DF2u,

#ifdef __CUDACC__
static __device__ const uint32_t ep_lfmt_log2_dev[128] = {EP_LFMT_LOG2_TABLE};
#endif
static const uint32_t ep_lfmt_log2_host[128] = {EP_LFMT_LOG2_TABLE};

namespace ep_lfmt {

constexpr int kGroup = 128;
constexpr uint32_t kOneBits = 0x3F80u;  // bf16 1.0: an encoded chunk's magnitudes are all below it
constexpr uint32_t kMaxCode = 511u;

__host__ __device__ inline int chunk_size(int hidden) { return hidden % 1024 == 0 ? 1024 : 512; }

__host__ __device__ inline float log2_table(uint32_t k) {
#ifdef __CUDA_ARCH__
  return ep_ll::u2f(ep_lfmt_log2_dev[k]);
#else
  return ep_ll::u2f(ep_lfmt_log2_host[k]);
#endif
}

__host__ __device__ inline int clz32(uint32_t v) {
#ifdef __CUDA_ARCH__
  return __clz(v);
#else
  return __builtin_clz(v);
#endif
}

// log2 of a positive finite bf16 magnitude (bits 1..0x7F7F): exponent + log2(1 + mantissa / 128), one add.
__host__ __device__ inline float log2_mag(uint32_t b) {
  const int e = (int)(b >> 7);
  const uint32_t k = b & 127u;
  if (e > 0) return ep_ll::add_rn((float)(e - 127), log2_table(k));
  const int p = 31 - clz32(k);  // subnormal k * 2**-133: k's leading one moved to bit 7
  return ep_ll::add_rn((float)(p - 133), log2_table((k << (7 - p)) & 127u));
}

// 2**y for y in [-170, 0): p(y - floor y) * 2**floor(y), through 2**(n + 100) then 2**-100 (one rounding).
__host__ __device__ inline float exp2m(float y) {
  const float n = floorf(y);
  const float f = ep_ll::add_rn(y, -n);
  float p = ep_ll::u2f(0x39637149u);
  p = ep_ll::add_rn(ep_ll::mul_rn(p, f), ep_ll::u2f(0x3AA3180Eu));
  p = ep_ll::add_rn(ep_ll::mul_rn(p, f), ep_ll::u2f(0x3C1E9275u));
  p = ep_ll::add_rn(ep_ll::mul_rn(p, f), ep_ll::u2f(0x3D6342B1u));
  p = ep_ll::add_rn(ep_ll::mul_rn(p, f), ep_ll::u2f(0x3E75FECDu));
  p = ep_ll::add_rn(ep_ll::mul_rn(p, f), ep_ll::u2f(0x3F317215u));
  p = ep_ll::add_rn(ep_ll::mul_rn(p, f), ep_ll::u2f(0x3F800000u));
  const float up = ep_ll::u2f((uint32_t)((int)n + 227) << 23);
  return ep_ll::mul_rn(ep_ll::mul_rn(p, up), ep_ll::u2f(27u << 23));
}

// A group's castability from its meta word (V1: log2 amax < 0 and log2 amin < log2 amax; all-zero, all-equal,
// >= 1, Inf and NaN groups are not).
__host__ __device__ inline bool group_ok(uint32_t meta) {
  const uint32_t amax = meta & 0xFFFFu, amin = meta >> 16;
  return amax > 0u && amax < kOneBits && amin < amax;
}

struct Params {
  float lmin, step, inv, rnd;
};

// The levels of a castable group.
__host__ __device__ inline Params params(uint32_t meta) {
  const uint32_t amax = meta & 0xFFFFu, amin = meta >> 16;
  const float lmax = log2_mag(amax);
  const float clip = ep_ll::add_rn(lmax, -32.0f);
  Params q;
  q.lmin = amin == 0u ? clip : fmaxf(log2_mag(amin), clip);
  q.step = ep_ll::div_rn(ep_ll::add_rn(lmax, -q.lmin), 510.0f);
  q.inv = ep_ll::div_rn(1.0f, q.step);
  q.rnd = ep_ll::add_rn(1.5f, -ep_ll::mul_rn(q.step, ep_ll::u2f(0x3DB17218u)));  // 1.5 - step * ln2 / 8
  return q;
}

// Nine-bit magnitude code of a bf16 magnitude (bits).
__host__ __device__ inline uint32_t code_of(uint32_t mag, const Params& q) {
  if (mag == 0u) return 0u;
  const float u = ep_ll::add_rn(ep_ll::mul_rn(ep_ll::add_rn(log2_mag(mag), -q.lmin), q.inv), q.rnd);
  if (!(u >= 0.0f)) return 0u;
  if (u >= (float)kMaxCode) return kMaxCode;
  return (uint32_t)floorf(u);
}

// The float32 value of (code, sign).
__host__ __device__ inline float value_of(uint32_t code, uint32_t sign, const Params& q) {
  float v = 0.0f;
  if (code != 0u) v = exp2m(ep_ll::add_rn(q.lmin, ep_ll::mul_rn((float)(code - 1u), q.step)));
  return sign ? -v : v;
}

// 16 bf16 values (8 words, value 2i in the low half of word i) -> 5 words.
__host__ __device__ inline void pack16(const uint32_t in[8], const Params& q, uint32_t out[5]) {
  for (int i = 0; i < 5; ++i) out[i] = 0u;
  uint32_t signs = 0u;
  for (int i = 0; i < 16; ++i) {
    const uint32_t b = (in[i >> 1] >> (16 * (i & 1))) & 0xFFFFu;
    signs |= (b >> 15) << i;
    const uint32_t c = code_of(b & 0x7FFFu, q);
    const int bit = 9 * i, w = bit >> 5, off = bit & 31;
    out[w] |= c << off;
    if (off > 23) out[w + 1] |= c >> (32 - off);
  }
  out[4] |= signs << 16;
}

// Value i (0..15) of 5 packed words.
__host__ __device__ inline float unpack_one(const uint32_t w[5], int i, const Params& q) {
  const int bit = 9 * i, k = bit >> 5, off = bit & 31;
  uint32_t c = w[k] >> off;
  if (off > 23) c |= w[k + 1] << (32 - off);
  return value_of(c & kMaxCode, (w[4] >> (16 + i)) & 1u, q);
}

// One warp encodes chunk c of a bf16 row into its slot: `src` the row's first vector, `row` the slot's first byte,
// `meta` the slot's group words. Lane l holds `per` = chunk / 256 vectors; each 128-channel group reduces its
// magnitude bits over 16 / per lanes and writes its word; the chunk is encoded (5 words per 16 values at its bf16
// offset) when every group allows it, else copied as bf16. All 32 lanes, warp-uniform arguments.
__device__ inline void encode_chunk_warp(const uint4* src, uint8_t* row, uint32_t* meta, int hidden, int c,
                                         int lane) {
  const int ch = chunk_size(hidden), per = ch / 256, gl = 16 / per;
  src += (int64_t)c * (ch / 8) + lane * per;
  row += (int64_t)c * ch * 2;
  uint4 v[4];
  uint32_t amax = 0u, amin = 0xFFFFu;
  for (int i = 0; i < per; ++i) {
    v[i] = src[i];
    const uint32_t w4[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
    for (int q = 0; q < 4; ++q) {
      const uint32_t lo = w4[q] & 0x7FFFu, hi = (w4[q] >> 16) & 0x7FFFu;
      amax = lo > amax ? lo : amax;
      amax = hi > amax ? hi : amax;
      amin = lo < amin ? lo : amin;
      amin = hi < amin ? hi : amin;
    }
  }
  for (int d = 1; d < gl; d <<= 1) {
    const uint32_t omax = __shfl_xor_sync(0xFFFFFFFFu, amax, d), omin = __shfl_xor_sync(0xFFFFFFFFu, amin, d);
    amax = omax > amax ? omax : amax;
    amin = omin < amin ? omin : amin;
  }
  const uint32_t word = amax | (amin << 16);
  if (lane % gl == 0) meta[c * (ch / 128) + lane / gl] = word;
  if (__all_sync(0xFFFFFFFFu, group_ok(word))) {
    const Params q = params(word);
    uint32_t* dst = reinterpret_cast<uint32_t*>(row) + lane * (per / 2) * 5;
    for (int i = 0; i < per; i += 2) {
      const uint32_t in[8] = {v[i].x, v[i].y, v[i].z, v[i].w, v[i + 1].x, v[i + 1].y, v[i + 1].z, v[i + 1].w};
      uint32_t enc[5];
      pack16(in, q, enc);
      for (int k = 0; k < 5; ++k) dst[(i / 2) * 5 + k] = enc[k];
    }
  } else {
    uint4* dst = reinterpret_cast<uint4*>(row) + lane * per;
    for (int i = 0; i < per; ++i) dst[i] = v[i];
  }
}

// Channels 8c..8c+7 of a slot (`slot` its first byte, `meta` its group words) as float32: decoded when their chunk
// was encoded (every group word of the chunk allows it), else the bf16 values.
__device__ inline void load8(const uint8_t* slot, const uint32_t* meta, int hidden, int c, float f[8]) {
  const int ch = chunk_size(hidden), gpc = ch / 128;
  const int chunk = c / (ch / 8);
  bool enc = true;
  for (int g = chunk * gpc; g < (chunk + 1) * gpc; ++g) enc = enc && group_ok(meta[g]);
  if (enc) {
    const Params q = params(meta[c / 16]);
    const uint32_t* wp =
        reinterpret_cast<const uint32_t*>(slot + (int64_t)chunk * ch * 2) + ((c % (ch / 8)) / 2) * 5;
    const uint32_t wd[5] = {wp[0], wp[1], wp[2], wp[3], wp[4]};
    for (int i = 0; i < 8; ++i) f[i] = unpack_one(wd, (c & 1) * 8 + i, q);
  } else {
    const uint4 v = reinterpret_cast<const uint4*>(slot)[c];
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
    for (int i = 0; i < 4; ++i) f[2 * i] = ep_ll::bf16_lo(words[i]), f[2 * i + 1] = ep_ll::bf16_hi(words[i]);
  }
}

}  // namespace ep_lfmt
