"""Spies shared by the FlexAttention tests (CPU and gpu): did torch's eager dense FlexAttention run, and
how many host-device synchronisations did a forward make (with the kernel stubbed)?"""
import importlib
from types import SimpleNamespace

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
        elif name in BOOL_INDEX_OPS and _bool_index(args):  # x[mask]: the kernel runs nonzero() inside, unseen
            self.calls.append(name + "(bool mask)")
        return func(*args, **(kwargs or {}))


class count_ops(TorchDispatchMode):
    """Operators dispatched inside the block, by name (a Counter; views included): on a GPU each one that computes
    is a kernel launch, so this counts what an eager step costs the host."""

    def __enter__(self):
        from collections import Counter
        self.counts = Counter()
        super().__enter__()
        return self.counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func._schema.name.split("::")[-1]] += 1
        return func(*args, **(kwargs or {}))


#: ops whose boolean-mask index is expanded by a nonzero() inside the kernel (a sync no dispatch mode sees)
BOOL_INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}


def _bool_index(args) -> bool:
    idx = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in idx)


def launch_spy(monkeypatch, module) -> list:
    """A list that grows by one each time ``module._launch`` (a gradient kernel of model/table_grad.py or
    model/flex_content.py) runs: the Triton kernel, not its PyTorch form, answered."""
    launched, real = [], module._launch
    monkeypatch.setattr(module, "_launch", lambda *a: launched.append(1) or real(*a))
    return launched


def stub_kernel(q, k, v, score_mod=None, block_mask=None, scale=None, gather=True, heavy=False, return_aux=None,
                return_lse=False):
    # touch what the compiled kernel would read, without running FlexAttention under the mode
    assert block_mask is not None and callable(score_mod)
    out = torch.zeros_like(q)
    if return_aux is not None or return_lse:  # a learnable table's route asks for the log-sum-exp
        lse = torch.zeros(q.shape[:3], device=q.device)
        return (out, lse) if return_lse else (out, SimpleNamespace(lse=lse))
    return out


def gathers_per_tensor(score_mod, n_args: int = 5) -> dict[int, int]:
    """How many times ``score_mod(score, b, h, q_idx, kv_idx)`` indexes each captured tensor that requires a
    gradient, traced as FlexAttention traces it (``TransformGetItemToIndex``: every ``t[...]`` becomes one
    ``mod_index``). FlexAttention's compiled backward allows one per tensor (inductor's validate_joint_graph)."""
    twh = importlib.import_module("torch._dynamo._trace_wrapped_higher_order_op")
    counts: dict[int, int] = {}
    real = twh.mod_index

    def spy(x, indices):
        if x.requires_grad:
            counts[id(x)] = counts.get(id(x), 0) + 1
        return real(x, indices)

    twh.mod_index = spy
    try:
        with twh.TransformGetItemToIndex():
            idx = [torch.zeros((), dtype=torch.int32) + i for i in (0, 1, 3, 2)]  # b, h, q_idx, kv_idx
            score_mod(torch.zeros(()), *idx) if n_args == 5 else score_mod(*idx[1:])
    finally:
        twh.mod_index = real
    return counts


def grad_mismatches(got: dict, want: dict, rtol: float, dtype, low: dict | None = None) -> list:
    """Names whose gradient differs from the reference by more than ``rtol`` of its norm (with ``low``: more
    than twice the low-precision plain path's own error, plus ``rtol`` of its norm), above an absolute floor of
    one rounding unit of ``dtype`` times the whole reference gradient's norm. A parameter whose exact gradient
    is ~0 (a per-head constant that softmax cancels, e.g. FIRE's output bias b2, ~1e-10) or tiny next to the
    rest (KERPLE gauss r2, ~1e-5) carries rounding noise of the whole computation, which a relative error
    of two near-zero vectors turns into O(1); the relative bound itself stays as tight as before."""
    total = torch.cat([w.flatten() for w in want.values()]).norm().item()
    floor = torch.finfo(dtype).eps * total
    bad = []
    for n, w in want.items():
        err = (got[n] - w).norm().item()
        bound = rtol * w.norm().item() + floor + (2 * (low[n] - w).norm().item() if low is not None else 0.0)
        if err > bound:
            bad.append((n, err, bound))
    return bad
