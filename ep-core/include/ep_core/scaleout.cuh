// SPDX-License-Identifier: Apache-2.0
/// \file scaleout.cuh
/// \brief The scale-out primitive of hybrid mode (put + signal to a rank of another node), picked at JIT time.
///
/// Concept (what hybrid.cuh uses), with GIN's ordering: a `signal` to a peer makes every earlier `put` of this
/// rank to that peer visible before the signal is (put-then-signal).
///  - `T* dst(T* local, int peer, T* staging)`: where the caller writes the bytes of a put whose destination is the
///    symmetric address `local` on `peer`: the peer's address itself (emulated) or a local staging area in this
///    rank's own window (gin: a put reads registered memory).
///  - `commit(local, staging, bytes, peer)`: issue the put once the bytes are written (emulated: nothing to do).
///  - `signal(word, value, peer)`: add `value` to the uint64 `word` (a symmetric address, zero before) on `peer`.
///    The caller orders the puts before it (block barrier, then `ptx::fence_sys` by the signalling thread).
///  - `put_value(word, value, peer)`: store one uint64 at the symmetric address `word` on `peer` (ordered before a
///    later `signal` to that peer).
///
/// - `EmulatedScaleout`: load/store through the transport's `sym_ptr`: every rank of the loopback domain (or of
///   processes sharing a GPU) is reachable, so the whole protocol runs on one GPU; the release add of the signal
///   after a system fence is GIN's put-then-signal ordering.
/// - `GinScaleout` (with `EP_CORE_WITH_NCCL`): NCCL GIN puts and strong VA signals on the world team of the
///   device communicator (`OpArgs::nccl_devcomm`); compiled in CI, never run here (no RDMA NIC). Its kernels use
///   `NodeLsaTransport` for the load/store peers: NCCL's LSA team is one node, indexed by the local rank.
#pragma once

#include "transport.cuh"

namespace ep_core {

template <typename Transport>
struct EmulatedScaleout {
    static constexpr bool kStaged = false;
    const Transport& tr;

    EP_CORE_DEVICE EmulatedScaleout(const OpArgs&, const Transport& t) : tr(t) {}

    template <typename T>
    EP_CORE_DEVICE T* dst(T* local, int peer, T*) const {
        return tr.sym_ptr(local, peer);
    }
    EP_CORE_DEVICE void commit(const void*, const void*, int64_t, int) const {}
    EP_CORE_DEVICE void signal(uint64_t* word, uint64_t value, int peer) const {
        ptx::red_add_release_sys(tr.sym_ptr(word, peer), value);
    }
    EP_CORE_DEVICE void put_value(uint64_t* word, uint64_t value, int peer) const {
        *reinterpret_cast<volatile uint64_t*>(tr.sym_ptr(word, peer)) = value;
    }
};

#if defined(EP_CORE_WITH_NCCL)
/// Load/store peers of hybrid kernels over NCCL: global rank p of this node is LSA rank p % S_u (ranks r / S_u form
/// a node and NCCL's LSA team is one node). Only peers of this node may be passed.
template <int kNumScaleupRanks>
struct NodeLsaTransport {
    NcclTransport lsa;

    EP_CORE_DEVICE explicit NodeLsaTransport(const OpArgs& args) : lsa(args) {}

    template <typename T>
    EP_CORE_DEVICE T* sym_ptr(T* local_ptr, int peer) const {
        return lsa.sym_ptr(local_ptr, peer % kNumScaleupRanks);
    }
};

template <typename Transport>
struct GinScaleout {
    static constexpr bool kStaged = true;
    const Transport& tr;
    const ncclDevComm* comm;
    ncclWindow_t window;
    const uint8_t* own_base;

    EP_CORE_DEVICE GinScaleout(const OpArgs& args, const Transport& t)
        : tr(t), comm(static_cast<const ncclDevComm*>(args.nccl_devcomm)),
          window(reinterpret_cast<ncclWindow_t>(args.nccl_window)),
          own_base(static_cast<const uint8_t*>(args.own_base)) {}

    EP_CORE_DEVICE size_t offset_of(const void* p) const {
        return static_cast<size_t>(static_cast<const uint8_t*>(p) - own_base);
    }
    template <typename T>
    EP_CORE_DEVICE T* dst(T*, int, T* staging) const {
        return staging;
    }
    EP_CORE_DEVICE void commit(const void* local, const void* staging, int64_t bytes, int peer) const {
        ncclGin gin(*comm, 0);
        gin.put(ncclTeamWorld(*comm), peer, window, offset_of(local), window, offset_of(staging),
                static_cast<size_t>(bytes));
    }
    EP_CORE_DEVICE void signal(uint64_t* word, uint64_t value, int peer) const {
        ncclGin gin(*comm, 0);
        gin.signal(ncclTeamWorld(*comm), peer, ncclGin_StrongVASignalAdd{window, offset_of(word), value});
    }
    EP_CORE_DEVICE void put_value(uint64_t* word, uint64_t value, int peer) const {
        ncclGin gin(*comm, 0);
        gin.putValue(ncclTeamWorld(*comm), peer, window, offset_of(word), value);
    }
};
#endif

}  // namespace ep_core
