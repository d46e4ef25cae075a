"""NCCL version codes, the features that need a minimum version, and NCCL's header/library rule.

NCCL encodes versions as ``NCCL_VERSION_CODE``: ``X*1000 + Y*100 + Z`` up to 2.8 and ``X*10000 + Y*100 + Z``
from 2.9 on (so 2.28.9 is 22809). Facts (SPEC §8): the device API (LSA) arrived in 2.28.3, GIN in 2.28.7,
versioned structs and ``ncclCommQueryProperties`` in 2.29.2, the GIN connection type, exclusive contexts and
queue depth in 2.29.7, the GIN traffic class in 2.30.3, and header/library independence (``useRuntimeVersion``)
in 2.31. Before 2.31 the headers a program is compiled against must be the same version as the library.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .errors import NcclVersionError

__all__ = [
    "FEATURES",
    "Feature",
    "NcclVersion",
    "check_header_runtime",
    "parse_header_version",
    "require",
]


@dataclass(frozen=True, order=True)
class NcclVersion:
    """A NCCL version; compares as a tuple ``(major, minor, patch)``."""

    major: int
    minor: int
    patch: int

    @classmethod
    def from_code(cls, code: int) -> NcclVersion:
        """Decode an ``NCCL_VERSION_CODE`` (as ``ncclGetVersion`` returns it)."""
        if not isinstance(code, int) or isinstance(code, bool) or code <= 0:
            raise ValueError(
                f"code: expected a positive NCCL_VERSION_CODE integer such as 22809, got {code!r}"
            )
        if code >= 10000:
            return cls(code // 10000, (code % 10000) // 100, code % 100)
        return cls(code // 1000, (code % 1000) // 100, code % 100)

    @classmethod
    def parse(cls, text: str) -> NcclVersion:
        """Parse ``"2.28.9"`` (a trailing ``-1`` or ``+cuda13.0`` build tag is ignored)."""
        m = re.fullmatch(r"\s*(\d+)\.(\d+)\.(\d+)(?:[-+].*)?\s*", text)
        if m is None:
            raise ValueError(f"text: expected a version such as '2.28.9', got {text!r}")
        return cls(int(m.group(1)), int(m.group(2)), int(m.group(3)))

    @property
    def code(self) -> int:
        """The ``NCCL_VERSION_CODE`` of this version."""
        if self.major <= 2 and self.minor <= 8:
            return self.major * 1000 + self.minor * 100 + self.patch
        return self.major * 10000 + self.minor * 100 + self.patch

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.major, self.minor, self.patch)

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"


@dataclass(frozen=True)
class Feature:
    """Something ep_nccl_gin offers that needs NCCL >= ``since`` (library and headers alike)."""

    key: str
    description: str
    since: NcclVersion


def _f(key: str, description: str, since: str) -> tuple[str, Feature]:
    return key, Feature(key, description, NcclVersion.parse(since))


FEATURES: dict[str, Feature] = dict(
    [
        _f("mem_alloc", "mem_alloc/mem_free (ncclMemAlloc)", "2.19.0"),
        _f("window", "window registration (ncclCommWindowRegister)", "2.27.0"),
        _f("device_api", "the device API (ncclDevCommCreate, LSA pointers and barriers)", "2.28.3"),
        _f("gin", "GIN, GPU-initiated networking (gin_contexts, gin_signal_count, ...)", "2.28.7"),
        _f("host_peer_pointer", "host peer pointer queries (ncclGetPeerDevicePointer)", "2.29.2"),
        _f("comm_properties", "communicator properties (ncclCommQueryProperties)", "2.29.2"),
        _f(
            "gin_connection_options",
            "gin_connection_type='rail', gin_exclusive_contexts and gin_queue_depth",
            "2.29.7",
        ),
        _f("gin_traffic_class", "gin_traffic_class (ncclDevCommRequirements.ginTrafficClass)", "2.30.3"),
        _f("runtime_version_devcomm", "header/library version independence (useRuntimeVersion)", "2.31.0"),
    ]
)

_INDEPENDENCE = FEATURES["runtime_version_devcomm"].since


def require(feature: str, runtime: NcclVersion, header: NcclVersion | None = None) -> None:
    """Raise :class:`NcclVersionError` unless the loaded library (and the headers compiled in) are new enough."""
    if feature not in FEATURES:
        raise ValueError(f"feature: expected one of {sorted(FEATURES)}, got {feature!r}")
    f = FEATURES[feature]
    if runtime < f.since:
        raise NcclVersionError(
            f"{f.description} needs NCCL >= {f.since}, but the loaded NCCL library is {runtime}. "
            f"Install nvidia-nccl-cu12/cu13 >= {f.since} (pip install 'ep-nccl-gin[cu13]' brings the newest)."
        )
    if header is not None and header < f.since:
        raise NcclVersionError(
            f"{f.description} needs NCCL headers >= {f.since}, but ep_nccl_gin was built against NCCL headers "
            f"{header} (the loaded library is {runtime}). Rebuild ep-nccl-gin against the installed "
            "nvidia-nccl wheel: pip install --no-build-isolation --force-reinstall ep-nccl-gin."
        )


def check_header_runtime(header: NcclVersion, runtime: NcclVersion, *, what: str) -> bool:
    """Enforce NCCL's rule between the headers code was compiled against and the library loaded.

    Before NCCL 2.31 the two must be the same version (the device structs change between releases). From 2.31
    on, a device communicator created with ``useRuntimeVersion`` works with older headers, so the headers may
    be older than the library but not newer. Returns True when ``useRuntimeVersion`` is needed (both >= 2.31
    and different), False when the versions are equal. ``what`` names the compiled code in the message.
    """
    if header == runtime:
        return False
    if header >= _INDEPENDENCE and runtime >= _INDEPENDENCE:
        if header > runtime:
            raise NcclVersionError(
                f"{what} was compiled against NCCL headers {header}, newer than the loaded NCCL library "
                f"{runtime}; a library only accepts device structs of its own version or older. Upgrade the "
                "nvidia-nccl wheel or rebuild against the library's own headers."
            )
        return True
    raise NcclVersionError(
        f"{what} was compiled against NCCL headers {header} but the loaded NCCL library is {runtime}; before "
        f"NCCL {_INDEPENDENCE.major}.{_INDEPENDENCE.minor} the two must be the same version. Rebuild against the "
        "loaded library's headers (pip install --no-build-isolation --force-reinstall ep-nccl-gin in the "
        f"environment whose nvidia-nccl wheel is {runtime}), or install NCCL {header}."
    )


_CODE_RE = re.compile(r"^\s*#\s*define\s+NCCL_VERSION_CODE\s+(\d+)\s*$", re.MULTILINE)


def parse_header_version(include_dir: str | Path) -> NcclVersion:
    """The version of the NCCL headers in ``include_dir`` (its ``nccl.h`` ``NCCL_VERSION_CODE``)."""
    header = Path(include_dir) / "nccl.h"
    try:
        text = header.read_text(errors="replace")
    except OSError as exc:
        raise FileNotFoundError(f"{header}: cannot read the NCCL header ({exc})") from exc
    m = _CODE_RE.search(text)
    if m is None:
        raise ValueError(f"{header}: no '#define NCCL_VERSION_CODE <n>' line; is this an NCCL nccl.h?")
    return NcclVersion.from_code(int(m.group(1)))
