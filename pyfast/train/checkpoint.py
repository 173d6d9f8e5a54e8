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

from pyfast._io import atomic_write_text, fsync_dir

_NAME = re.compile(r"^step-(\d+)$")


def root(out) -> Path:
    return Path(out) / "checkpoints"


def problem(d: Path, step: int) -> str | None:
    """Why directory d (named step-N) is not a complete checkpoint of this job: truncated (a
    copy cut short, a crash of a file system that lost unsynced data) or foreign; None if it is
    one."""
    try:
        meta = json.loads((d / "meta.json").read_text())
    except FileNotFoundError:
        return "no meta.json (not committed by pyfast train)"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"meta.json is unreadable or truncated ({type(e).__name__}: {e})"
    if not isinstance(meta, dict) or "model_key" not in meta or meta.get("step") != step:
        return f"meta.json is not this job's record of step {step} (a foreign checkpoint)"
    md = d / ".metadata"
    if not md.is_file() or md.stat().st_size == 0:
        return "DCP's .metadata is missing or empty"
    if not any(d.glob("*.distcp")):
        return "no DCP shard files (*.distcp)"
    return None


def complete(out, warn=None) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under out/checkpoints, by step; each step-N
    directory that is not one goes to warn(message) (None: silently) and is skipped."""
    found = []
    r = root(out)
    if r.is_dir():
        for d in sorted(r.iterdir()):
            m = _NAME.match(d.name)
            if not m:
                continue
            why = problem(d, int(m.group(1)))
            if why is None:
                found.append((int(m.group(1)), d))
            elif warn is not None:
                warn(f"skipping checkpoint {d}: {why}")
    return sorted(found)


def latest(out, warn=None) -> tuple[int, Path] | None:
    found = complete(out, warn)
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


def save(state: dict, out, step: int, meta: dict, fault=None, keep_last: int = 0) -> Path:
    """Collective: write `state` with DCP, then commit it as out/checkpoints/step-N: meta.json
    written atomically and fsynced, the directory fsynced, renamed, and its parent fsynced (DCP
    fsyncs its own files). keep_last > 0: then delete all but the keep_last latest complete
    checkpoints up to step N. --ckpt-async writes through ckpt_async.AsyncSaver instead, with
    the same begin() and commit() around DCP's async_save."""
    tmp = begin(out, step)
    dcp.save(state, checkpoint_id=str(tmp))
    if fault is not None:
        fault("ckpt", step)  # tests: die here, with the shards written but not committed
    final = commit(out, step, meta, keep_last)
    dist.barrier()
    return final


def begin(out, step: int) -> Path:
    """Collective: out/checkpoints/.tmp-step-N, emptied of what a crash mid-write left there,
    ready for every rank's shards once this returns."""
    r = root(out)
    tmp = r / f".tmp-step-{step}"
    if dist.get_rank() == 0:
        r.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash mid-write
    dist.barrier()
    return tmp


def commit(out, step: int, meta: dict, keep_last: int = 0) -> Path:
    """Rank 0 (the others return at once): make .tmp-step-N, whose shards every rank has
    written, the complete step-N (meta.json, fsyncs, the rename), then rotate keep_last.
    Not collective: the caller knows every rank's write finished (dcp.save returned on every
    rank, or ckpt_async's agreement) and adds a barrier where others must see step-N."""
    r = root(out)
    tmp, final = r / f".tmp-step-{step}", r / f"step-{step}"
    if dist.get_rank() == 0:
        atomic_write_text(tmp / "meta.json", json.dumps({**meta, "step": step}, indent=1))
        fsync_dir(tmp)
        if final.exists():  # a rerun of a step (resumed from an earlier checkpoint)
            _remove(r, final)
        os.replace(tmp, final)
        fsync_dir(r)  # the rename is durable: a power loss now keeps step-N whole
        if keep_last > 0:
            older = [d for s, d in complete(out) if s < step]
            for d in older[:max(0, len(older) - (keep_last - 1))]:
                _remove(r, d)
    return final


def _remove(r: Path, d: Path) -> None:
    """Delete checkpoint d: renamed out of the scan's sight first, so a crash midway never
    leaves a half-deleted step-N behind."""
    gone = r / f".old-{d.name}"
    shutil.rmtree(gone, ignore_errors=True)
    os.replace(d, gone)
    shutil.rmtree(gone, ignore_errors=True)


def load(state: dict, path: Path) -> None:
    """Collective: fill `state` (tensors in place, BytesIO blobs replaced) from `path`."""
    dcp.load(state, checkpoint_id=str(path))
