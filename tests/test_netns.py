"""The emulated-link harness (pyfast.benchmarks.netns): every namespace it makes is removed on
every exit path, the tbf rate limit is real, and a machine that cannot emulate links says why
instead of quietly measuring plain loopback."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from pyfast.benchmarks import netns

WHY = netns.unavailable()
needs_netns = pytest.mark.skipif(WHY is not None, reason=WHY or "")
PREFIX = "emulated links need root and iproute2 (ip netns, tc tbf): "

# Sends N bytes over TCP on 127.0.0.1; prints the seconds and the growth of this namespace's
# lo tx counter (read the way a rank reads it: /proc/net/dev of its own namespace).
SEND = r"""
import socket, sys, threading, time
from pyfast.benchmarks.netns import lo_tx_bytes
n, got = int(sys.argv[1]), []
srv = socket.create_server(("127.0.0.1", 0))
def rx():
    c, _ = srv.accept()
    total = 0
    while (b := c.recv(1 << 20)):
        total += len(b)
    got.append(total)
th = threading.Thread(target=rx)
th.start()
lo0, t0 = lo_tx_bytes(), time.perf_counter()
with socket.create_connection(srv.getsockname()) as s:
    s.sendall(b"x" * n)
th.join(30)
print(time.perf_counter() - t0, lo_tx_bytes() - lo0, got[0])
"""


def test_rate_strings():
    assert netns.rate_bps("loopback") is None
    assert netns.rate_bps("1gbit") == 1e9 and netns.rate_bps("10gbit") == 1e10
    assert netns.rate_bps("500mbit") == 5e8 and netns.rate_bps("100mbps") == 8e8
    assert netns.rate_bps("1gibit") == 2 ** 30
    for bad in ("1 gig", "fast", "gbit", "-1gbit", "0gbit"):
        with pytest.raises(ValueError, match="link"):
            netns.rate_bps(bad)


@needs_netns
def test_namespace_is_shaped_then_removed_even_on_error():
    with pytest.raises(RuntimeError, match="boom"):
        with netns.namespace("1gbit") as name:
            assert name in netns.ours()
            q = subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "show", "dev", "lo"],
                               capture_output=True, text=True, timeout=20).stdout
            assert "tbf" in q and "rate 1Gbit" in q, q
            raise RuntimeError("boom")
    assert name not in netns._namespaces()


@needs_netns
def test_parallel_namespaces_get_distinct_names():
    with netns.namespace("1gbit") as a, netns.namespace("10gbit") as b:
        assert a != b and {a, b} <= set(netns.ours())
    assert netns.ours() == []


@needs_netns
def test_failing_command_timeout_and_failing_ranks_leave_no_namespace():
    r = netns.run([sys.executable, "-c", "import sys; sys.exit(3)"], link="1gbit", timeout=60)
    assert r.returncode == 3
    with pytest.raises(subprocess.TimeoutExpired):
        netns.run(["sleep", "30"], link="1gbit", timeout=1)  # the group is killed at 1 s
    with pytest.raises(RuntimeError, match=r"(?s)exit codes \[0, 1\]\nrank 1 \(exit 1\):\nrank 1 failed"):
        netns.run_ranks(["-c", "import os, sys; r = os.environ['RANK']; "
                         "sys.exit(r == '1' and 'rank 1 failed')"], 2, link="1gbit", timeout=60)
    assert netns.ours() == []


@needs_netns
def test_ranks_see_torchrun_env_and_their_namespace():
    out = netns.run([sys.executable, "-c", "import os; print(os.environ.get('PYFAST_NETNS', ''))"],
                    link="1gbit", timeout=60)
    assert out.stdout.strip() == ""  # run() is a plain command: no rank env
    netns.run_ranks(["-c", "import os, sys; e = os.environ; "
                     "sys.exit(not (e['PYFAST_NETNS'].startswith('pyfast-') and "
                     "e['MASTER_ADDR'] == '127.0.0.1' and e['WORLD_SIZE'] == '3'))"],
                    3, link="10gbit", timeout=60)


@needs_netns
def test_setup_failure_is_clear_and_cleaned_up(monkeypatch):
    monkeypatch.setattr(netns, "BURST", "not-a-size")  # tc refuses after the namespace exists
    with pytest.raises(netns.LinkUnavailable, match=r"^emulated links need root.*tc qdisc add"):
        with netns.namespace("1gbit"):
            pass
    assert netns.ours() == []


@needs_netns
def test_rate_limit_is_real():
    n = 32 << 20
    with netns.namespace("1gbit") as name:
        lo0 = netns.lo_tx_bytes(name)
        r = subprocess.run(["ip", "netns", "exec", name, sys.executable, "-c", SEND, str(n)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        outside = netns.lo_tx_bytes(name) - lo0
    secs, inside, got = (float(v) for v in r.stdout.split())
    # tbf starts with a full 512 KB bucket; everything after it waits for tokens
    assert secs >= (n - 512 * 1024) * 8 / 1e9, secs  # 0.537 s measured for 64 MB
    assert secs < 5 * n * 8 / 1e9, f"{secs:.2f} s: 1gbit should not be this slow"
    assert got == n and n <= inside <= outside < 1.01 * n  # TCP/IP headers: ~0.1% at 64 KB MTU


def test_not_root_is_a_clear_skip(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert netns.unavailable() == PREFIX + "running as uid 1000, not root"
    with pytest.raises(netns.LinkUnavailable, match="^" + PREFIX.replace("(", r"\(")
                       .replace(")", r"\)")):
        netns.run(["true"], link="1gbit")
    with pytest.raises(netns.LinkUnavailable, match="running as uid 1000, not root"):
        netns.run_ranks(["-c", "pass"], 4, "1gbit", nodes=2)  # two nodes need namespaces too
    assert netns.run(["true"], link="loopback").returncode == 0  # plain loopback needs nothing


def test_missing_tc_is_a_clear_skip(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns, "TC", "no-such-tc")
    assert netns.unavailable() == PREFIX + "no-such-tc not found on PATH"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root to drop to uid 65534 with setpriv")
def test_really_unprivileged_process_gets_the_message():
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        sys.executable, "-c", "from pyfast.benchmarks import netns; "
                        "print(netns.unavailable())"], capture_output=True, text=True, timeout=60,
                       cwd="/")
    if r.returncode != 0:
        pytest.skip(f"uid 65534 cannot import pyfast here: {r.stderr.strip()[-200:]}")
    assert r.stdout.strip() == PREFIX + "running as uid 65534, not root"


@needs_netns
@pytest.mark.parametrize("nodes", [None, 2])  # one namespace; two node namespaces and a veth
def test_ctrl_c_kills_the_ranks_and_removes_the_namespace(nodes):
    token = f"pyfastctrlc{os.getpid()}x{time.monotonic_ns()}"  # finds only this test's ranks
    code = ("import os; from pyfast.benchmarks import netns; print('go', flush=True); "
            "netns.run_ranks(['-c', 'import time; time.sleep(60)  # ' + os.environ['TOKEN']], "
            f"2, link='1gbit', timeout=120, nodes={nodes})")  # the token: the ranks' argv only
    # the launcher as a terminal starts it: SIGINT neither ignored nor blocked, whatever an
    # earlier test left in this process (both are inherited across exec)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "TOKEN": token}, preexec_fn=_default_sigint)
    try:
        assert p.stdout.readline().strip() == "go"
        deadline = time.monotonic() + 30
        while not [n for n in netns._namespaces() if n.startswith(f"pyfast-{p.pid}-")]:
            assert time.monotonic() < deadline, "the namespace never appeared"
            time.sleep(0.05)
        while len(_pids(token)) < 2:  # both ranks are sleeping inside it
            assert time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the launcher ignored Ctrl-C for 60 s; {_signals(p.pid)}") from None
    finally:
        p.kill()
    assert not [n for n in netns._namespaces() if n.startswith(f"pyfast-{p.pid}-")]
    assert not _pids(token), f"ranks outlived Ctrl-C: {_pids(token)}"


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _signals(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return " ".join(ln.strip() for ln in f if ln.startswith(("SigBlk", "SigIgn", "SigCgt")))
    except OSError as e:
        return str(e)


def _pids(token: str) -> list[str]:
    return subprocess.run(["pgrep", "-f", token], capture_output=True, text=True).stdout.split()


# Two emulated nodes: rank 0 (node A) receives N bytes from rank 1 (node A) and from rank 2
# (node B) over TCP on the nodes' veth addresses, one sender after the other (rank 0 tells
# rank 2 to start once rank 1's bytes are in). Each sender writes (seconds, its node's veth tx
# growth, its env) to OUT/<rank>; rank 3 (node B) only checks its env.
NODES = r"""
import json, os, socket, sys, time
from pyfast.netns_nodes import tx_bytes
n, out, e = int(sys.argv[1]), sys.argv[2], os.environ
rank, host, B = int(e["RANK"]), e["MASTER_ADDR"], "10.77.0.2"  # node A's and node B's address
env = {k: e[k] for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GLOO_SOCKET_IFNAME",
                         "MASTER_ADDR", "PYFAST_NETNS", "PYFAST_NODES")}
def connect(addr, port):  # the listener is another process: retry until it is up (<= 10 s)
    deadline = time.monotonic() + 10
    while True:
        try:
            return socket.create_connection((addr, port))
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
res = {"env": env}
if rank == 0:
    srv = socket.create_server((host, 29511))
    got = []
    for peer in (1, 2):
        if peer == 2:
            connect(B, 29512).close()  # rank 1 is done: rank 2 may start
        c, addr = srv.accept()
        total = 0
        while (b := c.recv(1 << 20)):
            total += len(b)
        got.append((addr[0], total))
    res["got"] = got
elif rank in (1, 2):
    if rank == 2:
        socket.create_server((B, 29512)).accept()
    tx0, t0 = tx_bytes(), time.perf_counter()
    with connect(host, 29511) as s:
        s.sendall(b"x" * n)
        s.shutdown(socket.SHUT_WR)
        s.recv(1)  # rank 0 closes after reading everything: the bytes have arrived
    res.update(s=time.perf_counter() - t0, tx=tx_bytes() - tx0)
with open(os.path.join(out, str(rank)), "w") as f:
    json.dump(res, f)
"""


@needs_netns
def test_two_nodes_route_in_node_off_the_link_and_cross_node_through_it(tmp_path):
    n, rate = 8 << 20, "200mbit"
    netns.run_ranks(["-c", NODES, str(n), str(tmp_path)], 4, rate, timeout=60, nodes=2)
    assert netns.ours() == []  # both namespaces (and the veth pair with them) are gone
    res = [__import__("json").loads((tmp_path / str(r)).read_text()) for r in range(4)]
    envs = [r["env"] for r in res]
    assert [(e["GROUP_RANK"], e["LOCAL_RANK"]) for e in envs] == \
        [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"} and {e["PYFAST_NODES"] for e in envs} == {"2"}
    assert {e["MASTER_ADDR"] for e in envs} == {"10.77.0.1"}
    assert {e["GLOO_SOCKET_IFNAME"] for e in envs} == {"pfnode"}
    a, b = envs[0]["PYFAST_NETNS"], envs[2]["PYFAST_NETNS"]
    assert a != b and envs[1]["PYFAST_NETNS"] == a and envs[3]["PYFAST_NETNS"] == b
    assert res[0]["got"] == [["10.77.0.1", n], ["10.77.0.2", n]]  # by address: which node
    inside, across = res[1], res[2]
    # in-node: none of the 8 MB on the veth (node A's tx: at most ACKs of rank 2's bytes and
    # the go-ahead, a few KB), so not shaped
    assert inside["tx"] < 0.01 * n, inside
    # cross-node: every byte through B's veth, with TCP/IP headers (66 of 1448 payload bytes a
    # 1500-byte frame, 4.6%), and not faster than tbf allows after its 512 KB burst
    assert n <= across["tx"] < 1.06 * n, across
    assert across["s"] >= (n - netns.BURST_BYTES) * 8 / netns.rate_bps(rate), across


@needs_netns
def test_two_nodes_bad_layouts_and_failures_leave_nothing(monkeypatch):
    with pytest.raises(ValueError, match="world 3 does not split into 2 nodes"):
        netns.run_ranks(["-c", "pass"], 3, "1gbit", timeout=60, nodes=2)
    with pytest.raises(ValueError, match="nodes=3: the emulation joins exactly 2"):
        netns.run_ranks(["-c", "pass"], 6, "1gbit", timeout=60, nodes=3)
    with pytest.raises(RuntimeError, match=r"rank 3 \(exit 1\):\nrank 3 failed"):
        netns.run_ranks(["-c", "import os, sys; sys.exit(os.environ['RANK'] == '3' and "
                         "'rank 3 failed')"], 4, "1gbit", timeout=60, nodes=2)
    assert netns.ours() == []
    monkeypatch.setattr(netns, "BURST", "not-a-size")  # tc refuses after both namespaces exist
    with pytest.raises(netns.LinkUnavailable, match=r"^emulated links need root.*tc qdisc add"):
        netns.run_ranks(["-c", "pass"], 2, "1gbit", timeout=60, nodes=2)
    assert netns.ours() == []
