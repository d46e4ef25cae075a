// SPDX-License-Identifier: Apache-2.0
/// \file timeout.cuh
/// \brief The one timeout primitive: every wait on a peer or on other blocks goes through `wait_until`.
///
/// A wait spins on its condition and on the abort flag of this rank's workspace. When the cycle budget
/// (`OpArgs::timeout_cycles`, `clock64` cycles) is spent it records (rank, peer, tag, counter, value, expected) in
/// the workspace error record (first error wins), raises the abort flag in every rank's workspace (best effort:
/// a CAS from 0 to kPeerAbort, so a peer's own record survives) and returns false; the caller
/// then leaves the kernel. No trap: the context stays usable, the host reads the record and raises EPTimeoutError.
///
/// Failure rule (the host side is `ep_core.kernels.direct_rank`): an operation whose kernels did not complete their
/// work never looks complete to the host.
///  - The abort flag of a rank stays raised until the host resets the rank (`reset_state`: a collective memset).
///  - Every kernel checks the local abort flag at entry (`entry_aborted`) and, if it is raised, does nothing: its
///    outputs are left as they are (undefined), never half-computed from stale counts.
///  - Every kernel that leaves early (failed wait, or raised flag at entry) first copies the abort kind into the
///    host-mapped word `OpArgs::host_error[0]` (`publish_failure`), so the host learns of it without a stream
///    sync: it reads that word before every launch and refuses to launch (sticky error) until the rank is reset.
///  - Invalid inputs (not an abort) set `host_error[1]`; the host raises them at its next call.
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

/// Copy this rank's abort kind into the host-mapped word (called by a kernel that leaves early; any thread).
EP_CORE_DEVICE void publish_failure(const OpArgs& args, const Workspace& ws) {
    if (args.host_error != nullptr) {
        const int32_t kind = ptx::ld_relaxed_sys(ws.abort_flag());
        ptx::st_relaxed_sys(args.host_error, kind != 0 ? kind : static_cast<int32_t>(ErrorKind::kPeerAbort));
    }
}

/// Kernel entry guard, called by one thread per block: true (and the failure published) when an earlier failure left
/// this rank's abort flag raised; the block must then return without touching any output.
EP_CORE_DEVICE bool entry_aborted(const OpArgs& args, const Workspace& ws) {
    if (ptx::ld_relaxed_sys(ws.abort_flag()) == 0)
        return false;
    publish_failure(args, ws);
    return true;
}

/// Spin until `cond(value)` holds. `load()` returns the watched value (int64). Returns false on timeout or abort.
/// Must be called by one thread (the others wait at a block barrier and read the outcome from shared memory).
/// `peer`/`counter`/`expected` only describe the wait in the error record. `budget_scale` multiplies the budget
/// (grid barriers: a block that waits for block 0 should not time out before block 0's own wait on a peer, whose
/// record names the real cause).
template <typename Load, typename Cond, typename RaiseAbort>
EP_CORE_DEVICE bool wait_until(const OpArgs& args, const Workspace& ws, int32_t tag, int32_t peer, int64_t counter,
                               int64_t expected, Load load, Cond cond, RaiseAbort raise_abort, int budget_scale = 1) {
    constexpr int64_t kMaxBudget = 0x7fffffffffffffffll;
    const int64_t budget =
        args.timeout_cycles > kMaxBudget / budget_scale ? kMaxBudget : args.timeout_cycles * budget_scale;
    const int64_t start = ptx::clock();
    int64_t value = 0;
    for (uint32_t iter = 0;; ++iter) {
        value = load();
        if (cond(value))
            return true;
        if ((iter & 63u) == 63u) {
            if (ptx::ld_relaxed_sys(ws.abort_flag()) != 0) {
                publish_failure(args, ws);
                return false;
            }
            if (ptx::clock() - start > budget) {
                record_error(ws, ErrorKind::kTimeout, args.rank, peer, tag, counter, value, expected, -1, -1);
                raise_abort();
                publish_failure(args, ws);
                return false;
            }
        }
    }
}

}  // namespace ep_core
