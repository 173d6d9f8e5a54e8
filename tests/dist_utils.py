"""The one launcher of the tests: run a function on N gloo ranks (processes on this machine) with
a timeout, and collect what each rank returned or raised.

    results = run_ranks(fn, 2, arg1, arg2)        # fn(rank, world_size, arg1, arg2) on each rank
    errors = run_ranks(fn, 2, expect_errors=True) # each entry: the value, or a RankError

    with RankPool(2) as pool:                     # ranks kept alive across many small cases
        pool.run(fn, arg1)

`fn` must be importable by name (a module-level function of a test module): ranks are forked
from a forkserver (or spawned), never forked from the test process, so no torch thread pool or
gloo state leaks from the parent. The parent hosts the TCPStore on a port the OS picks, so
parallel test runs never race for a "free" port. Every rank runs with one torch thread and a
process group timeout (`pg_timeout`), so a bug fails instead of hanging. A rank that raises
reports its exception type, message and traceback; a rank that dies (SIGKILL in a dead-peer
test, a segfault) reports as RankError of kind "died" with its exit code.

Start-up: spawning costs about 2 s per rank on a 2-core machine (a fresh interpreter imports
torch and pyfast), which was most of the suite's time. So ranks are forked by default from one
forkserver per test process that imported torch, pyfast's packages and pytest once (PRELOAD)
and never ran an op or made a group: it holds no thread (OMP_NUM_THREADS=1 while it starts,
else numpy's OpenBLAS starts a pool at import), no gloo state and no TCPStore, so a fork of it
is what a spawn would build, minus the imports. Each rank takes the test process's environment
as it is at RankPool() (as a spawn would; the server's own is from its start). Three ranks
start in well under a second. `start_method="spawn"` (or PYFAST_TEST_START=spawn for a whole
run) spawns them as before. RankPool keeps ranks alive across calls for suites that run many
small cases (the `pool2`/`pool4` fixtures); tests that kill a rank take fresh ones per case.
"""
from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue
import time
import traceback

import torch.distributed as dist

# imported once by the forkserver (a name that fails to import is skipped by multiprocessing);
# torch._dynamo: torch imports it lazily when a rank first builds an optimizer or inits a meta
# tensor, 1.5-3 s a process on 2 cores
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "numpy", "pytest", "dist_utils",
           "pyfast.comm", "pyfast.comm.engine", "pyfast.compress", "pyfast.ops",
           "pyfast.parallel", "pyfast.models")


def _context(start_method: str | None, preload=()):
    """The multiprocessing context; for a forkserver, started here (once per process) with
    PRELOAD + preload imported and one OpenMP/OpenBLAS thread."""
    start_method = start_method or os.environ.get("PYFAST_TEST_START", "forkserver")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        from multiprocessing import forkserver
        ctx.set_forkserver_preload(list(dict.fromkeys([*PRELOAD, *preload])))
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # the server's env, read as it imports torch
        try:
            forkserver.ensure_running()  # a no-op once running (its preload is then fixed)
        finally:
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved
    return ctx


class RankError(Exception):
    """What a rank raised (kind: its exception type name, message, traceback text), or kind
    "died" for a rank that exited without a report (message: its exit code)."""

    def __init__(self, rank: int, kind: str, message: str, tb: str):
        super().__init__(f"rank {rank}: {kind}: {message}")
        self.rank, self.kind, self.message, self.tb = rank, kind, message, tb


def _pack(value) -> bytes:
    # tensors by value: torch's queue pickling shares their memory through the rank that made
    # them, which may be dead (or killed) by the time the parent reads them
    import torch
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _unpack(data: bytes):
    import torch
    return torch.load(io.BytesIO(data), weights_only=False)


def _worker(rank, world, port, pg_timeout, inbox, outbox, env=None):
    if env is not None:  # the parent's environment now, not the forkserver's at its start
        os.environ.clear()
        os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=pg_timeout))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=pg_timeout))
    try:
        while True:
            job = inbox.get()
            if job is None:
                break
            fn, args, kwargs = job
            try:
                outbox.put((rank, True, _pack(fn(rank, world, *args, **kwargs))))
            except BaseException as e:  # noqa: BLE001  (report everything to the parent)
                outbox.put((rank, False, (type(e).__name__, str(e), traceback.format_exc())))
    finally:
        dist.destroy_process_group()


class RankPool:
    """N live ranks in one gloo group; run() sends them a job and waits for every rank's report
    (submit() + wait() do the same in two steps, to run several pools at once). A rank that
    times out or dies takes the pool down: later jobs are refused, and close() kills the
    processes this pool started, by their handles."""

    def __init__(self, world_size: int, pg_timeout: float = 30.0, start_method: str | None = None,
                 preload: list[str] | tuple[str, ...] = ()):
        """start_method: "forkserver" (the default, see the module) or "spawn"; preload: more
        modules for the forkserver, used only by the call that starts it."""
        ctx = _context(start_method, preload)
        self.world_size = world_size
        self._store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                                    wait_for_workers=False)
        self._out = ctx.Queue()
        self._ins = [ctx.Queue() for _ in range(world_size)]
        port = self._store.port
        self._procs = [ctx.Process(target=_worker, daemon=True,
                                   args=(r, world_size, port, pg_timeout, self._ins[r], self._out,
                                         dict(os.environ)))
                       for r in range(world_size)]
        for p in self._procs:
            p.start()
        self.alive, self._closed, self._job = True, False, None

    def submit(self, fn, *args, **kwargs) -> None:
        """Send fn(rank, world_size, *args, **kwargs) to every rank; wait() collects it."""
        if not self.alive:
            raise RuntimeError("RankPool is closed (a rank timed out or died earlier)")
        if self._job is not None:
            raise RuntimeError(f"RankPool: {self._job} was submitted and not waited for")
        for q in self._ins:
            q.put((fn, args, kwargs))
        self._job = getattr(fn, "__name__", repr(fn))

    def wait(self, timeout: float = 120.0, expect_errors: bool = False) -> list:
        """Each rank's value in rank order. A rank that raised or died is a RankError: raised
        together with the others' (type, message, traceback) unless expect_errors, when it is
        returned in the dead or failed rank's place beside the survivors' values."""
        job, self._job = self._job, None
        results: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        while len(results) < self.world_size:
            try:
                rank, ok, value = self._out.get(timeout=0.2)
            except queue.Empty:
                # a rank that died reports nothing; the pool cannot run another job after that
                for r, p in enumerate(self._procs):
                    if r not in results and p.exitcode is not None:
                        results[r] = RankError(r, "died", f"exit code {p.exitcode}", "")
                        self.alive = False
                if time.monotonic() > deadline and len(results) < self.world_size:
                    missing = sorted(set(range(self.world_size)) - set(results))
                    self.close()
                    raise TimeoutError(f"{job}: ranks {missing} did not finish within "
                                       f"{timeout:.0f} s; finished: {results}") from None
                continue
            results[rank] = _unpack(value) if ok else RankError(rank, *value)
        out = [results[r] for r in range(self.world_size)]
        errors = [r for r in out if isinstance(r, RankError)]
        if errors and not expect_errors:
            raise RuntimeError(f"{job}:\n" + "\n".join(f"{e}\n{e.tb}" for e in errors))
        return out

    def run(self, fn, *args, timeout: float = 120.0, expect_errors: bool = False, **kwargs) -> list:
        """fn(rank, world_size, *args, **kwargs) on every rank: wait()'s list."""
        self.submit(fn, *args, **kwargs)
        return self.wait(timeout, expect_errors)

    def close(self):
        if self._closed:
            return
        self._closed, self.alive = True, False
        for r, q in enumerate(self._ins):
            if self._procs[r].exitcode is None:
                q.put(None)
        # after a rank died the survivors' group teardown can only time out: 1 s, then kill
        grace = 1 if any(p.exitcode not in (None, 0) for p in self._procs) else 5
        for p in self._procs:
            p.join(timeout=grace)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0, pg_timeout: float = 30.0,
              expect_errors: bool = False, start_method: str | None = None, **kwargs) -> list:
    """fn(rank, world_size, *args, **kwargs) on `world_size` fresh ranks; a list per rank."""
    with RankPool(world_size, pg_timeout, start_method) as pool:
        return pool.run(fn, *args, timeout=timeout, expect_errors=expect_errors, **kwargs)


def value_error_text(fn) -> str:
    """The message of the ValueError fn() raises, or "no error" (ranks report it for checking)."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


def error_of(fn) -> tuple[str, str]:
    """(the exception's type name, its message) if fn() raises ValueError or TypeError, else
    ("no error", ""): ranks report bad input's errors for the test to check."""
    try:
        fn()
    except (ValueError, TypeError) as e:
        return type(e).__name__, str(e)
    return "no error", ""


def job_step(job, step: int, overflow: bool = False) -> dict:
    """job.train_step(step), with the loss times 1e30 on this rank when `overflow` (fp16's
    scaled gradients overflow here only: the mesh must skip together); loss_fn put back after."""
    orig = job.loss_fn
    if overflow:
        job.loss_fn = lambda logits, target: orig(logits, target) * 1e30
    try:
        return job.train_step(step)
    finally:
        job.loss_fn = orig
