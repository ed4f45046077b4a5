"""What every bench row group shares (perf/bench.py): the benched schemes (:class:`Spec`), the run's
settings (:class:`Context`) and the one way a row builds its model."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch

from .. import positional
from ..io import UserError
from ..model.attention import IMPLS, AttnOptions
from ..model.gpt import GPT, ModelConfig
from ..model.sdpa import preferring_cudnn
from ..positional import turn
from ..train.step import autocast
from .timing import provenance

BASE = "none"


@dataclass(frozen=True)
class Spec:
    """One benched scheme: a row label, the registered name and its options; ``positions`` > 0 trains at
    sorted random positions from [0, positions) drawn each step (Ruoss et al. 2023; train rows only); ``impl``
    the attention implementation its calls ask for (AttnOptions.impl: "auto", or e.g. "sdpa" to time another
    path of the same scheme beside it, written ``name@impl``); ``model``: other ModelConfig fields of the row:
    attention options (e.g. ``{"sinks": True}``: docs/attention.md, "Model options") or layer types (a sweep
    entry's ``{layout: gemma3}``: positional/layout.py); ``compile``: the model's forward through torch.compile, as
    ``train.compile`` trains it (written ``name+compile``); ``eager``: rotations by the eager formula instead of the
    fused kernel (written ``name+eager``; positional/turn.py), the A/B of that kernel's cost on a GPU; ``cudnn``: SDPA's
    cuDNN backend first in line for the row's unmasked calls (written ``name+cudnn``; model/sdpa.py), beside the
    flash kernel SDPA picks by default; ``table``: the paths as before the exact routes (written ``name+table``;
    ``AttnOptions.exact_routes`` off: the distance table gathered in FlexAttention for T5, KERPLE and Qin, FIRE's MLP
    at every score), beside the routes `auto` now takes (docs/attention.md). The options wrap the row's model calls
    (its train step and forwards), not the attention-only column, which calls attention directly; ``table`` is an
    attention option of the row, so it holds in that column too."""
    label: str
    name: str
    params: dict = field(default_factory=dict)
    positions: int = 0
    impl: str = "auto"
    model: dict = field(default_factory=dict)
    compile: bool = False
    eager: bool = False
    cudnn: bool = False
    table: bool = False


#: row options written after the scheme (and its @impl): ``+compile``, ``+eager``, ``+cudnn``, ``+table``, any of
#: them together
ROW_OPTIONS = ("compile", "eager", "cudnn", "table")


def _spec(text: str) -> Spec:
    """"t5", "t5@sdpa" (the scheme on that attention implementation), "rotary+compile" (its forward through
    torch.compile), "rotary+eager" (its rotations without the fused kernel), "alibi+cudnn" (SDPA's cuDNN backend
    first), "t5+table" (the paths before the exact routes) or "t5@flex+compile" -> Spec."""
    base, *options = text.split("+")
    bad = [o for o in options if o not in ROW_OPTIONS]
    if bad or len(set(options)) < len(options):
        raise UserError(f"unknown or repeated row option {'+'.join(bad or options)!r} in {text!r}; write "
                        f"SCHEME[@IMPL][+OPTION...] with OPTION one of {', '.join(ROW_OPTIONS)}")
    name, _, impl = base.partition("@")
    if impl and impl not in IMPLS:
        raise UserError(f"unknown attention impl {impl!r} in {text!r}; write SCHEME@IMPL with IMPL one of {', '.join(IMPLS)}")
    return Spec(text, name, impl=impl or "auto", compile="compile" in options, eager="eager" in options,
                cudnn="cudnn" in options, table="table" in options)


def as_specs(schemes) -> list[Spec]:
    """Names (``name`` or ``name@impl``), Specs or (label, name, params) -> Specs, NoPE first (added when missing)."""
    out = []
    for s in schemes:
        out.append(s if isinstance(s, Spec) else _spec(s) if isinstance(s, str) else Spec(*s))
    bad = [s.name for s in out if s.name not in positional.names()]
    if bad:
        raise UserError(f"unknown scheme(s) {', '.join(bad)}; run `extrapolab schemes` for valid names")
    fixed = {"scheme", "scheme_params", "vocab_size", "layers", "heads", "dim", "train_length"}
    odd = sorted({k for s in out for k in s.model if k not in ModelConfig.__dataclass_fields__ or k in fixed})
    if odd:
        raise UserError(f"bench model option(s) {', '.join(odd)} are not model options a row may set; use e.g. "
                        "sinks, ssmax, qk_norm or gate")
    return [Spec(BASE, BASE)] + [s for s in out if s.label != BASE]


@dataclass
class Context:
    specs: list[Spec]
    cfg: ModelConfig
    device: torch.device
    rounds: int
    warmup: int
    say: Callable[[str], None]
    opts: dict  # group options: lengths_train, batch_tokens, batch, parts, long_lengths, ...
    precision: str = "fp32"  # fp32 | bf16 | fp16: autocast around every timed call, as training runs

    def natural(self) -> list[Spec]:
        """The specs at positions 0..L-1 (the rows of every group but the train steps)."""
        return [s for s in self.specs if not s.positions]

    def amp(self, fn: Callable[[], object]) -> Callable[[], object]:
        """``fn`` run under this bench's autocast (fp32: unchanged)."""
        if self.precision == "fp32":
            return fn

        def run():
            with autocast(self.precision, self.device):
                return fn()
        return run

    def prov(self, **sizes) -> dict:
        """:func:`.timing.provenance` of a row: device, threads, precision and the model's sizes."""
        return provenance(self.device, precision=self.precision, model=asdict(replace(self.cfg, scheme="")), **sizes)


def build_model(ctx: Context, spec: Spec, seed: int = 0) -> GPT:
    """The benched model of ``spec`` (seeded, on the bench's device)."""
    torch.manual_seed(seed)
    model = GPT(replace(ctx.cfg, scheme=spec.name, scheme_params=dict(spec.params), **spec.model)).to(ctx.device)
    model.attn_opts = AttnOptions(impl=spec.impl, exact_routes=not spec.table)
    if spec.eager:  # the rotations by the eager formula during this model's calls (forward, and so backward)
        model.forward = turn.without_kernel(model.forward)
    if spec.cudnn:
        model.forward = preferring_cudnn(model.forward)
    if spec.compile:  # as the trainer does with train.compile (train/loop.py)
        model.forward = torch.compile(model.forward)
    return model
