// SPDX-License-Identifier: Apache-2.0
/// \file signal_wait.cuh
/// \brief A bounded stream wait on a 64-bit signal word: the copy-engine backend's replacement for
/// `cuStreamWaitValue64`, which has no timeout (a peer that never writes the word would stall the stream forever).
///
/// One kernel of one thread, launched on the waiting stream where the stream wait would have been queued. It spins
/// (acquire loads at system scope: the word is written by a peer GPU's `cuStreamWriteValue64` or by the host) until
/// `*word >= expected`, then returns, so the stream's later copies see what the peer wrote before its signal. When
/// `timeout_ns` (%globaltimer nanoseconds) pass first, the first wait to time out claims the process's record by a
/// CAS on `claim` (device memory: no atomics on host memory), fills the host-mapped `record` with what it waited
/// for and publishes it (`record[kState] = kTimedOut`, last). Every wait that starts or spins after a claim returns
/// at once, so the streams drain instead of each spending the bound; the data they then copy is undefined, and the
/// host raises `EPTimeoutError` from the record at its next call (`ep_core.signal_wait`). No trap: the context
/// stays usable.
///
/// Cost: while it waits the kernel holds one thread block (one warp slot of one SM, `__nanosleep` between polls);
/// `cuStreamWaitValue64` holds no SM. It returns as soon as the word is reached.
#pragma once

#include <cstdint>

namespace ep_core::signal_wait {

/// The host-mapped record's int64 words (ep_core.signal_wait.RECORD_* mirrors them).
enum RecordWord : int { kState = 0, kWaitId = 1, kValue = 2, kExpected = 3, kElapsedNs = 4, kNumRecordWords = 8 };
/// `record[kState]` values.
enum State : long long { kIdle = 0, kTimedOut = 2 };

__device__ __forceinline__ uint64_t globaltimer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ unsigned long long ld_relaxed_gpu(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

}  // namespace ep_core::signal_wait

/// Wait until `*word >= expected` or `timeout_ns` passed (see the file comment). `claim`: one zeroed device word
/// per process; `record`: `kNumRecordWords` host-mapped int64 words; `wait_id`: the host's name for this wait.
extern "C" __global__ void __launch_bounds__(1)
    ep_signal_wait(const uint64_t* word, uint64_t expected, long long timeout_ns, unsigned long long* claim,
                   volatile long long* record, long long wait_id) {
    using namespace ep_core::signal_wait;
    if (ld_relaxed_gpu(claim) != 0)
        return;  // an earlier wait timed out: drain
    const uint64_t start = globaltimer_ns();
    for (uint32_t iter = 0;; ++iter) {
        const uint64_t value = ld_acquire_sys(word);
        if (value >= expected)
            return;
        if ((iter & 15u) == 15u) {
            if (ld_relaxed_gpu(claim) != 0)
                return;
            const uint64_t elapsed = globaltimer_ns() - start;
            if (elapsed > static_cast<uint64_t>(timeout_ns)) {
                if (atomicCAS(claim, 0ull, 1ull) == 0ull) {  // first timeout of the process: its record
                    record[kWaitId] = wait_id;
                    record[kValue] = static_cast<long long>(value);
                    record[kExpected] = static_cast<long long>(expected);
                    record[kElapsedNs] = static_cast<long long>(elapsed);
                    __threadfence_system();  // the fields before the state
                    record[kState] = kTimedOut;
                    __threadfence_system();
                }
                return;
            }
        }
        __nanosleep(iter < 1024 ? 64 : 1024);
    }
}
