"""`pyfast ablate`'s flags (or a TOML file of the same keys), their checks, and the matrix of
cells they make. Every check runs before any rank starts: a bad flag costs nothing."""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
from dataclasses import dataclass, field

TASKS = ("teacher", "gpt-tiny", "gpt-small")
# What each task trains unless the flags say otherwise. gpt-tiny: 16 x 128 bytes a step, 34 ms
# a step on 2 ranks x 1 thread on plain loopback (measured): the default matrix's 48 cells of
# 200 steps take 10 minutes of its 30. Target losses: where bf16 gets in about half the steps
# (gpt-tiny: 2.35 at step 106 of 200), so a slower-converging compressor shows as a later time
# (int4: 115, PowerSGD:4 + EF: 161; bench/results/ablate).
TASK_DEFAULTS = {
    "teacher": dict(steps=60, target_loss=0.2, batch=64, seq=0, lr=3e-3),
    "gpt-tiny": dict(steps=200, target_loss=2.35, batch=16, seq=128, lr=3e-3),
    "gpt-small": dict(steps=150, target_loss=2.4, batch=8, seq=256, lr=1e-3),
}
DEFAULT_SPECS = "none,bf16,int8,int4,sign,topk:0.01,randomk:0.01,powersgd:4,auto"


class AblateError(ValueError):
    """A flag the ablation cannot run with; the message names the flag and the value."""


@dataclass
class AblateConfig:
    specs: list = field(default_factory=lambda: DEFAULT_SPECS.split(","))
    error_feedback: list = field(default_factory=lambda: ["on", "off"])
    bucket_mb: list = field(default_factory=lambda: [0.0])  # 0: DataParallel's default
    links: list = field(default_factory=lambda: ["loopback", "1gbit", "100mbit"])
    world: list = field(default_factory=lambda: [2])
    seeds: list = field(default_factory=lambda: [0])
    task: str = "gpt-tiny"
    steps: int = 0                # 0: the task's default
    target_loss: float = 0.0      # 0: the task's default
    batch: int = 0                # global batch (sequences / samples); 0: the task's default
    seq: int = 0
    lr: float = 0.0
    out: str = "runs/ablate"
    resume: bool = False
    timeout: float = 300.0        # seconds a cell may go without finishing a step

    def __post_init__(self):
        for k, v in TASK_DEFAULTS.get(self.task, {}).items():
            if not getattr(self, k):
                setattr(self, k, v)

    def fixed(self) -> dict:
        """What every cell shares: a resumed ablation must have the same."""
        return {k: getattr(self, k) for k in ("task", "steps", "target_loss", "batch", "seq",
                                              "lr")}


def _list(kind, name: str):
    def parse(text):
        items = text if isinstance(text, list) else [t for t in str(text).split(",") if t.strip()]
        try:
            return [kind(str(t).strip()) for t in items]
        except ValueError:
            raise AblateError(f"--{name} {text!r}: expected a comma-separated list of "
                              f"{kind.__name__}") from None
    return parse


PARSERS = {"specs": _list(str, "specs"), "error_feedback": _list(str, "error-feedback"),
           "bucket_mb": _list(float, "bucket-mb"), "links": _list(str, "links"),
           "world": _list(int, "world"), "seeds": _list(int, "seeds")}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pyfast ablate", description="Compression ablations: which compressor reaches a "
        "target loss soonest on which link, against the 16-bit (bf16) baseline.")
    a = p.add_argument
    a("--config", help="TOML file of the same keys (specs = [...] or \"a,b\"); flags override it")
    a("--specs", help=f"compressor specs (default {DEFAULT_SPECS})")
    a("--error-feedback", help="on,off (lossless specs run once, as n/a)")
    a("--bucket-mb", help="DataParallel bucket sizes in MB (0: its default)")
    a("--links", help="loopback and tc rates, e.g. loopback,10gbit,1gbit,100mbit (rates need root)")
    a("--world", help="world sizes, e.g. 2,4")
    a("--seeds", help="seeds: the initialisation and the data order of each cell")
    a("--task", help=f"one of {', '.join(TASKS)} (teacher: a fast regression, for tests)")
    a("--steps", type=int)
    a("--target-loss", type=float)
    a("--batch", type=int)
    a("--seq", type=int)
    a("--lr", type=float)
    a("--out")
    a("--resume", action="store_true", default=None, help="skip the cells DIR already has")
    a("--timeout", type=float, help="seconds a cell may go without finishing a step")
    return p


def from_args(argv) -> AblateConfig:
    ns = parser().parse_args(argv)
    values = {}
    if ns.config:
        values.update(_toml(ns.config))
    values.update({k: v for k, v in vars(ns).items() if k != "config" and v is not None})
    known = {f.name for f in dataclasses.fields(AblateConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise AblateError(f"--config {ns.config}: unknown keys {unknown}; known: {sorted(known)}")
    for k, parse in PARSERS.items():
        if k in values:
            values[k] = parse(values[k])
    return check(AblateConfig(**values))


def _toml(path: str) -> dict:
    import tomllib
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise AblateError(f"--config {path}: {e}") from None
    return {k.replace("-", "_"): v for k, v in data.items()}


def check(cfg: AblateConfig) -> AblateConfig:
    """AblateError naming the first bad value; the checks that need no rank."""
    import pyfast.compress as C
    from pyfast.netns import rate_bps
    if cfg.task not in TASKS:
        raise AblateError(f"--task {cfg.task!r}: one of {', '.join(TASKS)}")
    for spec in cfg.specs:
        try:
            C.get("fp16" if spec == "auto" else spec)
        except (ValueError, TypeError) as e:
            raise AblateError(f"--specs: {e}") from None
    bad = [e for e in cfg.error_feedback if e not in ("on", "off")]
    if bad or not cfg.error_feedback:
        raise AblateError(f"--error-feedback {','.join(cfg.error_feedback)}: on and/or off")
    for link in cfg.links:
        try:
            rate_bps(link)
        except ValueError as e:
            raise AblateError(f"--links: {e}") from None
    for name in ("specs", "links", "world", "seeds", "bucket_mb"):
        values = getattr(cfg, name)
        if not values:
            raise AblateError(f"--{name.replace('_', '-')} is empty")
        if len(set(values)) != len(values):
            raise AblateError(f"--{name.replace('_', '-')} {values}: a value appears twice")
    if any(w < 2 for w in cfg.world):
        raise AblateError(f"--world {cfg.world}: data parallelism needs at least 2 ranks")
    if any(b < 0 for b in cfg.bucket_mb):
        raise AblateError(f"--bucket-mb {cfg.bucket_mb}: sizes must be > 0 (0: the default)")
    if cfg.steps < 1 or cfg.batch < 1 or cfg.lr <= 0 or cfg.timeout <= 0:
        raise AblateError(f"need --steps, --batch >= 1 and --lr, --timeout > 0; got steps "
                          f"{cfg.steps}, batch {cfg.batch}, lr {cfg.lr}, timeout {cfg.timeout}")
    for w in cfg.world:
        if cfg.batch % w:
            raise AblateError(f"--batch {cfg.batch} is not divisible by --world {w}")
    return cfg


def _lossless(spec: str) -> bool:
    import pyfast.compress as C
    return spec != "auto" and not C.get(spec).lossy


def cell_id(c: dict) -> str:
    """A readable, file-name-safe name that is a function of the cell's flags."""
    b = "default" if not c["bucket_mb"] else f"{c['bucket_mb']:g}"
    raw = (f"{c['task']}_{c['spec']}_ef-{c['error_feedback']}_b{b}_{c['link']}_w{c['world']}_"
           f"s{c['seed']}")
    return re.sub(r"[^A-Za-z0-9_.-]", "-", raw)


def cells(cfg: AblateConfig) -> list[dict]:
    """The matrix, link-major (cells on one link run in one launch of the ranks). Error
    feedback means nothing for a lossless spec ("none"): it runs once, as "n/a"."""
    out = []
    for link in cfg.links:
        for world in cfg.world:
            for seed in cfg.seeds:
                for bucket in cfg.bucket_mb:
                    for spec in cfg.specs:
                        efs = ["n/a"] if _lossless(spec) else cfg.error_feedback
                        for ef in efs:
                            c = {"task": cfg.task, "spec": spec, "error_feedback": ef,
                                 "bucket_mb": bucket, "link": link, "world": world, "seed": seed,
                                 "steps": cfg.steps, "target_loss": cfg.target_loss}
                            c["cell"] = cell_id(c)
                            out.append(c)
    return out


def to_json(cfg: AblateConfig) -> str:
    return json.dumps(dataclasses.asdict(cfg), sort_keys=True)
