"""Test harnesses shipped for users who check ep on their own machines (``python -m ep_torch.testing.conformance``);
nothing in the library imports them."""
