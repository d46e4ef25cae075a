// SPDX-License-Identifier: Apache-2.0
/// \file timeout.cuh
/// \brief The one timeout primitive: every wait on a peer or on other blocks goes through `wait_until`.
///
/// A wait spins on its condition and on the abort flag of this rank's workspace. When the cycle budget
/// (`OpArgs::timeout_cycles`, `clock64` cycles) is spent it records (rank, peer, tag, counter, value, expected) in
/// the workspace error record (first error wins), raises the abort flag in every rank's workspace (best effort:
/// a CAS from 0 to kPeerAbort, so a peer's own record survives) and returns false; the caller
/// then leaves the kernel. No trap: the context stays usable, the host reads the record and raises EPTimeoutError.
#pragma once

#include "args.cuh"
#include "ptx.cuh"

namespace ep_core {

/// Record an error in this rank's workspace: the first failure claims `abort_flag` by CAS, then fills the record.
EP_CORE_DEVICE void record_error(const Workspace& ws, ErrorKind kind, int64_t rank, int32_t peer, int32_t tag,
                                 int64_t counter, int64_t value, int64_t expected, int32_t token, int32_t lane) {
    ep_layout::ErrorRecord* rec = ws.error_record();
    // System scope: peers raise this flag with atomicCAS_system (barrier.cuh), so ours must be a system atomic too.
    if (atomicCAS_system(&rec->abort_flag, 0, static_cast<int32_t>(kind)) == 0) {
        rec->rank = static_cast<int32_t>(rank);
        rec->peer_rank = peer;
        rec->tag = tag;
        rec->counter = counter;
        rec->value = value;
        rec->expected = expected;
        rec->token_idx = token;
        rec->lane = lane;
        ptx::fence_sys();
    }
}

/// Spin until `cond(value)` holds. `load()` returns the watched value (int64). Returns false on timeout or abort.
/// Must be called by one thread (the others wait at a block barrier and read the outcome from shared memory).
/// `peer`/`counter`/`expected` only describe the wait in the error record.
template <typename Load, typename Cond, typename RaiseAbort>
EP_CORE_DEVICE bool wait_until(const OpArgs& args, const Workspace& ws, int32_t tag, int32_t peer, int64_t counter,
                               int64_t expected, Load load, Cond cond, RaiseAbort raise_abort) {
    const int64_t start = ptx::clock();
    int64_t value = 0;
    for (uint32_t iter = 0;; ++iter) {
        value = load();
        if (cond(value))
            return true;
        if ((iter & 63u) == 63u) {
            if (ptx::ld_relaxed_sys(ws.abort_flag()) != 0)
                return false;
            if (ptx::clock() - start > args.timeout_cycles) {
                record_error(ws, ErrorKind::kTimeout, args.rank, peer, tag, counter, value, expected, -1, -1);
                raise_abort();
                return false;
            }
        }
    }
}

}  // namespace ep_core
