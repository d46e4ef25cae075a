// SPDX-License-Identifier: Apache-2.0
/// \file transport.cuh
/// \brief The device-side transport concept and its two implementations, picked at JIT time.
///
/// Concept (what kernels use): `T* sym_ptr(T* local_ptr, int peer)` returns the address of the same symmetric
/// byte on `peer` (load/store reachable: direct mode). Signals, waits and barriers are written once on top of it
/// (`barrier.cuh`) with system-scope acquire/release, so they hold for peers on other GPUs too.
///
/// - `IpcTransport`: peers' bases come from a device table filled by ep-symmem (VMM + fd exchange) or by the
///   loopback domain (several ranks in one process).
/// - `NcclTransport` (compiled when `EP_CORE_WITH_NCCL` is defined): LSA pointers of an NCCL window
///   (`ncclGetLsaPointer`), the rank order of the LSA team equal to the EP rank order (direct mode).
#pragma once

#include "args.cuh"

#if defined(EP_CORE_WITH_NCCL)
#include <nccl_device.h>
#endif

namespace ep_core {

struct IpcTransport {
    const uint64_t* peer_bases;
    const uint8_t* own_base;

    EP_CORE_DEVICE explicit IpcTransport(const OpArgs& args)
        : peer_bases(args.peer_bases), own_base(static_cast<const uint8_t*>(args.own_base)) {}

    template <typename T>
    EP_CORE_DEVICE T* sym_ptr(T* local_ptr, int peer) const {
        const int64_t offset = reinterpret_cast<const uint8_t*>(local_ptr) - own_base;
        return reinterpret_cast<T*>(static_cast<uintptr_t>(__ldg(peer_bases + peer) + offset));
    }
};

#if defined(EP_CORE_WITH_NCCL)
struct NcclTransport {
    ncclWindow_t window;
    const uint8_t* own_base;

    EP_CORE_DEVICE explicit NcclTransport(const OpArgs& args)
        : window(reinterpret_cast<ncclWindow_t>(args.nccl_window)),
          own_base(static_cast<const uint8_t*>(args.own_base)) {}

    template <typename T>
    EP_CORE_DEVICE T* sym_ptr(T* local_ptr, int peer) const {
        const size_t offset = static_cast<size_t>(reinterpret_cast<const uint8_t*>(local_ptr) - own_base);
        return static_cast<T*>(ncclGetLsaPointer(window, offset, peer));
    }
};
#endif

/// Domains up to this many ranks keep a per-block table of peer addresses in shared memory (8 bytes per rank).
static constexpr int kMaxCachedPeers = 128;

/// The address of one symmetric pointer on every peer, looked up once per block: `sym_ptr` is a table load (ipc) or
/// an LSA window lookup (nccl) that per-token loops should not repeat. `table` is a shared array of `kNumRanks`
/// entries when `kCached` (else of 1, unused: larger domains call `sym_ptr` each time).
template <int kNumRanks, typename Transport>
struct PeerPointers {
    static constexpr bool kCached = kNumRanks <= kMaxCachedPeers;
    static constexpr int kTableSize = kCached ? kNumRanks : 1;

    uint8_t** table;
    const Transport& tr;
    uint8_t* local;

    /// Every thread of the block calls this; a block barrier must follow before the first lookup.
    EP_CORE_DEVICE void fill() const {
        if constexpr (kCached) {
            for (int p = threadIdx.x; p < kNumRanks; p += blockDim.x)
                table[p] = tr.sym_ptr(local, p);
        }
    }

    EP_CORE_DEVICE uint8_t* operator[](int peer) const {
        if constexpr (kCached)
            return table[peer];
        else
            return tr.sym_ptr(local, peer);
    }
};

}  // namespace ep_core
