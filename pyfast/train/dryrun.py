"""`pyfast train --dry-run`: the job's own step (Job.train_step: forward, backward, gradient
reduction with the chosen compressor, clipping, optimizer) for chosen ranks of a world of N, in
this one process, on memoryless tensors: torch's meta device over torch's fake process group
(collectives and p2p move nothing). No process is started.

Each rank builds the Job exactly as `pyfast train` does, runs one step to create what the first
step creates (optimizer state, error-feedback memory, buckets), then one step under
memory.MemoryTracker: the peak of that step, split by kind. An op that cannot run on the dry
device (a CPU tensor meeting a device one, a host read of a tensor, an op without a meta kernel)
raises DryRunError naming the op and the module it ran in.
"""
from __future__ import annotations

import contextlib
import sys
import threading

import torch
import torch.distributed as dist

from .config import ConfigError, TrainConfig, check
from .memory import KINDS, MemoryTracker, held, optimizer_tensors

# usable memory per GPU, MiB as nvidia-smi reports the total (the CUDA context, ~0.5 GiB, and
# the caching allocator's fragmentation come on top of the peak this counts)
GPUS = {"h100": 81559, "h200": 143771, "a100-80gb": 81920, "a100-40gb": 40960,
        "l40s": 46068, "l4": 23034, "a10g": 23028, "v100-32gb": 32768, "v100-16gb": 16384}


class DryRunError(RuntimeError):
    """An op of the step cannot run on memoryless tensors; the message names op and module."""


class _Modules:
    """The modules whose forward is running (global forward hooks; torch's ModTracker also
    tracks backward, but its hooks break autograd.grad with leaf inputs, which zero-bubble's
    split backward uses)."""

    def __init__(self, root):
        self.names = {m: n or type(root).__name__ for n, m in root.named_modules()}
        self.stack: list[str] = []

    def __enter__(self):
        hooks = torch.nn.modules.module
        self._hooks = [hooks.register_module_forward_pre_hook(self._push),
                       hooks.register_module_forward_hook(self._pop, always_call=True)]
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()

    def _push(self, mod, args):
        self.stack.append(self.names.get(mod, type(mod).__name__))

    def _pop(self, mod, args, out):
        if self.stack:
            self.stack.pop()

    def where(self) -> str:
        if threading.current_thread() is not threading.main_thread():
            return "pyfast's communication thread"
        node = torch._C._current_autograd_node()
        if node is not None:
            return f"backward node {node.name()}"
        return f"module {self.stack[-1]}" if self.stack else "no module (the job's own code)"


class _Named(torch.utils._python_dispatch.TorchDispatchMode):
    """Re-raises an op's failure as DryRunError naming the op, the module it ran in and the
    pyfast line that called it. Communication runs inline under it (comm_inline:
    collectives.Handle.on_worker), so a dry step's memory is the same in every run."""
    comm_inline = True

    def __init__(self, rank: int):
        super().__init__()
        self.rank, self.mods = rank, None

    @contextlib.contextmanager
    def within(self, root):
        with _Modules(root) as self.mods:
            yield
        self.mods = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            return func(*args, **(kwargs or {}))
        except DryRunError:
            raise
        except Exception as e:
            where = self.mods.where() if self.mods is not None else "no module"
            raise DryRunError(f"rank {self.rank}: {func} in {where} at {_site()}: "
                              f"{type(e).__name__}: {e}") from e


def _site() -> str:
    """file:line (function) of the innermost pyfast frame outside the dry run's own code, else
    of the innermost frame outside torch's dispatch machinery."""
    f, other = sys._getframe(2), None
    while f is not None:
        name = f.f_code.co_filename
        if not name.endswith(("dryrun.py", "memory.py")):
            if "/pyfast/" in name:
                return f"{name[name.rindex('/pyfast/') + 1:]}:{f.f_lineno} ({f.f_code.co_name})"
            if other is None and "/torch/_" not in name and "/torch/utils/" not in name:
                other = f"{name}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return other or "?"


def measure(job, step) -> dict:
    """Peak bytes of step() by kind (memory.KINDS), counting what the job holds before it:
    what it holds on its device (the data and a pipeline's other stages, moved to meta, left
    out). A pipeline's other stages are on the meta device in a real run too: not this rank's."""
    skip = ("corpus", "batches")
    mine = job.pipe if job.pipe is not None else job.model
    mods = [mine] + ([job.zero] if job.zero is not None else [])
    ours = {id(t) for m in mods for t in (*m.parameters(), *m.buffers())}
    others = {id(t) for t in job.model.parameters()} - ours  # other stages' layers
    before, _ = held(job, skip)
    tracker = MemoryTracker()
    from pyfast.parallel.zero.offload import is_host  # offload's host tensors count too
    tracker.seed([t for t in before if (t.device == job.device or is_host(t))
                  and id(t) not in others])
    del before  # held here, last step's gradients would outlive zero_grad
    with tracker:
        step()
    now, feedback = held(job, skip)
    params = [t for m in mods for t in (*m.parameters(), *m.buffers())]
    params += [p for g in job.opt.param_groups for p in g["params"]]
    grads = [p.grad for p in params if isinstance(p, torch.Tensor) and p.grad is not None]
    return tracker.breakdown(params, grads, optimizer_tensors(job.opt), feedback)


def boundary_specs(job) -> dict:
    """What crosses each pipeline boundary (p2p.spec_of), from the model's own layers run on a
    meta micro-batch: the other stages' layers are on the meta device here too, parallelized
    like this rank's (tp, cp), so they give the shapes their ranks would send."""
    from pyfast.parallel.p2p import as_tensors, spec_of
    cfg, bounds = job.cfg, job.pipe.bounds
    rows = cfg.batch // (cfg.dp * cfg.grad_accum * cfg.m)
    h = torch.zeros(rows, cfg.seq // cfg.cp, dtype=torch.long, device="meta")
    specs = {}
    with torch.enable_grad():
        for b in range(len(bounds) - 2):
            for i in range(bounds[b], bounds[b + 1]):
                h = job.model[i](h)
            specs[b] = spec_of(*as_tensors(h, f"stage {b}'s output"))
    return specs


def check_dry(cfg: TrainConfig, world: int, ranks: list[int], gpu: str | None) -> None:
    check(cfg, world)
    from .ft import dry_problem
    from .profile import dry_problem as profile_problem
    for why in (dry_problem(cfg), profile_problem(cfg)):
        if why:
            raise ConfigError(why)
    if cfg.compress == "auto":
        raise ConfigError("--dry-run with --compress auto: auto picks a compressor by timing the "
                          "codecs and the link on real gradients, which a dry run has neither of; "
                          "give the compressor to size (e.g. --compress fp16)")
    if gpu is not None and gpu not in GPUS:
        raise ConfigError(f"--gpu {gpu!r}: one of {', '.join(GPUS)}")
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise ConfigError(f"--dry-rank {bad}: ranks are 0..{world - 1}")


@contextlib.contextmanager
def dry_world(world: int, rank: int):
    """This process as rank `rank` of a world of `world` on torch's fake process group, every
    op failing as DryRunError naming op, module and line; yields the namer, whose within(root)
    names the modules of `root`. Build tensors on the meta device inside."""
    if dist.is_initialized():
        raise RuntimeError("a dry run makes its own (fake) process group: this process already "
                           "has one")
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")
    # any store serves the fake backend; a HashStore also answers check(), which ring attention
    # asks while a transfer keeps it waiting (torch's FakeStore does not implement it)
    # meta only: batch_isend_irecv (ring attention, async TP) asks the backend of its tensors'
    # device, and a CPU tensor in a collective then fails by name instead of moving nothing
    dist.init_process_group("meta:fake", store=dist.HashStore(), rank=rank, world_size=world)
    try:
        with _Named(rank) as named:
            yield named
    finally:
        dist.destroy_process_group()


def run_rank(cfg: TrainConfig, world: int, rank: int) -> dict:
    """One rank's dry step: {"rank", "peak_bytes", <KINDS>: bytes, "host_bytes"}."""
    from .job import Job
    job = None
    with dry_world(world, rank) as named:
        try:
            job = Job(cfg, torch.device("meta"))
            if job.pipe is not None:
                job.pipe.expect(boundary_specs(job))
            with named.within(job.model):
                job.train_step(1)  # what step 1 creates (optimizer state, feedback) stays
                out = measure(job, lambda: job.train_step(2))
            return {"rank": rank, **out}
        finally:
            if job is not None:
                with contextlib.suppress(Exception):
                    job.close()


def roles(cfg: TrainConfig) -> list[int]:
    """One rank per distinct role: every pipeline stage; with --zero every dp x cp rank (each
    owns another shard, the last maybe a shorter one); otherwise dp, cp and tp rank 0 (their
    ranks hold the same shapes: the model's checks make every tp split even). Mesh's order:
    r = ((pp * dp + dp_rank) * cp + cp_rank) * tp + tp_rank."""
    shards = range(cfg.dp * cfg.cp) if cfg.zero else [0]
    return [(s * cfg.dp * cfg.cp + d) * cfg.tp for s in range(cfg.pp) for d in shards]


def parse_ranks(spec: str, cfg: TrainConfig) -> list[int]:
    if spec == "roles":
        return roles(cfg)
    if spec == "all":
        return list(range(cfg.ranks))
    try:
        return [int(r) for r in spec.split(",")]
    except ValueError:
        raise ConfigError(f"--dry-rank {spec!r}: 'roles', 'all' or R[,R...]") from None


def dry_run(cfg: TrainConfig, world: int, ranks: list[int] | None = None,
            gpu: str | None = None) -> list[dict]:
    """The dry step of each of `ranks` (default: roles(cfg)) in a world of `world` ranks:
    [{"rank", "peak_bytes", <KINDS>: bytes}, ...]; ConfigError for flags it cannot run."""
    ranks = roles(cfg) if ranks is None else ranks
    check_dry(cfg, world, ranks, gpu)
    return [run_rank(cfg, world, r) for r in ranks]


def main(cfg: TrainConfig, ns) -> int:
    """`pyfast train --dry-run`: the table (or --json) on stdout; 2 for bad flags."""
    import json
    try:
        world = ns.nproc or cfg.ranks
        if ns.nnodes != 1 or ns.print_launch:
            raise ConfigError("--dry-run runs in this one process: no --nnodes / --print-launch")
        if cfg.elastic:  # the plan for --nproc ranks; no checkpoint is read (nothing is loaded)
            from .config import plan_world
            from .elastic import describe
            asked, cfg = cfg, plan_world(cfg, world)
            what = describe(cfg, None, flags=asked) or "the flags' mesh as given"
            print(f"pyfast train: --elastic on the dry run: planned for {world} ranks, {what}; "
                  "no checkpoint is read", file=sys.stderr)
        rows = dry_run(cfg, world, parse_ranks(ns.dry_rank, cfg), ns.gpu)
        from .ckpt_async import dry_note
        if dry_note(cfg):  # on stderr: --json's stdout stays one JSON object
            print(f"pyfast train: note: {dry_note(cfg)}", file=sys.stderr)
        from .batch_split import dry_note as split_note
        if split_note(cfg):  # --batch-split auto: the even split, no measurement
            print(f"pyfast train: note: {split_note(cfg)}", file=sys.stderr)
        from .pp_balance import note
        if note(cfg, torch.device("meta")):  # --pp-balance auto sized as even
            print(f"pyfast train: note: {note(cfg, torch.device('meta'))}", file=sys.stderr)
    except ConfigError as e:
        print(f"pyfast train: error: {e}", file=sys.stderr)
        return 2
    if ns.json:
        print(json.dumps({"ranks": rows}))
    else:
        from rich.console import Console
        Console().print(table(rows, cfg, ns.gpu))
    return 0


def table(rows: list[dict], cfg: TrainConfig, gpu: str | None):
    from rich.table import Table
    cap = GPUS[gpu] * 2**20 if gpu else None
    t = Table(title=f"dry run: {cfg.model}, {cfg.mesh_flags()}, compress {cfg.compress}"
              + (f", zero {cfg.zero}" if cfg.zero else "")
              + (f" (shard group {cfg.zero_shard_group})" if cfg.zero_shard_group else "")
              + " - peak memory of one step, MiB")
    short = {"parameters": "params", "gradients": "grads", "optimizer": "optim",
             "activations": "activ", "comm_buffers": "comm", "feedback": "feedback"}
    host = any(r.get("host_bytes") for r in rows)  # --offload: the host's own peak
    for col in ("rank", "peak", *(short[k] for k in KINDS)) + (("host",) if host else ()) \
            + (("fits " + gpu,) if gpu else ()):
        t.add_column(col, justify="right")
    mib = lambda b: f"{b / 2**20:,.1f}"  # noqa: E731
    for r in rows:
        fits = () if cap is None else (("yes" if r["peak_bytes"] <= cap else "NO"),)
        t.add_row(str(r["rank"]), mib(r["peak_bytes"]), *(mib(r[k]) for k in KINDS),
                  *((mib(r["host_bytes"]),) if host else ()), *fits)
    if host:
        t.caption = ("peak: the device's; host: offloaded shards, gradients and optimizer state"
                     + ("" if gpu else " (without --gpu: on this CPU machine host and device "
                        "are the same memory, peak + host)"))
    return t
