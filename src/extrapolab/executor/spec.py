"""How a job of many independent runs is executed: the engine settings shared by ``sweep:`` (``sweep.engine``,
``sweep.devices``, ...) and the flags of ``regular table`` (docs/scale-out.md).

``local`` (the default) runs on this machine: CPU runs in ``workers`` processes, GPU runs one per device of
``devices`` (``auto``: every visible GPU), ``runs_per_device`` packed onto each. ``ray`` runs each run as a
Ray task on a cluster (``address``: ``auto`` = the cluster this machine is part of, ``HOST:PORT``, or empty:
a one-machine Ray started for this job), retried ``max_retries`` times when its worker or node dies.
``procs_per_run`` > 1 trains each run as that many processes (torchrun, DDP/FSDP) in one placement.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..io import UserError

ENGINES = ("local", "ray")
#: the keys of a ``sweep:`` section that set the engine (SweepSpec passes these through)
KEYS = ("engine", "address", "workers", "devices", "runs_per_device", "procs_per_run", "max_retries")


def parse_devices(value, what: str = "sweep.devices") -> str | list[int]:
    """``auto``, a list of GPU ids, or the same as text ("0,2,3" / "[0, 2, 3]") -> "auto" or [ids]."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto")):
        return "auto"
    items = value.strip().strip("[]").split(",") if isinstance(value, str) else value
    try:
        ids = [int(str(x).strip()) for x in (items if isinstance(items, (list, tuple)) else [items])
               if str(x).strip()]
    except ValueError:
        ids = []
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        raise UserError(f"{what}={value!r} must be auto or distinct GPU ids like [0, 2, 3] (as nvidia-smi numbers them)")
    return ids


@dataclass
class EngineSpec:
    engine: str = "local"
    address: str = ""  # ray: "" (a Ray of this machine only), "auto", or HOST:PORT
    workers: int = 1  # local CPU runs: processes at once (torch threads split between them)
    devices: str | list[int] = "auto"  # local GPU runs: the GPUs used, one worker per device and run slot
    runs_per_device: int = 1  # local GPU runs: runs packed onto one GPU at once
    procs_per_run: int = 1  # processes of one run (torchrun; DDP/FSDP), given as one placement
    max_retries: int = 3  # ray: attempts after the first, when a run's worker or node dies
    where: str = field(default="sweep", repr=False)  # the settings' prefix in messages: sweep.X or --x

    def key(self, name: str) -> str:
        """How the user spells setting ``name`` here: ``sweep.runs_per_device`` or ``--runs-per-device``."""
        return f"--{name.replace('_', '-')}" if self.where == "--" else f"{self.where}.{name}"

    @classmethod
    def from_dict(cls, d: dict, where: str = "sweep") -> "EngineSpec":
        d = {k: v for k, v in (d or {}).items() if k in KEYS and v is not None}
        spec = cls(where=where)
        for k, v in d.items():
            setattr(spec, k, v)
        return spec.validated()

    def validated(self) -> "EngineSpec":
        k = self.key
        self.engine = str(self.engine or "local").strip().lower()
        if self.engine not in ENGINES:
            raise UserError(f"{k('engine')}={self.engine!r} is not an engine; use local (this machine) or ray (a Ray cluster)")
        self.address = str(self.address or "").strip()
        if self.address and self.engine != "ray":
            raise UserError(f"{k('address')}={self.address} names a Ray cluster but {k('engine')} is local; "
                            f"add {'--engine ray' if self.where == '--' else 'sweep.engine=ray (--engine ray)'}")
        for name in ("workers", "runs_per_device", "procs_per_run", "max_retries"):
            try:
                setattr(self, name, int(getattr(self, name)))
            except (TypeError, ValueError):
                raise UserError(f"{k(name)} must be an integer, got {getattr(self, name)!r}") from None
        if self.workers < 1:
            raise UserError(f"{k('workers')}={self.workers}: at least 1 process; use 1 (runs one after another) or more")
        if self.runs_per_device < 1:
            raise UserError(f"{k('runs_per_device')}={self.runs_per_device}: a GPU takes at least one run at once; "
                            "use 1 (the default) or more to pack small runs onto one GPU")
        if self.procs_per_run < 1 or self.max_retries < 0:
            raise UserError(f"{k('procs_per_run')} must be >= 1 and {k('max_retries')} >= 0, "
                            f"got {self.procs_per_run} and {self.max_retries}")
        if self.procs_per_run > 1 and self.runs_per_device > 1:
            raise UserError(f"{k('runs_per_device')}={self.runs_per_device} packs single-process runs; a run of "
                            f"{k('procs_per_run')}={self.procs_per_run} processes takes whole GPUs: use one of them")
        self.devices = parse_devices(self.devices, k("devices"))
        return self
