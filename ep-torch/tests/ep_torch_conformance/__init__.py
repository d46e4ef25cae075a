"""ep-torch's conformance harness (``conformance``: the torch API against ``ep_core.reference`` on any backend):
test code, not shipped in the wheel. The tests load it through ``conftest.py``; from a checkout, run it in this
folder's parent as ``python -m ep_torch_conformance.conformance``."""
