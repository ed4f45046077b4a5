"""Typed run configuration: dataclasses, YAML presets, ``--set a.b=c`` overrides.

A run's resolved config is saved as ``config.yaml`` in its run directory; ``version`` lets a later
release refuse or migrate configs it does not understand.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, get_type_hints

import yaml

from .io import UserError
from .model.gpt import ModelConfig

#: the evaluation protocols of docs/protocols.md (E1-E5) by their config names (eval.protocols)
PROTOCOLS = ("nonoverlapping", "sliding", "last_token", "positionwise", "cached", "recomputed")


def eval_positions(cfg: "RunConfig") -> str:
    """The evaluation's positions: eval.positions, where "train" means the run's train.positions."""
    return cfg.train.positions if cfg.eval.positions == "train" else cfg.eval.positions


def check_protocols(protocols: Iterable[str]) -> list[str]:
    """The protocol names in order, duplicates dropped; an unknown one raises with the fix."""
    out = []
    for p in protocols:
        if p not in PROTOCOLS:
            close = difflib.get_close_matches(str(p), PROTOCOLS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UserError(f"unknown evaluation protocol {p!r}; {hint}choose from {', '.join(PROTOCOLS)}")
        if p not in out:
            out.append(p)
    return out

CONFIG_VERSION = 1


class ConfigError(ValueError):
    """Bad config key/value; the message is one line naming the fix."""


@dataclass
class DataConfig:
    corpus: str = "stdlib"  # stdlib | pydoc | linux[:tarball] | path:/some/dir_or_file | hf:name[:config]
    tokenizer: str = "bpe"  # bpe | bytes
    vocab_size: int = 4096
    cache_dir: str = ".extrapolab-cache"
    valid_percent: int = 5
    test_percent: int = 5
    max_bytes: int = 0  # 0 = whole corpus; else stop reading after this many bytes


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 16
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    pos_lr_scale: float = 1.0  # learning rate of a relative-bias scheme's parameters = lr x this
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    precision: str = "auto"  # auto | fp32 | bf16 | fp16
    seed: int = 0
    eval_every: int = 200
    eval_batches: int = 8
    checkpoint_every: int = 200
    log_every: int = 10
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: int = 0  # torch.set_num_threads; 0 = leave default
    #: torch.compile the model's forward: NoPE, the rotary family, xPos, the hybrid, head scale, learned APE, PoPE,
    #: FoX and the distance tables on CUDA's Toeplitz path (ALiBi, T5, KERPLE, Qin, windowed) trace into one graph
    #: (tests/test_compile_graph.py); FlexAttention's path (>= flex.MIN_LENGTH), Sandwich and FIRE still break it
    compile: bool = False
    #: the training forward's attention implementation (model/attention.py IMPLS): auto | flex | sdpa | blocked | plain.
    #: "flex" on CUDA trains learnable tables (T5, KERPLE, FIRE up to L) and FoX through FlexAttention with our
    #: gradient kernels (docs/attention.md) where `auto` takes the dense mask / folded path
    attention: str = "auto"
    flush_denormals: bool = True  # FTZ/DAZ for this process's training (model.attention.flush_denormals)
    strategy: str = "ddp"  # ddp | fsdp: how torchrun processes share the model (DDP replicates, FSDP shards)
    tensorboard: bool = False  # also write metrics as TensorBoard events to RUN/tensorboard (pip install -e '.[tb]')
    #: positions fed to the model: "contiguous" (0..L-1) or "random:L_MAX" (sorted, drawn without
    #: replacement from [0, L_MAX) per batch; Ruoss et al. 2023, train/positions.py)
    positions: str = "contiguous"


@dataclass
class EvalConfig:
    protocols: list[str] = field(default_factory=lambda: ["nonoverlapping", "last_token"])
    lengths: list[int] = field(default_factory=lambda: [128, 256, 512, 1024, 2048])
    num_tokens: int = 0  # 0 = whole test split (nonoverlapping / sliding)
    last_token_n: int = 64  # N segments for the last-token protocol
    sliding_stride: int = 0  # 0 = L_tr // 2
    position_length: int = 0  # 0 = max length
    position_segments: int = 48  # E4 segments averaged per position
    cache_window: int = 0  # E5 window; 0 = 2·L_tr
    #: E5 attention sinks (StreamingLLM): -1 off; k >= 0 keeps the first k tokens besides the window, keys
    #: cached before rotation and placed at their positions in the cache (docs/protocols.md)
    sinks: int = -1
    delta: float = 0.1  # E6 verdict threshold
    batch_size: int = 4
    temperature: float = 1.0
    split: str = "test"
    erf_length: int = 0  # sweeps: A1 ERF of predicting this token after evaluation (0 = off)
    erf_segments: int = 4  # segments averaged for that ERF
    trf_eps: float = 0.01  # sweeps: A2 TRF threshold on the trained scheme
    #: sweeps: A6 attention mass on the first token per layer at L_tr and at erf_length (with erf_length > 0)
    first_token: bool = False
    bca: bool = False  # E1-E4 with blockwise causal attention (xPos §3.3, eval/bca.py), any scheme
    bca_block: int = 0  # its block size; 0 = L_tr / 2 (the paper's)
    #: positions at evaluation: "train" (as train.positions: random runs are scored at random positions,
    #: as Ruoss et al.'s code does), "contiguous", or "random:L_MAX"
    positions: str = "train"
    #: the evaluation forward's attention implementation (model/attention.py IMPLS, docs/attention.md "Which path
    #: runs when"): auto | flex | sdpa | blocked | plain | folded | nearfar. "blocked" scores every length on the fused
    #: kernels with each query block's own mask (no FlexAttention compile per scheme and length, no L x L tensor)
    attention: str = "auto"


@dataclass
class RunConfig:
    name: str = "run"
    out_dir: str = "runs"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    version: int = CONFIG_VERSION

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---- building from dicts, presets and overrides ----------------------------------------------
def _coerce(value: Any, typ: Any, where: str) -> Any:
    origin = getattr(typ, "__origin__", None)
    if dataclasses.is_dataclass(typ):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        return from_dict(typ, value, where)
    if typ is bool:
        if isinstance(value, str):
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{where} must be true/false, got {value!r}")
        return bool(value)
    if typ in (int, float, str):
        try:
            if typ is int and isinstance(value, float) and not value.is_integer():
                raise ValueError
            return typ(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be {typ.__name__}, got {value!r}") from None
    if origin in (list, tuple):
        if isinstance(value, str):
            value = yaml.safe_load(value if value.startswith("[") else f"[{value}]")
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        (inner, *_) = typ.__args__
        out = [_coerce(v, inner, where) for v in value]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if isinstance(value, str):
            value = yaml.safe_load(value)
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        inner = typ.__args__[1] if len(getattr(typ, "__args__", ())) == 2 else None
        if inner is not None and dataclasses.is_dataclass(inner):  # e.g. model.types: {name: LayerType}
            return {str(k): v if isinstance(v, inner) else _coerce(v or {}, inner, f"{where}.{k}")
                    for k, v in value.items()}
        return dict(value)
    if getattr(typ, "__args__", None) and type(None) in typ.__args__:  # Optional[X]
        if value is None or value == "null":
            return None
        return _coerce(value, next(a for a in typ.__args__ if a is not type(None)), where)
    return value


def from_dict(cls, data: dict, where: str = "config"):
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in (data or {}).items():
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"did you mean {where}.{close[0]}? " if close else ""
            raise ConfigError(f"unknown config key {where}.{key}; {hint}valid: {', '.join(names)}")
        kwargs[key] = _coerce(value, hints[key], f"{where}.{key}")
    return cls(**kwargs)


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("extrapolab.presets").iterdir() if p.name.endswith(".yaml"))


def load_preset(name_or_path: str) -> dict:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError(f"config file {path} not found; check the path")
        text = path.read_text()
    else:
        res = resources.files("extrapolab.presets") / f"{name_or_path}.yaml"
        if not res.is_file():
            raise ConfigError(f"unknown preset {name_or_path!r}; valid presets: {', '.join(preset_names())}")
        text = res.read_text()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config {name_or_path} is not valid YAML ({str(e).splitlines()[0]}); fix the file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {name_or_path} must be a YAML mapping of sections (model:, data:, train:, "
                          f"eval:), not a {type(data).__name__}; see `extrapolab/presets/default.yaml`")
    return data


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """``["train.steps=10", "model.scheme=alibi"]`` -> nested dict updates (values parsed as YAML)."""
    data = dict(data)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like a.b=c, e.g. --set train.steps=100")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw != "" else ""
        node = data
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node[p] = dict(node.get(p) or {})
            node = node[p]
        node[parts[-1]] = value
    return data


def load_study_preset(name_or_path: str, overrides: list[str] | None, section: str, spec_cls):
    """(RunConfig, spec) of a study preset: the YAML's ``section`` is the study's dataclass, the rest
    a run config; ``--set`` overrides apply to both."""
    raw = apply_overrides(load_preset(name_or_path), overrides or [])
    spec = from_dict(spec_cls, raw.pop(section, None) or {}, section)
    return resolve(base=raw), spec


def check_version(data: dict, where: str = "config") -> None:
    v = data.get("version", CONFIG_VERSION)
    if v != CONFIG_VERSION:
        newer = isinstance(v, int) and v > CONFIG_VERSION
        raise ConfigError(
            f"{where} has version {v}, this extrapolab reads version {CONFIG_VERSION}; "
            + ("upgrade extrapolab (pip install -U extrapolab)" if newer else "re-create the run with this version")
        )


def resolve(preset: str | None = None, overrides: list[str] | None = None, base: dict | None = None) -> RunConfig:
    data = dict(base or {})
    if preset:
        data = _deep_merge(data, load_preset(preset))
    data = apply_overrides(data, overrides or [])
    check_version(data)
    data.pop("sweep", None)
    cfg = from_dict(RunConfig, data)
    regular_scheme(cfg, overrides)
    validate(cfg)
    return cfg


def regular_scheme(cfg: RunConfig, overrides: list[str] | None = None) -> None:
    """model.arch=regulargpt attends with eq. 6.1 itself: its scheme is sliding-dilated. A preset's
    scheme is replaced; an explicit ``--set model.scheme=OTHER`` is refused (one line)."""
    m = cfg.model
    if m.arch != "regulargpt" or m.scheme == "sliding-dilated":
        return
    if any(str(o).split("=", 1)[0].strip() == "model.scheme" for o in overrides or []):
        raise ConfigError(f"model.arch=regulargpt uses its own sliding-dilated attention (thesis eq. 6.1), "
                          f"not model.scheme={m.scheme}; drop that override or use model.arch=gpt")
    m.scheme, m.scheme_params = "sliding-dilated", {}


def validate(cfg: RunConfig) -> None:
    """Cheap checks before any data is prepared or a model trained (one-line errors)."""
    from .model.attn_extras import check_qk_eps, qk_form
    from .model.gpt import build_scheme
    from .model.regular_lm import check_attention_options, check_depth

    m = cfg.model
    for name in ("layers", "heads", "dim", "train_length", "vocab_size"):
        if getattr(m, name) < 1:
            raise ConfigError(f"model.{name} must be >= 1, got {getattr(m, name)}")
    if m.dim % m.heads:
        raise ConfigError(f"model.dim={m.dim} must be divisible by model.heads={m.heads}")
    if m.arch not in ("gpt", "regulargpt"):
        raise ConfigError(f"model.arch must be gpt or regulargpt, got {m.arch!r}")
    if m.arch == "regulargpt" and (m.C < 2 or m.K < 1):
        raise ConfigError(f"RegularGPT needs model.C >= 2 and model.K >= 1, got C={m.C}, K={m.K}; "
                          "e.g. --set model.C=8 --set model.K=1")
    try:
        check_depth(m.depth)
        qk_form(m.qk_norm)
        check_qk_eps(m.qk_norm_eps)
        check_attention_options(m)
    except UserError as e:
        raise ConfigError(str(e)) from None
    for name in ("steps", "batch_size", "grad_accum"):
        if getattr(cfg.train, name) < 1:
            raise ConfigError(f"train.{name} must be >= 1, got {getattr(cfg.train, name)}")
    from .model.attention import IMPLS
    trains = [i for i in IMPLS if i != "nearfar"]  # the near-far path runs forward only
    for key, impl, allowed in (("train.attention", cfg.train.attention, trains),
                               ("eval.attention", cfg.eval.attention, IMPLS)):
        if impl not in allowed:
            raise ConfigError(f"{key} must be one of {', '.join(allowed)}, got {impl!r}")
    if any(L < 1 for L in cfg.eval.lengths):
        raise ConfigError(f"eval.lengths must be positive, got {cfg.eval.lengths}")
    if cfg.eval.erf_length < 0 or cfg.eval.erf_segments < 1 or not 0 < cfg.eval.trf_eps < 1:
        raise ConfigError("eval.erf_length must be >= 0 (0 = off), eval.erf_segments >= 1 and eval.trf_eps in (0, 1); "
                          f"got {cfg.eval.erf_length}, {cfg.eval.erf_segments}, {cfg.eval.trf_eps}")
    if cfg.eval.bca_block < 0:
        raise ConfigError(f"eval.bca_block must be >= 0 (0 = L_tr / 2), got {cfg.eval.bca_block}")
    if cfg.eval.split not in ("train", "valid", "test"):
        raise ConfigError(f"eval.split must be train, valid or test, got {cfg.eval.split!r}")
    try:  # a typo here would otherwise surface only after training
        check_protocols(cfg.eval.protocols)
    except UserError as e:
        raise ConfigError(f"eval.protocols: {e}") from None
    scheme = build_scheme(m)  # unknown scheme / bad options fail here, before any data or training work
    _check_positions(cfg, scheme)


def _check_positions(cfg: RunConfig, scheme) -> None:
    """train.positions / eval.positions (positional/randomized.py): the form, L_MAX >= L_tr, a scheme
    that encodes positions up to L_MAX - 1, the plain GPT (RegularGPT attends by chunks of tokens)."""
    from .positional import randomized
    from .positional.base import SchemeError

    try:
        L_max = randomized.parse(cfg.train.positions)
        if cfg.eval.positions != "train":
            randomized.parse(cfg.eval.positions, "eval.positions")
        if L_max is not None and cfg.model.arch != "gpt":
            raise SchemeError(f"train.positions={cfg.train.positions} needs model.arch=gpt")
        if L_max is not None:
            randomized.check(L_max, scheme, cfg.model.train_length)
    except SchemeError as e:
        raise ConfigError(str(e)) from None


def _deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def save(cfg: RunConfig, path: str | Path) -> None:
    from .io import atomic_write_text

    atomic_write_text(Path(path), yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def load(path: str | Path) -> RunConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no config at {path}; is this a run directory made by `extrapolab train`?")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        raise ConfigError(f"{path} is not valid YAML; the run directory is damaged, re-run training") from None
    check_version(data, str(path))
    return from_dict(RunConfig, data)
