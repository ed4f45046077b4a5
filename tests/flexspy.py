"""Spies shared by the FlexAttention tests (CPU and gpu): did torch's eager dense FlexAttention run?"""
import importlib

from torch._subclasses.fake_tensor import is_fake

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
