"""Start the job's ranks with torchrun's own code (torch.distributed.run), after every check
that needs no rank: a bad flag fails here, before any process is started."""
from __future__ import annotations

import dataclasses
import os
import shlex
import sys

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


def launch(cfg: TrainConfig, ns) -> int:
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
        data = check(planned, world)
        check_shard_group(planned, nproc)  # --zero-shard-group against the ranks of a node
        from .ft import unreachable
        if not ns.print_launch and unreachable(cfg):  # --ft: before any process starts
            raise ConfigError(unreachable(cfg))
        from .run import check_resume
        if not ns.print_launch:
            check_resume(planned, restarted=False, data=data)
    except ConfigError as e:
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
    from torch.distributed.run import parse_args, run
    a = torchrun_args(cfg, nproc, ns.nnodes, ns.node_rank, ns.rdzv_endpoint, ns.max_restarts)
    try:
        run(parse_args(a))
    except ChildFailedError as e:
        codes = {f.local_rank: f.exitcode for f in e.failures.values()}
        worst = 2 if set(codes.values()) == {2} else 3 if 3 in codes.values() else 1
        print(f"pyfast train: failed (exit codes by local rank: {codes})", file=sys.stderr)
        return worst
    return 0
