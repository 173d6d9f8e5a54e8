"""Start the job's ranks with torchrun's own code (torch.distributed.run), after every check
that needs no rank: a bad flag fails here, before any process is started.

How a rank starts (--start-method): `forkserver` (the default) forks each rank from a server
process that imported torch and pyfast.train.run once, started before this launcher's own
import of torch so the two imports overlap (torchrun's function entrypoint with its
forkserver start method); `exec` is torchrun's command entrypoint, a fresh `python -u -m
pyfast train` per rank (what --print-launch prints for several nodes). A --max-restarts
restart forks again without importing. Measured on the 2-core VM (gpt-tiny dp 2, 2 steps),
alternated: by hand 5.4-8.5 s a launch against 8.1-11.1 s with exec; bench/launch_start.py,
with pyfast.cli.leave, against the code before: a launch 0.73-0.80x, a restart 0.42-0.44x.
Differences from exec, on purpose: a rank's environment is the launcher's at the launch plus
torchrun's variables, set in os.environ (its /proc/PID/environ is the server's); it titles
itself "pyfast rank R/W: train FLAGS" (setproctitle: `ps`, /proc/PID/cmdline, comm "pyfast
rank R"); it dies with a SIGKILLed launcher (an exec'd rank trains on); and the server never
touches CUDA (tests/test_launch_fork.py), so each rank initialises its own GPU as an exec'd one
does. Like an exec'd rank it runs in a session of its own (forked_rank: Linux schedules a
session as one group, and sharing the launcher's cost gpt-tiny's pp2 steps 20-30% here)."""
from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import sys
import uuid

from .config import (ConfigError, TrainConfig, check, check_degrees, check_shard_group,
                     plan_world)


def worker_args(cfg: TrainConfig) -> list[str]:
    """The flags that reproduce cfg (those that differ from the defaults)."""
    out, default = [], TrainConfig()
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if v == getattr(default, f.name):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(v, str) and v.startswith("-"):  # a --prompt "-x": argparse's = form
            out += [f"{flag}={v}"]
        elif v is False:  # a flag on by default (--outer-nesterov): its --no- form
            out += ["--no-" + flag[2:]]
        else:
            out += [flag] if v is True else [flag, str(v)]
    return out


def torchrun_args(cfg: TrainConfig, nproc: int, nnodes: int, node_rank: int,
                  endpoint: str, max_restarts: int) -> list[str]:
    args = ["--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts)]
    if nnodes == 1:
        args += ["--standalone"]
    else:  # static rendezvous at node 0's HOST:PORT, torchrun's meaning of these flags
        args += ["--nnodes", str(nnodes), "--node-rank", str(node_rank),
                 "--rdzv-endpoint", endpoint]
    return args + ["-m", "pyfast", "train"] + worker_args(cfg)


PRELOAD = ["pyfast.train.run"]  # the rank's whole import (torch, torch.distributed, the job)
# this process's environment when this module was first imported: in a forked rank, before
# torchrun's agent set the rank's own variables (RANK, MASTER_PORT, ...) in os.environ
_START_ENV = dict(os.environ)


def _start_forkserver(nproc: int) -> int | None:
    """Start multiprocessing's forkserver importing PRELOAD, with the environment a rank needs
    at import time: torchrun's for an exec'd rank, OMP_NUM_THREADS=1 for more than one local
    rank (libgomp reads it as it loads, i.e. at the server's import) and unbuffered output
    (its `python -u`). The server's pid if this call started it; None when one was already
    running in this process (a test process's): the ranks then import what it lacks."""
    import multiprocessing as mp
    import multiprocessing.forkserver as fs
    if nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    before = fs._forkserver._forkserver_pid
    mp.set_forkserver_preload(PRELOAD)
    # The server's first environment variable must be one nothing in a rank sets: setproctitle
    # finds the memory a title may take from the first one's address, and failed silently when
    # torchrun's agent had replaced it (a launcher started with OMP_NUM_THREADS first kept the
    # server's command line as its ranks' titles). Re-set, this process's come after ours.
    saved = dict(os.environ)
    os.environ.clear()
    os.environ["PYFAST_RANK_SERVER"] = str(os.getpid())
    os.environ.update(saved)
    try:
        fs.ensure_running()  # a no-op while one runs
    finally:
        del os.environ["PYFAST_RANK_SERVER"]
    pid = fs._forkserver._forkserver_pid
    return pid if pid != before else None


def _stop_forkserver(pid: int) -> None:
    """End the server _start_forkserver started, at once: SIGKILL, then multiprocessing's own
    stop (closes its alive pipe, reaps it, removes its socket), so that a later launch in this
    process starts a fresh one."""
    import multiprocessing.forkserver as fs
    os.kill(pid, signal.SIGKILL)
    fs._forkserver._stop()


def rank_env(launcher: dict, now: dict, start: dict) -> dict:
    """A forked rank's environment: the launcher's at the launch, plus what torchrun's agent
    set in this process (`now`'s entries that differ from `start`, the server's at its start).
    The server's own variables, stale by the launch, do not survive: an exec'd rank's is the
    launcher's environment plus the agent's, and so is this."""
    return {**launcher, **{k: v for k, v in now.items() if start.get(k) != v}}


def _tie_to_launcher() -> None:
    """This rank dies with its launcher. multiprocessing hands every process its forkserver
    starts the write end of the server's "alive" pipe, so the server lives on while a rank
    holds it, and so do its ranks: a SIGKILLed launcher left its server and both ranks
    training, orphaned. With this rank's end closed the launcher's is the last one; the server
    exits at its EOF and this rank, its child, is killed then (PR_SET_PDEATHSIG)."""
    import ctypes
    import multiprocessing.forkserver as fs
    server = fs._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
    # a process this rank starts through a forkserver gets a server of its own
    server._forkserver_alive_fd = server._forkserver_address = server._forkserver_pid = None
    parent = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL) != 0:  # PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:  # the server died before the signal was armed
        os._exit(1)


def forked_rank(env: dict, *argv: str) -> None:
    """A rank under --start-method forkserver: this job's part, as `pyfast train ARGV` under
    torchrun, in the launcher's environment `env` as it was at the launch (an exec'd rank's),
    plus what torchrun's agent set for this rank (the server's own is from its start). It
    returns (the agent collects every rank's return value) and the process then leaves
    through multiprocessing's os._exit, without the interpreter's teardown, as run.main does
    for an exec'd rank; a failure's exit code is the process's."""
    import setproctitle

    from .config import from_args, parser
    from .run import main as run_rank
    _tie_to_launcher()
    # A session of its own, as torchrun gives an exec'd rank: Linux's autogroup schedules each
    # session as one entity, and the ranks had shared the launcher's. gpt-tiny pp2 on the
    # 2-core VM stepped in 20.0-22.0 ms sharing it and 16.5-16.8 ms with a session each (three
    # runs each, alternated; exec'd ranks 16.9-17.5 in four): every message wakes a thread, and
    # within one group a waking rank waits behind its peer's threads. (gpt-tiny dp2 12.2 / 13.7
    # -> 12.0 / 11.6 ms; gpt-small dp2, compute-bound, alike.) The rank still dies with its
    # server (PR_SET_PDEATHSIG above); the terminal's Ctrl-C reaches it through the agent, as
    # it reaches an exec'd rank.
    os.setsid()
    rank, world = os.environ["RANK"], os.environ["WORLD_SIZE"]
    # the title `ps` and /proc/PID/cmdline show (the server's otherwise), the run's flags in
    # it; set before the environment is rewritten: setproctitle finds the memory it may
    # overwrite through the C environ, which os.environ.clear() moves (the title was then lost)
    setproctitle.setproctitle(f"pyfast rank {rank}/{world}: train {shlex.join(argv)}")
    setproctitle.setthreadtitle(f"pyfast rank {rank}")  # /proc/PID/comm: 15 bytes
    merged = rank_env(env, dict(os.environ), _START_ENV)
    os.environ.clear()
    os.environ.update(merged)
    code = run_rank(from_args(parser().parse_args(list(argv))), leave=False)
    if code:
        sys.exit(code)


def _elastic(a: list[str], cfg: TrainConfig, start_method: str) -> None:
    """torchrun with args `a` (torch.distributed.run.run), its entrypoint forked_rank under
    the forkserver start method."""
    from torch.distributed.run import config_from_args, parse_args, run
    args = parse_args(a)
    if start_method == "exec":
        return run(args)
    from torch.distributed.launcher.api import elastic_launch
    if args.standalone:  # as run() does: a c10d store on a free port of this host
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", \
            str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    args.start_method = start_method
    config, _, _ = config_from_args(args)
    elastic_launch(config, entrypoint=forked_rank)(dict(os.environ), *worker_args(cfg))


def launch(cfg: TrainConfig, ns) -> int:
    server = None
    try:
        if ns.nnodes < 1 or not 0 <= ns.node_rank < ns.nnodes:
            raise ConfigError(f"--node-rank {ns.node_rank} must be in [0, --nnodes {ns.nnodes})")
        if ns.nnodes > 1 and not ns.rdzv_endpoint:
            raise ConfigError(f"--nnodes {ns.nnodes} needs --rdzv-endpoint HOST:PORT of node 0")
        if ns.max_restarts < 0:
            raise ConfigError("--max-restarts must be >= 0")
        check_degrees(cfg)
        ranks = cfg.ranks
        nproc = ns.nproc or ranks // ns.nnodes  # default: the mesh's size, split over the nodes
        if nproc < 1:
            raise ConfigError(f"--nproc must be >= 1, got {nproc}")
        world = nproc * ns.nnodes
        # --elastic: the ranks re-plan dp for the world they find (elastic.plan); the workers
        # get the flags as asked, so a torchrun restart at another size plans again from them
        planned = plan_world(cfg, world)
        if ns.nproc and world != planned.ranks:
            raise ConfigError(f"{cfg.mesh_flags()} = {ranks} ranks, "
                              f"but --nproc {nproc} x --nnodes {ns.nnodes} = {world}")
        if ns.start_method == "forkserver" and not ns.print_launch:
            # before check(), whose import of torch (3.8 s) the server's own then overlaps
            server = _start_forkserver(nproc)
        data = check(planned, world)
        check_shard_group(planned, nproc)  # --zero-shard-group against the ranks of a node
        from .ft import unreachable
        if not ns.print_launch and unreachable(cfg):  # --ft: before any process starts
            raise ConfigError(unreachable(cfg))
        from .run import check_resume
        if not ns.print_launch:
            check_resume(planned, restarted=False, data=data)
    except ConfigError as e:
        if server:  # no rank will start: the server's import is not waited for
            _stop_forkserver(server)
        print(f"pyfast train: error: {e}", file=sys.stderr)
        return 2
    if ns.print_launch:
        for node in range(ns.nnodes):
            a = torchrun_args(cfg, nproc, ns.nnodes, node, ns.rdzv_endpoint, ns.max_restarts)
            print(f"# node {node}\ntorchrun {shlex.join(a)}")
        return 0
    # torchrun's restarts reuse one rendezvous TCP store, and the restarted gloo ranks can then
    # fail to connect (pytorch#135712; ../shared/MEASURED.md): a fresh store per attempt.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    a = torchrun_args(cfg, nproc, ns.nnodes, ns.node_rank, ns.rdzv_endpoint, ns.max_restarts)
    try:
        _elastic(a, cfg, ns.start_method)
    except ChildFailedError as e:
        codes = {f.local_rank: f.exitcode for f in e.failures.values()}
        worst = 2 if set(codes.values()) == {2} else 3 if 3 in codes.values() else 1
        print(f"pyfast train: failed (exit codes by local rank: {codes})", file=sys.stderr)
        return worst
    finally:
        # every rank has exited by now; the server would leave at its alive pipe's EOF, through
        # the interpreter's teardown of torch (1-1.5 s, with this launch's stdout and stderr
        # open: a caller reading them to EOF waited for it): ended here instead
        if server:
            _stop_forkserver(server)
    return 0
