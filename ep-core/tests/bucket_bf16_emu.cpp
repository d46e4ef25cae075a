// Host emulation of include/ep_core/bucket_bf16.cuh (test_core_bucket_bf16.py): the two kernels' loops with their
// device functions, every thread one after another (the pack: a step's loads by every thread, then its stores, as
// the block barrier orders them), over N ranks' regions in this process.
// stdin: int64 N, E, blocks, threads, scale bits, then per entry (byte offset, m), then per rank its entries'
// float32 data; stdout: the same data after the pack (every rank) and the reduce (every rank).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>
#include <ep_core/bucket_bf16.cuh>

using namespace ep_core::bucket_bf16;

static void pack_kernel(const int64_t* entries, int E, uint8_t* base, int rank, int n, int tile, int blocks) {
  constexpr int64_t kStep = int64_t(kBlockThreads) * kGroup;
  for (int b = 0; b < blocks; ++b) {
    int q = 0;
    int64_t start = 0;
    for (int64_t t = b;; t += blocks) {
      const int e = pack_tile(entries, E, rank, n, tile, t, &q, &start);
      if (e == E) break;
      const int64_t off = entries[2 * e], m = entries[2 * e + 1];
      const int64_t end = start + tile < m ? start + tile : m;
      uint32_t* x = reinterpret_cast<uint32_t*>(base + off);
      const bool vec = (reinterpret_cast<uintptr_t>(x) & 15u) == 0;
      for (int64_t s = start; s < end; s += kStep) {
        std::vector<Words4> bits(kBlockThreads);  // 16-byte aligned, 4 words a thread
        for (int th = 0; th < kBlockThreads; ++th) {
          const int64_t j = s + th * kGroup;
          if (j < end) pack_load(x, q, m, j, vec, &bits[th].x);
        }
        for (int th = 0; th < kBlockThreads; ++th) {  // __syncthreads()
          const int64_t j = s + th * kGroup;
          if (j < end) pack_store(x, q, m, j, tile, vec, &bits[th].x);
        }
      }
    }
  }
}

static void reduce_kernel(const int64_t* entries, int E, const int64_t* bases, int rank, int n, int tile,
                          uint32_t scale_bits, int64_t nthreads) {
  const bool with_scale = scale_bits != 0x3F800000u;
  for (int64_t tid = 0; tid < nthreads; ++tid)
    for (int e = 0; e < E; ++e) {
      const int64_t off = entries[2 * e], m = entries[2 * e + 1];
      const bool vec = ((bases[rank] + off) & 15) == 0;
      for (int64_t g = tid; g < m / kGroup; g += nthreads)
        reduce_group(bases, off, m, rank, n, g * kGroup, tile, vec, with_scale, as_float(scale_bits));
    }
}

int main() {
  int64_t h[5];
  if (fread(h, 8, 5, stdin) != 5) return 2;
  const int n = int(h[0]), E = int(h[1]), blocks = int(h[2]);
  const int64_t threads = h[3];
  const uint32_t scale_bits = uint32_t(h[4]);
  std::vector<int64_t> entries(2 * E);
  if (fread(entries.data(), 8, 2 * E, stdin) != size_t(2 * E)) return 2;
  int64_t bytes = 0;
  for (int e = 0; e < E; ++e) bytes = std::max<int64_t>(bytes, entries[2 * e] + 4 * n * entries[2 * e + 1]);
  std::vector<std::vector<Words4>> regions(n, std::vector<Words4>(bytes / 16 + 1));  // 16-byte aligned bases
  std::vector<int64_t> bases(n);
  for (int r = 0; r < n; ++r) bases[r] = int64_t(regions[r].data());
  for (int r = 0; r < n; ++r)
    for (int e = 0; e < E; ++e) {
      const size_t count = size_t(n * entries[2 * e + 1]);
      if (fread(reinterpret_cast<uint8_t*>(bases[r]) + entries[2 * e], 4, count, stdin) != count) return 2;
    }
  const int tile = n <= 8 ? 32768 : 16384;
  for (int r = 0; r < n; ++r) pack_kernel(entries.data(), E, reinterpret_cast<uint8_t*>(bases[r]), r, n, tile, blocks);
  for (int r = 0; r < n; ++r) reduce_kernel(entries.data(), E, bases.data(), r, n, tile, scale_bits, threads);
  for (int r = 0; r < n; ++r)
    for (int e = 0; e < E; ++e)
      fwrite(reinterpret_cast<uint8_t*>(bases[r]) + entries[2 * e], 4, size_t(n * entries[2 * e + 1]), stdout);
  return 0;
}
