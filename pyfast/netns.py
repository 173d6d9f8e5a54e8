"""Emulated slow links: run a command, or N ranks of a Python entry point, inside a network
namespace whose loopback is rate-limited by `tc ... tbf`.

    with namespace("1gbit") as name: ...          # ip netns add; lo up; tbf; always deleted
    run(["python", "x.py"], link="1gbit")         # one command inside a fresh namespace
    run_ranks(["-m", "mod"], world=2, link="1gbit")  # torchrun-style env, 127.0.0.1
    with ranks(["-m", "mod"], 2, only=[1]) as launch: ...   # rank 0 in this process
    with pool(2) as p: p.call(fn, *args)          # live ranks that run functions on request
    run_ranks(["-m", "mod"], 4, "1gbit", nodes=2)  # 2 nodes of 2 ranks, 1gbit between them

Both directions of every connection cross the one qdisc on lo, so a link moves at most `rate`
bits/s in total: the floor of a collective is (bytes sent by all ranks) / rate. Only loopback
traffic and only namespaces made here are touched; a namespace is deleted on every exit path
(error, timeout, Ctrl-C). Where emulation cannot run (not root, no iproute2), LinkUnavailable
says why: callers skip, never silently fall back to plain loopback.

It imports nothing of pyfast: the benchmarks, the ablations and the planner's link probe all
launch ranks through it (DESIGN.md: the one rank launcher for tests and benchmarks).
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import importlib
import os
import pickle
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from pyfast import _forked, netns_nodes

LINKS = ("loopback", "10gbit", "1gbit")  # "loopback": no namespace; else any tc rate string
IP, TC = "ip", "tc"
# 512 KB of burst: enough for the 64 KB segments of lo's 65536 MTU; 100 ms of queue before
# tbf drops (drops would turn a bandwidth test into a TCP-retransmit test).
BURST, LATENCY = "512kb", "100ms"
BURST_BYTES = 512 * 1024  # tc sizes: "kb" is kilobytes of 1024 bytes (pyfast.plan.timing)
PREFIX = "pyfast-"
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
          "ki": 1024, "mi": 1024 ** 2, "gi": 1024 ** 3, "ti": 1024 ** 4}


class LinkUnavailable(RuntimeError):
    """Emulated links cannot run here; the message says why (callers turn it into a skip)."""


def rate_bps(link: str) -> float | None:
    """Bits per second of a tc rate string ("1gbit", "500mbit", "100mbps" = bytes/s),
    None for "loopback" (unlimited)."""
    if link == "loopback":
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]i?)?(bit|bps)", link.strip().lower())
    if m is None:
        raise ValueError(f"link {link!r} is not 'loopback' or a tc rate like 1gbit, 500mbit")
    bps = float(m[1]) * _UNITS[m[2] or ""] * (8 if m[3] == "bps" else 1)
    if bps <= 0:
        raise ValueError(f"link {link!r}: rate must be > 0")
    return bps


def unavailable() -> str | None:
    """Why emulated links cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return _msg(f"running as uid {os.geteuid()}, not root")
    missing = [t for t in (IP, TC) if shutil.which(t) is None]
    return _msg(f"{' and '.join(missing)} not found on PATH") if missing else None


def _msg(reason: str) -> str:
    return f"emulated links need root and iproute2 (ip netns, tc tbf): {reason}"


def _ip(*args: str, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)


def _namespaces() -> list[str]:
    out = _ip(IP, "netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def ours() -> list[str]:
    """Namespaces this process created and has not deleted yet (empty after every exit)."""
    return [n for n in _namespaces() if n.startswith(f"{PREFIX}{os.getpid()}-")]


@contextlib.contextmanager
def namespace(rate: str, burst: str | None = None):
    """A fresh namespace (its name is yielded) whose lo is up and shaped to `rate`, with a
    token bucket of `burst` bytes (at least one 64 KB lo segment; default BURST)."""
    rate_bps(rate)  # a bad rate is the caller's mistake: ValueError, not a skip
    why = unavailable()
    if why:
        raise LinkUnavailable(why)
    # pid + random suffix: parallel runs (and parallel tests) never collide
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    made = False
    try:
        steps = [(IP, "netns", "add", name),
                 (IP, "netns", "exec", name, IP, "link", "set", "lo", "up"),
                 (IP, "netns", "exec", name, TC, "qdisc", "add", "dev", "lo", "root", "tbf",
                  "rate", rate, "burst", burst or BURST, "latency", LATENCY)]
        for step in steps:
            r = _ip(*step)
            if r.returncode != 0:
                raise LinkUnavailable(_msg(f"`{' '.join(step)}` failed: {r.stderr.strip()}"))
            made = True
        yield name
    finally:
        if made:
            _ip(IP, "netns", "del", name)


@contextlib.contextmanager
def link_prefix(link: str, burst: str | None = None):
    """The argv prefix that puts a command on `link` ([] for plain loopback)."""
    if rate_bps(link) is None:
        yield []
    else:
        with namespace(link, burst) as name:
            yield [IP, "netns", "exec", name]


def lo_tx_bytes(name: str | None = None) -> int:
    """Bytes sent on lo of namespace `name`, or of this process's own namespace (/proc/net/dev
    is per namespace). On lo every byte sent is also received: count tx only."""
    if name is None:
        with open("/proc/net/dev") as f:
            text = f.read()
    else:
        text = _ip(IP, "netns", "exec", name, "cat", "/proc/net/dev").stdout
    for line in text.splitlines():
        iface, _, data = line.partition(":")
        if iface.strip() == "lo":
            return int(data.split()[8])
    raise RuntimeError("no lo in /proc/net/dev")


def _start(cmd, env=None, **kw) -> subprocess.Popen:
    # own session: a timeout or Ctrl-C kills the whole group, and the terminal's SIGINT does not
    # reach the ranks half-way through a collective
    return subprocess.Popen(cmd, env=env, start_new_session=True, **kw)


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)


def _wait(procs, timeout: float, what: str) -> None:
    """Wait for all; if one fails, the others cannot finish a collective: kill them."""
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                # let the rest print their own error first: up to 2 s, not once they all
                # exited (a survivor of a killed rank raises within ~0.05 s on loopback)
                end = time.monotonic() + 2
                while any(p.poll() is None for p in procs) and time.monotonic() < end:
                    time.sleep(0.02)
                break
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(what, timeout)
            time.sleep(0.05)
    finally:
        _kill(procs)


def run(cmd: list[str], link: str = "loopback", timeout: float = 600, env=None,
        capture: bool = True) -> subprocess.CompletedProcess:
    """cmd on `link`; its return code is the caller's to check. Raises TimeoutExpired (the
    process group is killed) or LinkUnavailable."""
    with link_prefix(link) as pre:
        pipe = subprocess.PIPE if capture else None
        p = _start(pre + list(cmd), env, stdout=pipe, stderr=pipe, text=True)
        try:
            out, err = p.communicate(timeout=timeout)
        finally:
            _kill([p])
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)


class Launch:
    """Rank processes started by ranks(): `store` is the rendezvous (None inside a namespace),
    init_process_group(rank) joins them from this process, wait() returns when all exit and
    raises with each failed rank's stderr tail, call() runs a function on ranks started by
    pool()."""

    def __init__(self, procs, logs, ranks, world, timeout, what, store):
        self.procs, self._logs, self._ranks, self.world = procs, logs, ranks, world
        self._timeout, self._what, self.store = timeout, what, store
        self._calls = 0

    def init_process_group(self, rank: int, timeout: float) -> None:
        """Join the launched ranks' default group as `rank` from this process (plain loopback)."""
        import datetime

        import torch.distributed as dist
        # the ranks' env:// rendezvous prefixes the keys of the default group; a store passed
        # in is used as it is
        dist.init_process_group("gloo", store=dist.PrefixStore("default_pg", self.store),
                                rank=rank, world_size=self.world,
                                timeout=datetime.timedelta(seconds=timeout))

    def wait(self) -> None:
        _wait(self.procs, self._timeout, self._what)
        codes = {r: p.returncode for r, p in zip(self._ranks, self.procs)}
        if any(codes.values()):
            tails = []
            for (r, code), log in zip(codes.items(), self._logs):
                if code:  # ranks killed after another failed show up too (-9)
                    log.seek(0)
                    tails.append(f"rank {r} (exit {code}):\n{log.read()[-3000:]}")
            raise RuntimeError(f"ranks failed, exit codes {list(codes.values())}\n" + "\n".join(tails))

    def call(self, fn, *args, timeout: float | None = None) -> list:
        """fn(*args) on every rank of a pool(), each rank's result in rank order. `fn` is a
        module-level function of an importable module (the ranks import it by name). A call
        that raised on some rank raises RuntimeError here with each such rank's error; a rank
        that died raises wait()'s error (every failed rank's stderr tail); both leave the pool
        unusable, as does a timeout (TimeoutError)."""
        i, self._calls = self._calls, self._calls + 1
        self._post(i, (fn.__module__, fn.__qualname__, args))
        keys = [f"{CALLS}/{i}/{r}" for r in self._ranks]
        limit = self._timeout if timeout is None else timeout
        done = threading.Event()
        watch = threading.Thread(target=self._answer_for_the_dead, args=(i, done), daemon=True)
        watch.start()
        try:  # one blocking wait: no polling, no CPU taken from the ranks
            self.store.wait(keys, datetime.timedelta(seconds=limit))
        except RuntimeError:  # DistStoreError
            raise TimeoutError(f"{fn.__qualname__}: ranks did not answer within {limit:.0f} s; "
                               f"answered: {[k for k in keys if self.store.check([k])]}") from None
        finally:
            done.set()
            watch.join()
        out = [pickle.loads(self.store.get(k)) for k in keys]
        if any(ok is None for ok, _ in out):
            self.wait()  # a rank died: raises with the stderr tails
        errors = [value for ok, value in out if not ok]
        if errors:
            raise RuntimeError(f"{fn.__qualname__}:\n" + "\n".join(errors))
        return [value for _, value in out]

    def _answer_for_the_dead(self, i: int, done: threading.Event) -> None:
        """While call i waits: once a rank has exited (a served rank exits only at the end),
        every rank yet to answer is answered (None, None), so the wait ends at once (the others
        may be stuck in a collective with the dead one). Its own store client: the waiting one
        is busy."""
        while not done.wait(0.2):
            if any(p.poll() is not None for p in self.procs):
                import torch.distributed as dist
                store = dist.TCPStore("127.0.0.1", self.store.port, is_master=False)
                for r in self._ranks:
                    if not store.check([f"{CALLS}/{i}/{r}"]):
                        store.set(f"{CALLS}/{i}/{r}", pickle.dumps((None, None)))
                return

    def _post(self, i: int, job) -> None:
        self.store.set(f"{CALLS}/{i}", pickle.dumps(job))


@contextlib.contextmanager
def _places(world: int, link: str, burst: str | None, nodes: int | None):
    """(argv prefix, env) of every rank: one namespace (or none) for all, or 2 nodes joined by
    a veth shaped to `link` each way ("loopback": unshaped; netns_nodes.pair)."""
    if nodes is None:
        with link_prefix(link, burst) as pre:
            yield [(pre, {"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo",
                          "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(world),
                          "GROUP_RANK": "0", "PYFAST_NETNS": pre[-1] if pre else ""})
                   for r in range(world)]
        return
    node, per, rate = netns_nodes.layout(world, nodes), world // nodes, rate_bps(link) and link
    if why := unavailable():
        raise LinkUnavailable(why)

    def step(*argv):
        if (r := _ip(*argv)).returncode != 0:
            raise LinkUnavailable(_msg(f"`{' '.join(argv)}` failed: {r.stderr.strip()}"))
    with netns_nodes.pair(f"{PREFIX}{os.getpid()}-", rate, burst or BURST, LATENCY, step,
                          lambda n: _ip(IP, "netns", "del", n)) as names:
        # rank 0 hosts the rendezvous on node A's veth address: reachable from both nodes
        yield [([IP, "netns", "exec", names[node[r]]],
                {"MASTER_ADDR": netns_nodes.address(0), "GLOO_SOCKET_IFNAME": netns_nodes.IFNAME,
                 "LOCAL_RANK": str(r % per), "LOCAL_WORLD_SIZE": str(per),
                 "GROUP_RANK": str(node[r]), "PYFAST_NETNS": names[node[r]],
                 "PYFAST_NODES": str(nodes)}) for r in range(world)]


@contextlib.contextmanager
def ranks(py_argv: list[str], world: int, link: str = "loopback", timeout: float = 600,
          env: dict | None = None, only: list[int] | None = None, burst: str | None = None,
          nodes: int | None = None, fork: bool = True):
    """The one launcher of the benchmarks: `python *py_argv` as ranks `only` (default: all) of
    `world` on `link`, with torchrun's env (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    GROUP_RANK, MASTER_ADDR=127.0.0.1, MASTER_PORT, one OpenMP thread) plus PYFAST_NETNS=<name>
    inside a namespace. Yields a Launch; every rank still running when the block ends is killed.

    nodes=2: 2 emulated nodes of world/2 contiguous ranks (netns_nodes), `link` between them;
    gloo on the node's veth address, MASTER_ADDR node A's, LOCAL_*, GROUP_RANK per node.

    Ports cannot race: on plain loopback this process hosts the rendezvous store on a port the
    kernel picked (torchrun's agent store: every rank connects as a client, and a rank run in
    this process joins with launch.init_process_group(rank)); a fresh namespace has every
    port free, so its ranks use 29500. `burst`: the token bucket (namespace()).

    fork: a `-c CODE` rank on plain loopback is forked from pyfast._forked's server, which
    imported torch once (PYFAST_RANKS_EXEC=1 or fork=False: a fresh interpreter, as in a
    namespace): the same environment and exit codes, its stderr in the same log, without the
    1.3-1.4 CPU s of interpreter start and torch import a rank (2-core VM). A forked rank's
    heap and RSS start from the server's, so the benchmarks that measure memory pass False
    (cp's peak of a 64 KB shard read 0 forked: the inherited heap served it)."""
    from datetime import timedelta
    only = list(range(world)) if only is None else list(only)
    with _places(world, link, burst, nodes) as places:
        store = None
        if not places[0][0]:
            import torch.distributed as dist
            store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=timeout))
        base = {**os.environ, **(env or {}), "WORLD_SIZE": str(world),
                "MASTER_PORT": str(store.port if store else 29500),
                "TORCHELASTIC_USE_AGENT_STORE": str(store is not None), "OMP_NUM_THREADS": "1"}
        base.pop("PYFAST_NODES", None)
        # plain loopback: forked from pyfast._forked's server (torch imported once), unless
        # PYFAST_RANKS_EXEC=1; a namespace's ranks start inside it (`ip netns exec`): exec'd
        forked = (fork and not any(places[r][0] for r in only) and len(py_argv) == 2
                  and py_argv[0] == "-c" and os.environ.get("PYFAST_RANKS_EXEC") != "1")
        logs = [tempfile.NamedTemporaryFile("w+") for _ in only]  # a forked rank opens its name
        procs = []
        try:
            for r, log in zip(only, logs):
                pre, mine = places[r]
                env_r = {**base, **mine, "RANK": str(r)}
                procs.append(_forked.Rank(py_argv[1], env_r, log.name) if forked else
                             _start(pre + [sys.executable, *py_argv], env_r, stderr=log))
            where = f"{nodes} nodes, {link} between" if nodes else link
            yield Launch(procs, logs, only, world, timeout,
                         f"{world} ranks of {' '.join(py_argv)} on {where}", store)
        finally:
            _kill(procs)
            for log in logs:
                log.close()


def finish_group() -> None:
    """A benchmark rank's last step (it ends the process): free what still holds the group,
    destroy it and exit at once (no barrier: a rank 0 that lives on in pytest joins none).
    torch DDP's and FSDP2's wrappers sit in reference cycles; freed at interpreter exit, after
    the group, their gloo work aborted the rank ("terminate called without an active
    exception") in 2 of 8 runs each of `pyfast bench zero`'s tiny case; collected first, 0 of
    20 and 0 of 16 here, yet CI saw it once more (rank 1 of the memory phase, after its results
    were in). So nothing runs after the group is gone: os._exit skips the interpreter's
    teardown, whose C++ destructors were the last suspects. Results are written before this
    is called (atomic_write_text); stdout and stderr are flushed first."""
    import torch.distributed as dist
    gc.collect()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


CALLS = "pyfast-calls"  # store keys of Launch.call: CALLS/<i> the job, CALLS/<i>/<rank> the answers


def serve(timeout: float) -> None:
    """The rank side of pool(): join the default group (env://, as every launched rank does),
    then run the jobs Launch.call posts on the launcher's store, one after another, answering
    (True, result) or (False, "rank r: <error>") and serving on after an error, until the job
    None. The process group is this rank's own to use (dist.get_rank(), collectives)."""
    import traceback

    import torch.distributed as dist
    td = datetime.timedelta(seconds=timeout)
    dist.init_process_group("gloo", timeout=td)
    rank = dist.get_rank()
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=td)
    i = 0
    while (job := pickle.loads(store.get(f"{CALLS}/{i}"))) is not None:
        module, name, args = job
        try:
            answer = (True, getattr(importlib.import_module(module), name)(*args))
        except Exception as e:  # noqa: BLE001  (the launcher raises it; this rank serves on)
            answer = (False, f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        store.set(f"{CALLS}/{i}/{rank}", pickle.dumps(answer))
        i += 1
    finish_group()


@contextlib.contextmanager
def pool(world: int, timeout: float = 600, env: dict | None = None):
    """`world` live ranks on plain loopback (ranks() running serve()) that run functions on
    request: yields the Launch, whose call(fn, *args) runs fn on every rank. At the end of the
    block the ranks are told to stop and waited for (an error names each failed rank)."""
    argv = ["-c", f"from pyfast.netns import serve; serve({float(timeout)!r})"]
    with ranks(argv, world, "loopback", timeout, env) as launch:
        try:
            yield launch
        finally:
            launch._post(launch._calls, None)
        launch.wait()


def run_ranks(py_argv: list[str], world: int, link: str = "loopback", timeout: float = 600,
              env: dict | None = None, nodes: int | None = None, fork: bool = True) -> None:
    """All `world` ranks of `python *py_argv` on `link` (ranks(); nodes=2: two emulated nodes
    joined by `link`), waited for. Raises RuntimeError with each rank's stderr tail if any rank
    fails, TimeoutExpired on timeout. fork: as ranks()."""
    with ranks(py_argv, world, link, timeout, env, nodes=nodes, fork=fork) as launch:
        launch.wait()
