"""`pyfast train --ckpt-async`: checkpoints written by torch DCP's `async_save` while training
goes on (user guide: docs/fault_tolerance.md, "Cheap checkpoints"). The flag, and the
Checkpointer the job's loop saves through in both modes (blocking: checkpoint.save as before).

What a checkpoint still guarantees (checkpoint.py): it becomes visible only complete. The async
path keeps that by splitting checkpoint.save at the write:

    save(step N)   wait for the save in flight, if any, and commit it (the step is blocked
                   for that, "ckpt_wait_ms"); begin() (.tmp-step-N, a barrier); async_save:
                   the state is staged (copied to host memory, "ckpt_stage_ms") and DCP
                   writes the copy in a background thread while the next steps run.
    poll()         after each later step, on every rank: one 2-element all-reduce of
                   (my write not finished, my write failed). All finished: commit() on rank 0
                   (meta.json, fsyncs, the .tmp-step-N -> step-N rename, keep_last rotation).
                   Any failed: CheckpointError on every rank, the .tmp- directory left unseen.
    finish()       at the end of the run (and on an error that every rank shares): wait,
                   agree, commit, barrier: the last checkpoint is complete before the job exits.

The ranks agree in the main thread at a step boundary, over the default group, so no
collective is ever issued from the background thread on a group the step uses: DCP's own
collectives (plan gather, write results) run in the writer thread on a gloo group of their own
(new_group(backend="gloo"): async_save needs a CPU backend, and NCCL's default group has none).
At most one save is in flight: the previous write's staged copy is all the extra host memory.

THREAD, not PROCESS (torch's AsyncCheckpointerType), measured side by side on the 2-core VM
(2 ranks; bench/results/ckpt_executor.txt, ckpt_fresh_stager.txt): the process's background
write took 1.21 vs 0.95 s and 1.14 vs 0.70 s, and it starts a process per rank that imports
torch and joins a process group of its own. A failure of the write thread is raised by its
future and reaches every rank through poll().
"""
from __future__ import annotations

import argparse
import time


class CheckpointError(RuntimeError):
    """A checkpoint's write failed on some rank: raised on every rank alike (the agreement in
    Checkpointer.poll / finish), so the job stops cleanly; the checkpoint is never committed
    and the last complete one is kept."""


def add_flags(p: argparse.ArgumentParser, d) -> None:
    g = p.add_argument_group("cheap checkpoints (docs/fault_tolerance.md)")
    g.add_argument("--ckpt-async", action="store_true", default=d.ckpt_async,
                   help="write checkpoints with torch DCP's async_save in a background thread "
                        "while training continues: the step blocks only to copy the state to "
                        "host memory (and to wait for the previous save, at most one in "
                        "flight); a checkpoint is committed (renamed to step-N) after every "
                        "rank's write finished. Ignored by --dry-run (it saves nothing)")


def dry_note(cfg) -> str | None:
    """The dry run's line about the flag: it takes no checkpoint, so the flag changes nothing."""
    if cfg.ckpt_async:
        return "--ckpt-async ignored: a dry run writes no checkpoint"
    return None


class Checkpointer:
    """The job's checkpoints: save(), poll() after every step, finish() at the end. Blocking
    (async_=False): checkpoint.save, timed. `stats`: one dict per checkpoint saved by this
    process (the summary's rows)."""

    def __init__(self, async_: bool, device, executor: str = "thread"):
        """executor: torch's AsyncCheckpointerType by name ("thread", the job's; "process" for
        `pyfast bench ckpt`'s comparison of the two)."""
        self.async_, self.device, self.executor = async_, device, executor
        self.group = None  # the writer thread's gloo group, made at the first async save
        self.stager = None  # DCP's DefaultStager, kept: its host copies are reused
        self.pending = None  # the save in flight: dict(future, out, step, meta, keep_last, ...)
        self.stats: list[dict] = []

    def save(self, job, out, step: int, keep_last: int = 0) -> dict:
        """Collective: checkpoint `job` at `step`; returns the record of what it cost the step
        (ckpt_* keys; the loop logs it with the next step's record)."""
        from . import checkpoint as ck
        t0 = time.perf_counter()
        if not self.async_:
            job.save(out, step, keep_last=keep_last)
            rec = {"ckpt_step": step, "ckpt_mode": "blocking",
                   "ckpt_blocked_ms": 1e3 * (time.perf_counter() - t0)}
            self.stats.append(rec)
            return rec
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        waited = self.finish(barrier=False)  # at most one in flight
        if self.group is None:  # every rank reaches its first save at the same step
            self.group = dist.new_group(backend="gloo")
            self.stager = _stager(self.device, self.executor)
        t1 = time.perf_counter()
        tmp = ck.begin(out, step)
        state = job.state(full=True)
        writer = _low_priority_writer(tmp) if self.executor == "thread" else None
        kind = AsyncCheckpointerType[self.executor.upper()]
        fut = dcp.async_save(state, checkpoint_id=str(tmp), storage_writer=writer,
                             process_group=self.group, async_stager=self.stager,
                             async_checkpointer_type=kind)
        t2 = time.perf_counter()
        p = {"future": fut, "out": out, "step": step, "meta": job.meta(),
             "keep_last": keep_last, "started": t2, "written": None}
        fut.add_done_callback(lambda _f, p=p: p.__setitem__("written", time.perf_counter()))
        self.pending = p
        rec = {"ckpt_step": step, "ckpt_mode": "async", "ckpt_blocked_ms": 1e3 * (t2 - t0),
               "ckpt_wait_ms": 1e3 * waited, "ckpt_stage_ms": 1e3 * (t2 - t1)}
        self.stats.append(rec)
        return rec

    def poll(self) -> dict:
        """Collective (a no-op while nothing is in flight, the same on every rank): commit the
        save in flight if every rank's write finished; CheckpointError on every rank if one
        failed. Returns {"ckpt_committed": N, "ckpt_write_ms": ...} when it committed step N."""
        if self.pending is None:
            return {}
        fut = self.pending["future"]
        running, failed = self._agree(not fut.done(), fut.done() and fut.exception() is not None)
        if failed:
            self._raise(failed)
        return {} if running else self._commit()

    def finish(self, barrier: bool = True) -> float:
        """Collective: wait for the save in flight and commit it (CheckpointError on every rank
        if a write failed); barrier: then every rank sees step-N. Seconds waited."""
        if self.pending is None:
            if barrier and self.stats and self.async_:
                import torch.distributed as dist
                dist.barrier()
            return 0.0
        fut, t0 = self.pending["future"], time.perf_counter()
        try:
            fut.result()
        except Exception:  # noqa: BLE001  (told to every rank just below)
            pass
        waited = time.perf_counter() - t0
        _, failed = self._agree(False, fut.exception() is not None)
        if failed:
            self._raise(failed)
        self._commit()
        if barrier:
            import torch.distributed as dist
            dist.barrier()
        return waited

    def close(self) -> None:
        """Free the staging buffers (after finish(); the job's end, whatever ended it)."""
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    def _agree(self, running: bool, failed: bool) -> tuple[int, int]:
        """(ranks still writing, ranks whose write failed): a 2-element all-reduce on the job's
        device (NCCL takes device tensors), in the main thread."""
        import torch
        import torch.distributed as dist
        v = torch.tensor([float(running), float(failed)], device=self.device)
        dist.all_reduce(v)
        a, b = v.tolist()
        return int(a), int(b)

    def _raise(self, failed: int):
        p, self.pending = self.pending, None
        mine = p["future"].exception()
        here = f"this rank's: {type(mine).__name__}: {mine}" if mine is not None else \
            "this rank's write finished"
        raise CheckpointError(f"the checkpoint of step {p['step']} failed on {failed} rank(s) "
                              f"({here}); not committed (its .tmp-step-{p['step']} is left "
                              f"unseen), the last complete checkpoint is kept") from mine

    def _commit(self) -> dict:
        from . import checkpoint as ck
        p, self.pending = self.pending, None
        ck.commit(p["out"], p["step"], p["meta"], p["keep_last"])
        written = 1e3 * ((p["written"] or time.perf_counter()) - p["started"])
        for rec in self.stats:
            if rec["ckpt_step"] == p["step"]:
                rec["ckpt_write_ms"] = written
        return {"ckpt_committed": p["step"], "ckpt_write_ms": written}


# The write thread's nice value. On the 2-core VM, where the two ranks' compute fills both cores
# (gpt 8 x 512, 307 MB checkpoints every 5 steps; bench/results/ckpt_normal_priority.txt,
# ckpt_nice19.txt): at nice 0 the write added 0.593x the blocking save's time to the steps it
# overlapped (it takes CPU from the compute); at nice 19 1.781x, starved behind other tenants'
# nice-19 jobs (load 23): a 3.8 s write, and the next save waited 592 ms for it. 10: a weight
# of 110 to a nice-0 thread's 1024 and ahead of nice-19 work 7:1, so the write yields to the
# training's own threads (on a GPU machine, those feeding the GPU) without queueing behind
# every background job; with it 0.690x / 0.708x (ckpt.txt, ckpt_b.txt, load 14-41).
WRITER_NICE = 10


def _low_priority_writer(path):
    """DCP's FileSystemWriter for `path` whose thread lowers its CPU priority to WRITER_NICE
    when the write starts. Linux sets nice per thread; elsewhere the write keeps the process's
    priority."""
    import os
    import threading

    from torch.distributed.checkpoint import FileSystemWriter

    class Writer(FileSystemWriter):
        def set_up_storage_writer(self, *args, **kwargs):  # in the writer thread
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
            except (AttributeError, OSError):  # not Linux: the process's priority
                pass
            return super().set_up_storage_writer(*args, **kwargs)
    return Writer(path)


def _stager(device, executor: str):
    """DCP's DefaultStager, kept for the run: it caches a host copy per staged storage and
    copies into it at the next save (safe: at most one save is in flight, and the next one
    stages only after it finished). A fresh stager per save (async_save's default) allocates
    and faults in the whole state every time: 131 MB staged in 92 ms that way (1.4 GB/s,
    bench/results/ckpt_fresh_stager.txt), 307 MB in 81-115 ms kept (2.7-3.8 GB/s,
    ckpt_normal_priority.txt, ckpt.txt, ckpt_b.txt; other runs, other loads). Pinned host
    memory on CUDA (the device to host copy at full PCIe speed); shared memory for the process
    executor (no pickled copy)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    return DefaultStager(StagingOptions(use_pinned_memory=device.type == "cuda",
                                        use_shared_memory=executor == "process",
                                        use_async_staging=False, use_non_blocking_copy=False))


def summary_rows(stats: list[dict]) -> list[tuple[str, str]]:
    """The run summary's checkpoint rows: what the saves cost the steps (mean), and for async
    saves the background write."""
    if not stats:
        return []
    mean = lambda k: sum(r.get(k, 0.0) for r in stats) / len(stats)  # noqa: E731
    mode = stats[0]["ckpt_mode"]
    rows = [(f"checkpoints ({mode})", f"{len(stats)}, steps {stats[0]['ckpt_step']}.."
                                      f"{stats[-1]['ckpt_step']}"),
            ("checkpoint: step blocked ms (mean)", f"{mean('ckpt_blocked_ms'):.1f}")]
    if mode == "async":
        rows += [("  of which staging / waiting for the previous ms",
                  f"{mean('ckpt_stage_ms'):.1f} / {mean('ckpt_wait_ms'):.1f}"),
                 ("checkpoint: background write ms (mean)",
                  f"{mean('ckpt_write_ms'):.1f}")]
    return rows
