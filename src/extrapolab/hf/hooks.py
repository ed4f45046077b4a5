"""Forward-hook mechanics shared by the Hugging Face temperature adapters (thesis ch. 5, §5.4,
Algorithm 1): causal LMs here (:mod:`.temperature`) and T5 in ``align/hf_t5.py``.

Both put a softmax temperature into a model we do not own by hooking its attention modules for
the duration of a ``with`` block, and both expose Algorithm 1's target by reading each layer's
attention probabilities p off the module's output. What differs per family (which modules, which
factor tau divides, where p sits in the output) is left to the adapter; what is the same lives
here:

* :func:`hook_handles` collects hook handles and removes them when the block ends, however it ends;
* :func:`divide_kwarg` divides a tensor keyword argument of a module call by tau (the shared
  ``position_bias`` of MPT and T5, so each layer gets its own tau without touching the tensor);
* :class:`ProbsTarget` is the alignment target (``align.temperature.as_target``): ``scope(tau,
  sink)`` runs the adapter's temperature and hands the sink tau·log p per layer. log p = l/tau -
  logsumexp, so tau·log p is l up to a per-row constant, which softmax re-temperatures exactly as l;
  probabilities that underflow to 0 (masked or padding keys) count as masked keys.

The per-layer tau list comes from ``model.attention.layer_temperatures``, as for our GPT.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from ..io import UserError
from ..model.attention import layer_temperatures


@contextmanager
def hook_handles() -> Iterator[list]:
    """A list to append hook handles to; each is removed when the block ends (in any case)."""
    handles: list = []
    try:
        yield handles
    finally:
        for h in handles:
            h.remove()


def divide_kwarg(module: torch.nn.Module, name: str, tau: float):
    """Pre-hook: the keyword argument ``name`` (when given, not None) reaches ``module`` divided by tau."""
    def pre(mod, args, kwargs):
        x = kwargs.get(name)
        if x is not None:
            kwargs = {**kwargs, name: x / tau}  # a new tensor: the caller's shared one is unchanged
        return args, kwargs
    return module.register_forward_pre_hook(pre, with_kwargs=True)


class ProbsTarget:
    """Algorithm 1 target over a Hugging Face model whose attention returns its probabilities.

    A subclass sets ``model`` and ``num_layers`` and gives :meth:`modules` (the attention modules
    in layer order), :meth:`probs` (p [B, H, Lq, Lk] from a module's output, or None),
    :meth:`temperature` (its per-layer temperature scope) and ``no_probs`` (the one-line fix when
    the attention returned no probabilities), plus ``forward``; ``what`` names its layers in errors.
    """

    model: torch.nn.Module
    num_layers: int
    no_probs: str
    what = ""  # default: "a {n}-layer model"

    def modules(self) -> list:
        raise NotImplementedError

    def probs(self, output) -> torch.Tensor | None:
        raise NotImplementedError

    def temperature(self, taus: list[float]):
        raise NotImplementedError

    @contextmanager
    def scope(self, tau=1.0, sink=None):
        """Within the block every layer runs at its tau; with a ``sink``, layer i's tau·log p goes
        to ``sink.add(i, ...)`` on every forward."""
        taus = layer_temperatures(tau, self.num_layers, self.what)
        with hook_handles() as handles:
            if sink is not None:
                for i, attn in enumerate(self.modules()):
                    def grab(m, a, out, i=i):
                        w = self.probs(out)  # [B, H, Lq, Lk] probabilities at this layer's tau
                        if w is None:
                            raise UserError(self.no_probs)
                        sink.add(i, taus[i] * torch.log(w.float()))
                    handles.append(attn.register_forward_hook(grab))
            with self.temperature(taus):
                yield self
