"""What a sweep runs: the ``sweep:`` section of a preset (schemes x seeds x datasets, the reference of
the t-tests, pretrained ``models:``), each scheme entry's run config, and the run ids.

A scheme entry either trains a run or, with ``from: LABEL``, derives one from the run of an earlier
entry of the same dataset and seed (sweep/derived.py): it evaluates that run with its own ``eval:``
overrides (e.g. xPos with blockwise causal attention, ``eval: {bca: true}``) or first applies a step to
it (``head_scale: {length: L}``: the NoPE head scale of Wang et al. 2024 tuned at L, align/head_scale_run.py).
A derived entry names its own label (the report keys claims and tables on labels).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

from .. import config as C
from ..executor.spec import EngineSpec
from ..io import UserError

#: the steps a derived entry may apply to its source run, and the scheme the result has (None: the step's
#: own ``scheme``: ``rope: {scheme: rotary-yarn, params: {factor: 16}}`` re-reads a RoPE run's weights with
#: another RoPE kind, training-free, as the kinds extend a trained model)
STEPS = {"head_scale": "nope-headscale", "rope": None}


@dataclass
class SchemeSpec:
    name: str
    params: dict = field(default_factory=dict)
    label: str = ""
    model: dict = field(default_factory=dict)  # model.* overrides of this entry, e.g. {arch: regulargpt, C: 8}
    train: dict = field(default_factory=dict)  # train.* overrides of this entry, e.g. {positions: random:2048}
    eval: dict = field(default_factory=dict)  # eval.* overrides of this entry, e.g. {bca: true}
    source: str = ""  # `from:` the label of the entry whose trained run this one derives from ("" = trains)
    step: dict = field(default_factory=dict)  # {step name: options} applied to the source run (STEPS)

    def __post_init__(self):
        if not self.label:
            extra = ",".join(f"{k}={v}" for k, v in {**self.params, **self.model, **self.train, **self.eval}.items())
            self.label = f"{self.name}({extra})" if extra else self.name

    @property
    def derived(self) -> bool:
        return bool(self.source)


@dataclass
class ModelSpec:
    """A pretrained model listed next to the trained runs (``models:`` in the sweep section)."""

    source: str  # hf:PATH
    label: str = ""
    rope: str | None = None
    train_length: int | None = None

    @classmethod
    def parse(cls, entry) -> "ModelSpec":
        d = {"source": entry} if isinstance(entry, str) else dict(entry or {})
        src = str(d.get("source") or d.get("path") or "")
        if not src.startswith("hf:"):
            raise UserError(f"sweep model entry {entry!r} must be hf:PATH or {{source: hf:PATH, label: ..., "
                            "rope: yarn:4, train_length: ...}}")
        label = str(d.get("label") or "hf:" + Path(src[3:]).name + (f"+{d['rope']}" if d.get("rope") else ""))
        return cls(src, label, d.get("rope"), d.get("train_length"))


ENTRY_KEYS = ("name", "params", "label", "model", "train", "eval", "from", *STEPS)


def parse_entry(s, earlier: dict[str, SchemeSpec]) -> SchemeSpec:
    """One ``schemes:`` entry: a name, or {name, params, label, model, train, eval} or a derived
    {from, label, eval, head_scale} (``earlier``: the entries before it by label)."""
    if isinstance(s, str):
        return SchemeSpec(s)
    if not isinstance(s, dict) or not ("name" in s or "from" in s) or set(s) - set(ENTRY_KEYS):
        raise UserError(f"sweep scheme entry {s!r} must be a name or {{name: ..., params: {{...}}, model: {{...}}, "
                        "train: {...}, eval: {...}}, or {from: LABEL, label: ..., eval: {...}, head_scale: {...} | rope: {...}}")
    steps = {k: dict(s[k] or {}) for k in STEPS if k in s}
    src = str(s.get("from") or "")
    name = s.get("name")
    if src or steps:
        parent = earlier.get(src)
        if parent is None or parent.derived:
            raise UserError(f"sweep scheme entry {s!r}: from: must name the label of an earlier entry that trains "
                            f"(one of: {', '.join(k for k, v in earlier.items() if not v.derived) or 'none yet'})")
        if not s.get("label") or len(steps) > 1 or {"params", "model", "train"} & set(s):
            raise UserError(f"sweep scheme entry {s!r}: a from: entry needs its own label, at most one step "
                            f"({', '.join(STEPS)}) and no params/model/train of its own (they are its source's)")
        want = STEPS[next(iter(steps))] if steps else parent.name
        params = dict(parent.params)
        if "rope" in steps:
            want, params = rope_step(steps["rope"], parent, s)
        if "head_scale" in steps and parent.name != "none":
            raise UserError(f"sweep scheme entry {s['label']!r}: head_scale needs a NoPE source (name: none), "
                            f"got {parent.name!r}")
        if name not in (None, want):
            raise UserError(f"sweep scheme entry {s['label']!r}: name must be {want!r} (its model's scheme) or left out")
        return SchemeSpec(want, params, str(s["label"]), dict(parent.model), dict(parent.train),
                          dict(s.get("eval") or {}), src, steps)
    spec = SchemeSpec(name, dict(s.get("params") or {}), s.get("label", ""), dict(s.get("model") or {}),
                      dict(s.get("train") or {}), dict(s.get("eval") or {}))
    if "seed" in spec.train:
        raise UserError(f"sweep scheme entry {name!r} sets train.seed; the seeds come from sweep.seeds")
    return spec


def rope_step(step: dict, parent: SchemeSpec, entry) -> tuple[str, dict]:
    """(scheme, params) of a ``rope:`` step: a RoPE kind read over a RoPE run's weights (no parameters of
    its own, so the source's checkpoint loads into it as it is)."""
    from ..positional import REGISTRY

    name, params = step.get("scheme"), dict(step.get("params") or {})
    cls, src = REGISTRY.get(str(name)), REGISTRY.get(parent.name)
    if cls is None or cls.kind != "rotary" or src is None or src.kind != "rotary" or parent.model.get("layout") \
            or set(step) - {"scheme", "params"}:
        raise UserError(f"sweep scheme entry {entry!r}: rope: {{scheme: KIND, params: {{...}}}} re-reads a RoPE run "
                        f"with another registered rotary kind (e.g. rotary-yarn); source {parent.label!r} is "
                        f"{parent.name!r}")
    return str(name), params


@dataclass
class SweepSpec:
    schemes: list[SchemeSpec]
    seeds: list[int]
    datasets: list[str]
    reference: str
    budget: str = ""
    cost_rounds: int = 7  # paired rounds of the cost bench pass after training
    models: list[ModelSpec] = field(default_factory=list)  # hf: models evaluated next to the runs
    #: start no run that would end past this many seconds of the invocation (0: no limit); the same
    #: command resumes the rest, so a sweep fits jobs of a short GPU slot
    time_budget_s: float = 0.0
    #: how the runs are executed: engine (local | ray), address, workers (CPU runs in parallel processes),
    #: devices, runs_per_device, procs_per_run, max_retries (executor/spec.py, docs/scale-out.md)
    engine: EngineSpec = field(default_factory=EngineSpec)

    @classmethod
    def from_dict(cls, d: dict) -> "SweepSpec":
        if not isinstance(d, dict) or not d.get("schemes"):
            raise UserError("sweep config needs a `sweep:` section with a non-empty `schemes:` list")
        by_label: dict[str, SchemeSpec] = {}
        for s in d["schemes"]:
            spec = parse_entry(s, by_label)
            if spec.label in by_label:
                raise UserError(f"sweep scheme label {spec.label!r} appears twice; give one entry another label")
            by_label[spec.label] = spec
        schemes = list(by_label.values())
        labels = [s.label for s in schemes]
        ref = str(d.get("reference") or labels[0])
        if ref not in labels:
            raise UserError(f"sweep reference {ref!r} is not one of the swept schemes: {', '.join(labels)}")
        seeds = [int(x) for x in d.get("seeds", [0])]
        datasets = [str(x) for x in d.get("datasets", ["stdlib"])]
        engine = EngineSpec.from_dict(d, "sweep")
        rounds = int(d.get("cost_rounds", 7))
        if rounds < 1:
            raise UserError(f"sweep.cost_rounds must be >= 1, got {rounds}")
        models = [ModelSpec.parse(m) for m in d.get("models") or []]
        budget_s = float(d.get("time_budget_s") or 0)
        if budget_s < 0:
            raise UserError(f"sweep.time_budget_s={budget_s:g} must be >= 0 (0: no limit)")
        return cls(schemes, seeds, datasets, ref, str(d.get("budget", "")), rounds, models, budget_s, engine)

    def entry(self, label: str) -> SchemeSpec:
        return next(s for s in self.schemes if s.label == label)


def load_sweep(name_or_path: str, overrides: list[str] | None = None) -> tuple[C.RunConfig, SweepSpec]:
    raw = C.apply_overrides(C.load_preset(name_or_path), overrides or [])
    spec = SweepSpec.from_dict(raw.get("sweep") or {})
    base = C.resolve(base=raw)
    from ..positional import build

    for s in spec.schemes:  # fail fast on unknown schemes/options, before any training
        cfg = entry_config(base, s)  # an entry's model.* overrides (RegularGPT C, K) are checked too
        if "head_scale" in s.step:
            from .derived import head_scale_spec

            try:
                head_scale_spec(s.step["head_scale"], cfg)
            except (UserError, C.ConfigError) as e:
                raise UserError(f"sweep entry {s.label!r}: {e}") from None
        params = dict(s.params)
        if s.name == "learned":
            params.setdefault("max_length", base.model.train_length)
        if not s.derived:
            build(s.name, num_heads=base.model.heads, **params)
    return base, spec


def entry_config(base: C.RunConfig, scheme: SchemeSpec) -> C.RunConfig:
    """``base`` with this entry's scheme, model, train and eval overrides, validated (a copy). A
    derived entry's model and training are its source's; the scheme is the derived model's."""
    cfg = copy.deepcopy(base)
    cfg.model.scheme, cfg.model.scheme_params = scheme.name, dict(scheme.params)
    model = C.from_dict(type(cfg.model), {**cfg.model.to_dict(), **scheme.model}, "sweep scheme model")
    cfg.model = model
    cfg.train = C.from_dict(type(cfg.train), {**cfg.to_dict()["train"], **scheme.train}, "sweep scheme train")
    cfg.eval = C.from_dict(type(cfg.eval), {**cfg.to_dict()["eval"], **scheme.eval}, "sweep scheme eval")
    C.regular_scheme(cfg, [f"model.scheme={scheme.name}"])  # the entry names its scheme explicitly
    C.validate(cfg)
    return cfg


def run_id(dataset: str, scheme: SchemeSpec, seed: int) -> str:
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in scheme.label)
    return f"{dataset}--{safe}--s{seed}"
