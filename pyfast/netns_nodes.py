"""Two emulated nodes on one host: the topology behind `pyfast.netns.ranks(..., nodes=2)`.

    node A (namespace)                       node B (namespace)
    lo up, unshaped                          lo up, unshaped
    pfnode 10.77.0.1/24 --- veth pair --- pfnode 10.77.0.2/24
    egress tbf at `rate`                     egress tbf at `rate`

The ranks of a node run in its namespace and gloo binds to the node's veth address
(GLOO_SOCKET_IFNAME=pfnode). Two ranks of one node then talk from 10.77.0.1 to 10.77.0.1: the
kernel routes a local address over lo (the `local` table), so in-node traffic never touches the
veth nor its qdisc and moves at loopback speed. Traffic between nodes leaves through one veth
end and arrives at the other. Unlike netns.namespace()'s shaped lo (both directions through one
qdisc), each veth end shapes its own egress: the link is full duplex, `rate` bits/s each way,
as a NIC is, so a transfer's floor is max(bytes A->B, bytes B->A) / rate.

The veth keeps Ethernet's 1500-byte MTU (a node's NIC, not lo's 65536); GSO still hands the
qdisc segments of up to 64 KB, so netns's 512 KB burst (several of them) and 100 ms of queue
(no drops at 1 Gbit/s) hold here for the same reasons. Both namespaces are fresh, so the fixed
subnet and names cannot collide with another run's (each pair sees only itself).

It imports nothing of pyfast: pyfast.netns (the launcher) calls pair() with its own step runner,
which raises netns.LinkUnavailable when a command fails.
"""
from __future__ import annotations

import contextlib
import secrets
import subprocess

IFNAME = "pfnode"          # the veth end in every node namespace (GLOO_SOCKET_IFNAME)
SUBNET = "10.77.0"         # node i is SUBNET.(i+1)/24
IP, TC = "ip", "tc"


def address(node: int) -> str:
    return f"{SUBNET}.{node + 1}"


def layout(world: int, nodes: int) -> list[int]:
    """The node of each rank: contiguous blocks, as torchrun numbers ranks (RANK = GROUP_RANK x
    LOCAL_WORLD_SIZE + LOCAL_RANK)."""
    if nodes != 2:
        raise ValueError(f"nodes={nodes}: the emulation joins exactly 2 namespaces by one veth "
                         "pair (more nodes would need a bridge)")
    if world < nodes or world % nodes:
        raise ValueError(f"world {world} does not split into {nodes} nodes of equal size")
    per = world // nodes
    return [r // per for r in range(world)]


@contextlib.contextmanager
def pair(prefix: str, rate: str | None, burst: str, latency: str, step, delete):
    """Two namespaces named `prefix`<hex>-a / -b joined as drawn above (`rate` None: the veth is
    not shaped). `step(*argv)` runs one setup command and raises on failure; `delete(name)`
    removes a namespace. Yields the two names; both are deleted on every exit path (deleting a
    namespace also deletes its veth end, and with it the pair)."""
    tag = f"{prefix}{secrets.token_hex(4)}"
    names = [f"{tag}-a", f"{tag}-b"]
    made = []
    try:
        for n in names:
            step(IP, "netns", "add", n)
            made.append(n)
        step(IP, "link", "add", IFNAME, "netns", names[0], "type", "veth", "peer", "name", IFNAME,
             "netns", names[1])
        for i, n in enumerate(names):
            step(IP, "-n", n, "link", "set", "lo", "up")
            step(IP, "-n", n, "addr", "add", f"{address(i)}/24", "dev", IFNAME)
            step(IP, "-n", n, "link", "set", IFNAME, "up")
            if rate is not None:
                step(IP, "netns", "exec", n, TC, "qdisc", "add", "dev", IFNAME, "root", "tbf",
                     "rate", rate, "burst", burst, "latency", latency)
        yield names
    finally:
        for n in made:
            delete(n)


def tx_bytes(name: str | None = None, iface: str = IFNAME) -> int:
    """Bytes sent on `iface` of namespace `name`, or of this process's own namespace
    (/proc/net/dev, like /sys/class/net/*/statistics, is per namespace). On the veth, what
    node A sends is what crosses to B: the cross-node bytes are the two ends' tx summed."""
    if name is None:
        with open("/proc/net/dev") as f:
            text = f.read()
    else:
        text = subprocess.run([IP, "netns", "exec", name, "cat", "/proc/net/dev"],
                              capture_output=True, text=True, timeout=20).stdout
    for line in text.splitlines():
        dev, _, data = line.partition(":")
        if dev.strip() == iface:
            return int(data.split()[8])
    raise RuntimeError(f"no {iface} in /proc/net/dev of namespace {name or '(own)'}")
