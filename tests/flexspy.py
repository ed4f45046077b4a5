"""Spies shared by the FlexAttention tests (CPU and gpu): did torch's eager dense FlexAttention run, and
how many host-device synchronisations did a forward make (with the kernel stubbed)?"""
import importlib

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode

#: torch's FlexAttention module (the package exports a same-named HOP object, hence importlib)
flex_hop = importlib.import_module("torch._higher_order_ops.flex_attention")


def eager_dense_calls(monkeypatch) -> list:
    """A list that grows by one each time torch's eager FlexAttention computes dense [B, H, Lq, Lk]
    scores on real tensors (``math_attention``, which the eager forward and the dense backward call;
    compile-time tracing on fake tensors is not counted)."""
    calls = []
    for name in ("math_attention", "_math_attention_inner"):
        real = getattr(flex_hop, name)

        def spy(*a, _real=real, _name=name, **kw):
            if not is_fake(a[0]):
                calls.append(_name)
            return _real(*a, **kw)
        monkeypatch.setattr(flex_hop, name, spy)
    return calls


#: ops that read a device value back to the host, or copy host data into a (device) tensor
SYNC_OPS = {"_local_scalar_dense", "equal", "nonzero", "is_nonzero", "item", "lift_fresh", "lift_fresh_copy"}


class CountSyncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in SYNC_OPS:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def stub_kernel(q, k, v, score_mod=None, block_mask=None, scale=None):
    # touch what the compiled kernel would read, without running FlexAttention under the mode
    assert block_mask is not None and callable(score_mod)
    return torch.zeros_like(q)
