"""ep_symmem: symmetric memory over CUDA virtual memory management.

Every rank allocates a buffer of the same layout (`SymmetricAllocation.create`), the ranks swap descriptors
(`exchange` with any bootstrap), and each rank then addresses every peer's buffer directly (`peer_ptr`,
`peer_ptr_table`). A buffer may be *elastic*: GPU memory followed by host NUMA memory in one virtual range.
Importing needs no GPU; libcuda is loaded on the first GPU call.
"""

__version__ = "0.1.0"

from . import _C, _env
from ._allocation import ALIGNMENT_BYTES, HandleType, SymmetricAllocation
from ._bootstrap import Bootstrap, FileBootstrap, LocalBootstrap
from ._descriptor import DESCRIPTOR_VERSION, Descriptor
from ._device import (
    DeviceInfo,
    MemoryInfo,
    copy_device,
    copy_from_device,
    copy_to_device,
    device_count,
    device_info,
    device_memory_info,
    fill_u32,
    is_available,
    memset_device,
    open_fd_count,
    synchronize,
)
from ._errors import (
    AllocationClosedError,
    BootstrapError,
    BootstrapTimeoutError,
    CudaError,
    DescriptorError,
    DescriptorVersionError,
    DriverNotFoundError,
    ExchangeError,
    NoDeviceError,
    PeerAccessError,
    SymmemError,
    SymmemValueError,
    UnsupportedError,
)
from ._exchange import exchange, exchange_local

_C.set_driver_library(_env.libcuda_path())

__all__ = [
    "ALIGNMENT_BYTES",
    "DESCRIPTOR_VERSION",
    "AllocationClosedError",
    "Bootstrap",
    "BootstrapError",
    "BootstrapTimeoutError",
    "CudaError",
    "Descriptor",
    "DescriptorError",
    "DescriptorVersionError",
    "DeviceInfo",
    "DriverNotFoundError",
    "ExchangeError",
    "FileBootstrap",
    "HandleType",
    "LocalBootstrap",
    "MemoryInfo",
    "NoDeviceError",
    "PeerAccessError",
    "SymmemError",
    "SymmemValueError",
    "SymmetricAllocation",
    "UnsupportedError",
    "__version__",
    "copy_device",
    "copy_from_device",
    "copy_to_device",
    "device_count",
    "device_info",
    "device_memory_info",
    "exchange",
    "exchange_local",
    "fill_u32",
    "is_available",
    "memset_device",
    "open_fd_count",
    "synchronize",
]
