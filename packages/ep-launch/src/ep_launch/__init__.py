"""ep_launch: the per-call driver work of a prepared kernel launch, in C++ (no device code, libcuda via dlopen).

`Launch(function, grid, block, shared_mem, cooperative, words, slots, pdl=False)` keeps a kernel's launch
configuration and its packed argument words (one by-value struct parameter); `launch(stream, values)` copies the
words, writes `values[i]` into word `slots[i]` (ints; values in [2**63, 2**64) wrap to int64) and calls
cuLaunchKernelEx. `record_wait(event, on, waiter)` is cuEventRecord(event, on) + cuStreamWaitEvent(waiter, event).
`copy_to_host(dst, src, nbytes, stream)` queues cuMemcpyDtoHAsync, `stream_query(stream)` is cuStreamQuery (0 done,
600 not ready). All return the CUresult (0 = success) instead of raising, so the caller reports errors its own way;
`error_name(code)` names one. Importing needs no GPU; `available()` says whether the driver could be loaded
(`unavailable_reason()` says why not).
"""

__version__ = "0.1.0"

from ._C import (
    Launch,
    available,
    copy_to_host,
    error_name,
    record_wait,
    stream_query,
    unavailable_reason,
)

__all__ = [
    "Launch",
    "__version__",
    "available",
    "copy_to_host",
    "error_name",
    "record_wait",
    "stream_query",
    "unavailable_reason",
]
