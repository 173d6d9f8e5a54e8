"""Checkpoints of the main job: torch.distributed.checkpoint (DCP), sharded, under
DIR/checkpoints/step-N/.

A checkpoint becomes visible only when complete: every rank writes its shards into
DIR/checkpoints/.tmp-step-N, rank 0 adds meta.json and renames the directory to step-N (an
atomic rename on one file system; DCP assumes a file system every rank sees). A crash before
the rename leaves only a .tmp- directory, which the scan below never picks. The latest
checkpoint is found by scanning the directories (no pointer file that could disagree).

Tensor-parallel shards are saved as DTensors (Shard(partition_dim) on the tp sub-mesh) under
the full model's parameter names, and pipeline stages save their own layers under those names,
so DCP reshards on load: a checkpoint written under one mesh loads under another.
"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard

_NAME = re.compile(r"^step-(\d+)$")


def root(out) -> Path:
    return Path(out) / "checkpoints"


def complete(out) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under out/checkpoints, by step."""
    found = []
    r = root(out)
    if r.is_dir():
        for d in r.iterdir():
            m = _NAME.match(d.name)
            if m and (d / "meta.json").is_file() and (d / ".metadata").is_file():
                found.append((int(m.group(1)), d))
    return sorted(found)


def latest(out) -> tuple[int, Path] | None:
    found = complete(out)
    return found[-1] if found else None


def read_meta(path: Path) -> dict:
    return json.loads((Path(path) / "meta.json").read_text())


def blob(obj) -> io.BytesIO:
    """An opaque object for DCP (stored as bytes, never flattened into keys)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def unblob(buf: io.BytesIO):
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def shard(t: torch.Tensor, like: torch.Tensor, tp_mesh) -> torch.Tensor:
    """t (a tensor shaped like parameter `like`) as DCP should see it: a DTensor over the tp
    sub-mesh when `like` is a tensor-parallel shard, else t itself (replicated)."""
    if tp_mesh is not None and getattr(like, "tensor_parallel", False):
        return DTensor.from_local(t, tp_mesh, [Shard(like.partition_dim)], run_check=False)
    return t


def save(state: dict, out, step: int, meta: dict, fault=None) -> Path:
    """Collective: write `state` with DCP, then commit it as out/checkpoints/step-N."""
    r, rank = root(out), dist.get_rank()
    tmp, final = r / f".tmp-step-{step}", r / f"step-{step}"
    if rank == 0:
        r.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash mid-write
    dist.barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    if fault is not None:
        fault("ckpt", step)  # tests: die here, with the shards written but not committed
    if rank == 0:
        (tmp / "meta.json").write_text(json.dumps({**meta, "step": step}, indent=1))
        if final.exists():  # a rerun of a step (resumed from an earlier checkpoint)
            old = r / f".old-step-{step}"
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, final)
    dist.barrier()
    return final


def load(state: dict, path: Path) -> None:
    """Collective: fill `state` (tensors in place, BytesIO blobs replaced) from `path`."""
    dcp.load(state, checkpoint_id=str(path))
