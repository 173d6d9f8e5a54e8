"""Run a function on N gloo ranks (spawned processes) and return each rank's result."""
import os
import socket
import traceback

import torch.multiprocessing as mp

TIMEOUT = 120  # seconds: a hang fails the test instead of blocking CI


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pack(value) -> bytes:
    # tensors by value: shared-memory handles die with the rank that made them
    import io

    import torch
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _entry(rank, world, port, fn, args, queue):
    import datetime

    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=TIMEOUT))
        queue.put((rank, True, _pack(fn(rank, world, *args))))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _next(queue, procs, results, errors):
    """The next rank's report; a rank that died without one (killed, segfault) fails the test
    after a 5 s grace for its queue to flush, instead of hanging the parent."""
    import queue as q
    import time
    deadline, dead_since = time.monotonic() + TIMEOUT + 30, None
    while True:
        try:
            return queue.get(timeout=1)
        except q.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            dead_since = dead_since or (time.monotonic() if dead else None)
            if dead and time.monotonic() - dead_since > 5:
                raise AssertionError(f"rank(s) {dead} died without a report (exit codes "
                                     f"{[procs[r].exitcode for r in dead]}); errors so far: {errors}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no report from a rank within {TIMEOUT + 30} s "
                                     f"(got ranks {sorted(results)})")


def run_ranks(fn, world: int, *args):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    for _ in range(world):
        rank, ok, value = _next(queue, procs, results, errors)
        if ok:
            import io

            import torch
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
        else:
            errors.append(f"rank {rank}:\n{value}")
    for p in procs:
        p.join(TIMEOUT)
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]


def value_error_text(fn) -> str:
    """The message of the ValueError fn() raises, or "no error" (ranks report it for checking)."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"
