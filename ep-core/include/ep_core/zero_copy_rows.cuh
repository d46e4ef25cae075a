// SPDX-License-Identifier: Apache-2.0
/// \file zero_copy_rows.cuh
/// \brief Where a zero-copy dispatch (`kFlagDispatchZeroCopy`, dispatch.cuh) leaves its outputs: in the receive
/// region of the destination rank, as the arrays the caller gets, in their final form.
///
/// For R = N * M rows (row i = the i-th token this rank receives: source-major, in source-token order, so the rows
/// of the deterministic dispatch), each array 128-byte aligned, in this order:
///   recv_x [R, hidden bytes] at offset 0 (so the zero-copy combine's buffer, which starts there too, has the same
///   rows: an expert writes its outputs over the inputs it has read), scale packs uint32 [R, P], top-k ids int64
///   [R, K] (local expert id or -1), weights float [R, K], and per row int32 {source id, source rank * K + master
///   lane} (the first two columns of the handle's metadata, which the receiver copies into the handle's array).
/// `ep_core.kernels.zero_copy_rows` mirrors the offsets; a region smaller than `num_bytes()` is refused by the host.
#pragma once

#include "config.cuh"

namespace ep_core {

struct ZeroCopyRows {
    int64_t rows;  ///< R = N * M
    int64_t hidden_bytes, num_sf_packs, num_topk;

    static constexpr int64_t kAlign = 128;
    __host__ __device__ int64_t sf_offset() const { return align_up<int64_t>(rows * hidden_bytes, kAlign); }
    __host__ __device__ int64_t topk_idx_offset() const {
        return align_up<int64_t>(sf_offset() + rows * num_sf_packs * 4, kAlign);
    }
    __host__ __device__ int64_t weights_offset() const {
        return align_up<int64_t>(topk_idx_offset() + rows * num_topk * 8, kAlign);
    }
    __host__ __device__ int64_t meta_offset() const {
        return align_up<int64_t>(weights_offset() + rows * num_topk * 4, kAlign);
    }
    __host__ __device__ int64_t num_bytes() const { return meta_offset() + rows * 8; }
};

}  // namespace ep_core
