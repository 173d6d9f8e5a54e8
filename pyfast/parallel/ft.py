"""pyfast under torchft: per-step fault tolerance, the replica dimension torchft's.

A replica group is the failure domain: one pyfast mesh (DataParallel, ZeRO, tp, pp inside it)
launched on its own (torchrun or `pyfast train --nproc`), with its own rendezvous store.
torchft's lighthouse (a separate server, `torchft_lighthouse --min_replicas M`) forms a quorum of
the live replica groups at every step; the survivors of a failure keep stepping, and a group
that (re)joins heals by copying a live peer's state. `Replicas` is the one place pyfast meets
torchft's Manager; DataParallel, ZeRO and DiLoCo reduce through it, the job only wires flags.

Per step, on every rank of every replica group:

    replicas.start()            # quorum (sync): heals this group first if it is behind
    ... forward, backward; reductions over replicas.group, averaged over replicas.participants
    if replicas.commit():       # torchft's should_commit: every rank of every group agreed
        optimizer.step()        # stateful reducers keep this step's memory (commit hooks)
    else: ...                   # nothing moves; the reducers' memory rolls back (rollback hooks)

- `group` is the quorum's process group across replicas: this rank with the same-ranked rank of
  every other participating group (torchft's pairing: its rank in the quorum, its size the
  participants). It is registered with torch.distributed (the c10d tables that new_group
  fills), so every pyfast collective -- compressed all-reduce, reduce-scatter, all-gather --
  runs on it unchanged; a reconfiguration unregisters the old one.
- A failed collective on `group` (a peer died mid-step: gloo says "Connection reset by peer"
  within ~30 ms, a silent peer after `timeout`) is reported to torchft (`report`), not raised:
  the step does not commit in any group whose reduction failed, the next quorum drops the dead
  group. torchft's commit is per replica group: a group that reports an error of its own while
  the others' reductions succeed is the only one not to commit; it is then a step behind and
  heals from a peer at the next quorum (tests/test_ft.py).
- What a healing group receives is what was `register`ed (name -> state_dict / load_state_dict):
  torchft's checkpoint transport (HTTP) carries it at the quorum that admits the group.

The quorum runs synchronously (torchft's use_async_quorum=False): a healing group then loads
the peer's state before its forward and takes part in the very step it joins, so every step
averages the groups that computed on identical parameters. torchft's asynchronous quorum
(overlapped with the forward) would hide its ~1-5 ms on loopback at the price of a healing
group sitting one step out; not offered.
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from typing import Callable
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

log = logging.getLogger(__name__)


class FTError(RuntimeError):
    """Fault tolerance cannot run: torchft missing, the lighthouse unreachable, no quorum in
    time (names how many groups were needed and which joined), a reducer that cannot abort."""


def lighthouse_address(addr: str) -> tuple[str, str, int]:
    """"HOST:PORT" or "http://HOST:PORT" -> (torchft's URL, host, port); FTError otherwise."""
    url = addr if "://" in addr else f"http://{addr}"
    u = urlparse(url)
    if not u.hostname or not u.port:
        raise FTError(f"--lighthouse {addr!r}: expected HOST:PORT (torchft_lighthouse's "
                      "--bind address, e.g. localhost:29510)")
    return f"{u.scheme}://{u.hostname}:{u.port}", u.hostname, u.port


def check_reachable(addr: str, timeout: float = 5.0) -> None:
    """FTError within `timeout` seconds if nothing listens at the lighthouse's address: torchft
    itself would retry its connection for connect_timeout and then fail deep in a quorum."""
    _, host, port = lighthouse_address(addr)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        raise FTError(f"torchft lighthouse at {addr} unreachable ({e.__class__.__name__}: {e}); "
                      "start it first: torchft_lighthouse --min_replicas M --bind [::]:PORT") \
            from e


def _adopt(pg, name: str) -> None:
    """Register a quorum's process group with torch.distributed's tables, as new_group does
    for its groups, so dist.get_rank(pg) / get_world_size / the collectives work on it. The
    global-rank map holds this process only: the quorum spans other jobs' processes, which
    have no rank in this job's default group."""
    w = c10d._world
    w.pg_group_ranks[pg] = {dist.get_rank(): pg.rank()}
    backend = _backend_name(pg)
    w.pg_map[pg] = (backend, None)
    w.pg_names[pg] = name
    w.pg_backend_config[pg] = "cuda:nccl" if backend == "nccl" else "cpu:gloo,cuda:gloo"


def _backend_name(pg) -> str:
    """"nccl" when the quorum's group carries CUDA tensors over NCCL, else "gloo"."""
    if not torch.cuda.is_available():
        return "gloo"
    try:
        return pg._get_backend(torch.device("cuda")).name().lower()
    except (RuntimeError, AttributeError):
        return "gloo"


def _forget(pg) -> None:
    w = c10d._world
    for table in (w.pg_group_ranks, w.pg_map, w.pg_names, w.pg_backend_config):
        table.pop(pg, None)


class Replicas:
    """This rank's view of the replica dimension, through a torchft Manager (module docstring).

    lighthouse: "HOST:PORT" of a running torchft_lighthouse. replica_id: this group's id (every
    group its own; a restarted group comes back under the same id). min_replicas: the fewest
    groups a step may commit with (torchft's min_replica_size). group: this replica group's own
    process group (default: the default group: one job per replica group); its rank and size are
    torchft's group rank and group world size, and its rendezvous store (MASTER_ADDR /
    MASTER_PORT) carries torchft's per-quorum stores. device: where the reductions run: CUDA
    tensors go through torchft's reconfigurable NCCL group, CPU tensors through gloo.
    timeout: seconds a collective or a commit vote may take (a silent peer is dropped after it);
    quorum_timeout: seconds to wait for min_replicas groups (progress is logged every
    `progress_s`); connect_timeout: seconds to reach the lighthouse and peers.
    """

    def __init__(self, lighthouse: str, replica_id, min_replicas: int = 1, group=None,
                 device: torch.device | str = "cpu",  # cpu-literal: the job passes its device
                 timeout: float = 30.0,
                 quorum_timeout: float = 120.0, connect_timeout: float = 10.0,
                 progress_s: float = 10.0):
        try:
            from torchft.manager import Manager
            from torchft import process_group as ftpg
        except ImportError as e:
            raise FTError("per-step fault tolerance needs torchft (pip install torchft)") from e
        if not dist.is_initialized():
            raise FTError("Replicas needs torch.distributed initialized for the replica group "
                          "(its rendezvous store carries torchft's)")
        if int(min_replicas) < 1:
            raise FTError(f"min_replicas must be >= 1, got {min_replicas}")
        url, _, _ = lighthouse_address(lighthouse)
        if dist.get_rank(group) == 0:  # only group rank 0 talks to the lighthouse
            check_reachable(lighthouse, min(connect_timeout, 5.0))
        self.device = torch.device(device)
        self.min_replicas, self.replica_id = int(min_replicas), str(replica_id)
        self.quorum_timeout, self.progress_s = float(quorum_timeout), float(progress_s)
        td = datetime.timedelta
        self._pg = (ftpg.ProcessGroupNCCL(timeout=td(seconds=timeout)) if self.device.type == "cuda"
                    else ftpg.ProcessGroupGloo(timeout=td(seconds=timeout)))
        self.manager = Manager(
            pg=self._pg, load_state_dict=None, state_dict=None,
            min_replica_size=self.min_replicas, use_async_quorum=False,
            timeout=td(seconds=timeout), quorum_timeout=td(seconds=quorum_timeout),
            connect_timeout=td(seconds=connect_timeout),
            rank=dist.get_rank(group), world_size=dist.get_world_size(group),
            lighthouse_addr=url, replica_id=self.replica_id,
            # every group builds its model from the same seed: no step-0 broadcast needed
            init_sync=False)
        self._group, self._quorum = None, -1
        self._hooks: list[tuple[Callable[[], None], Callable[[], None]]] = []
        self.errors: list[str] = []
        self.quorum_s = 0.0  # the last start()'s seconds (quorum + any healing)

    # -- state a healing group receives ------------------------------------------------------
    def register(self, name: str, state_dict: Callable[[], object],
                 load_state_dict: Callable[[object], None]) -> None:
        """`name`'s state travels to a healing group (torchft's register_state_dict_fn)."""
        self.manager.register_state_dict_fn(name, load_state_dict, state_dict)

    def on_commit(self, commit: Callable[[], None], rollback: Callable[[], None]) -> None:
        """Hooks run by commit(): `commit` when the step commits, `rollback` when it does not
        (a reducer's error-feedback memory, PowerSGD's Q, DiLoCo's outer state)."""
        self._hooks.append((commit, rollback))

    # -- the step ------------------------------------------------------------------------------
    def start(self) -> None:
        """A quorum for this step (and healing, when this group is behind). FTError if
        min_replicas groups did not join within quorum_timeout."""
        t0 = time.perf_counter()
        done = threading.Event()

        def progress():  # torchft's wait is one blocking call: say from a thread that it waits
            while not done.wait(self.progress_s):
                log.warning("replica group %s: waiting for a quorum of %d replica group(s) "
                            "(%.0f s of %.0f s)", self.replica_id, self.min_replicas,
                            time.perf_counter() - t0, self.quorum_timeout)
        threading.Thread(target=progress, daemon=True).start()
        try:
            # one call: a failed start_quorum leaves its error in torchft's future, re-raised
            # by every later start_quorum, so it cannot be retried in slices
            self.manager.start_quorum(timeout=datetime.timedelta(seconds=self.quorum_timeout))
        except Exception as e:  # torchft raises its Rust client's TimeoutError
            if "timeout" not in f"{type(e).__name__} {e} {e.__cause__}".lower():
                raise
            raise FTError(
                f"replica group {self.replica_id}: no quorum of {self.min_replicas} replica "
                f"group(s) within {self.quorum_timeout:.0f} s: fewer groups than min_replicas "
                "reached the lighthouse") from e
        finally:
            done.set()
        if self.manager._quorum_id != self._quorum or self._group is not self._pg._pg:
            self._reconfigured()
        self.quorum_s = time.perf_counter() - t0

    def _reconfigured(self) -> None:
        if self._group is not None:
            _forget(self._group)
        self._group, self._quorum = self._pg._pg, self.manager._quorum_id
        if self._group is not None:
            _adopt(self._group, f"torchft_quorum_{self._quorum}_{self.replica_id}")

    @property
    def group(self):
        """The quorum's process group across replica groups (registered with torch.distributed)."""
        if self._group is None:
            raise FTError("no quorum yet: call start() first")
        return self._group

    @property
    def participants(self) -> int:
        """Replica groups taking part in this step: the divisor of every average."""
        return self.manager.num_participants()

    @property
    def participating(self) -> bool:
        return self.manager.is_participating()

    @property
    def step(self) -> int:
        """torchft's count of committed steps (restored on heal)."""
        return self.manager.current_step()

    def report(self, e: BaseException) -> None:
        """A collective on `group` failed: this group's step will not commit (torchft's
        report_error; the other groups commit if their own reductions succeeded)."""
        self.errors.append(f"{e.__class__.__name__}: {e}")
        log.warning("replica group %s: step %d aborted: %s", self.replica_id, self.step, e)
        self.manager.report_error(e if isinstance(e, Exception) else RuntimeError(str(e)))

    def errored(self) -> bool:
        return self.manager.errored() is not None

    def average_(self, t: torch.Tensor, compressor=None, name: str = "") -> torch.Tensor:
        """t <- the mean of t over the participating groups, through `compressor` (pyfast's
        compressed all-reduce on `group`); a failure is reported, not raised (t is then
        garbage, and the step will not commit)."""
        from pyfast.comm import all_reduce
        if not self.participating:
            t.zero_()
        if self.errored():
            return t
        try:
            all_reduce(t, compressor, group=self.group, op="sum", name=name)
        except Exception as e:  # noqa: BLE001 - any failure of the peers' side aborts the step
            self.report(e)
            return t
        return t.div_(self.participants)

    def commit(self) -> bool:
        """torchft's should_commit (every rank of every participating group votes), then the
        commit or rollback hooks. The optimizer may step only on True."""
        ok = self.manager.should_commit()
        for commit, rollback in self._hooks:
            (commit if ok else rollback)()
        return ok

    def close(self) -> None:
        if self._group is not None:
            _forget(self._group)
            self._group = None
        self.manager.shutdown(wait=False)


def quiet_torchft() -> None:
    """torchft logs every quorum and commit at INFO from Rust and Python (~10 lines a step):
    keep warnings only unless the user set RUST_LOG."""
    os.environ.setdefault("RUST_LOG", "warn")
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.WARNING)
