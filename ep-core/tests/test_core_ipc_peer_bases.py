"""`IpcStorage.peer_bases`: every rank's storage base as mapped in this process, from ep_symmem's peer pointers (no
GPU needed with a stand-in allocation), and an error once the storage is closed."""

from __future__ import annotations

import pytest
from ep_core.errors import EPConfigError
from ep_core.transports.ipc import IpcStorage


class _Alloc:
    def peer_ptr(self, r: int) -> int:
        return 0x1000_0000 * (r + 1)


class _Buffer:
    peer_table = 0

    def __init__(self) -> None:
        self.bases = [0x1000_0000]
        self._owners = [_Alloc()]

    def close(self) -> None:
        self._owners = []


def test_peer_bases_from_the_symmem_peer_pointers() -> None:
    st = IpcStorage(_Buffer(), 1 << 20, 0)
    assert st.peer_bases(3) == [0x1000_0000, 0x2000_0000, 0x3000_0000]
    st.close()
    with pytest.raises(EPConfigError, match="closed"):
        st.peer_bases(3)
