"""What a rank that failed mid-step still owes its peers (p2p.py's failure protocol).

It sends the rest of its messages as failures: an error header where a header is due, a
FAILED message of the right size for each message after it, up to the first one whose size it
cannot know (an error header precedes that one, so the peer never waits for it). It also posts
the receives of what its peers may still send it: with `Peer.wait_sends` a healthy peer waits
in each send until the receive is posted, so a failing rank that stopped posting would leave
it waiting for the group's timeout instead of reading the failure that follows.

All of it in one order over the rank's peers, the step's message order (p2p.message_orders: a
run of the schedule): a receive whose size needs the activations' header is posted after
reading that header, which may mean waiting for the peer to send it. The peer sends it before
anything it needs from this rank later in that order (the schedule's run is causal), and this
rank has by then sent or posted everything earlier, so the wait ends: with the header, or with
an error header from a peer that failed in turn. What a peer will never send is left unposted
(its size unknowable, or the peer has failed); drain() then matches what is left either way.
"""
from __future__ import annotations

from .p2p import ACT, ACT_HEADER, GRAD, Peer


def settle(peers: list[Peer], message: str) -> None:
    """This rank failed (`message` says why): settle the step with every peer, in the step's
    message order (the module's docstring)."""
    due = sorted((peer.when[j], k, j) for k, peer in enumerate(peers)
                 for j in range(peer.next, len(peer.order)))
    mute, deaf = set(), set()  # peers this rank stopped sending to / posting from
    for _, k, j in due:
        peer = peers[k]
        sender = peer.order[j][0]
        if sender == peer.me and k not in mute and not _send(peer, j, message):
            mute.add(k)
        elif sender != peer.me and k not in deaf and not _post(peer, j):
            deaf.add(k)
    for peer in peers:
        peer.next = len(peer.order)


def _send(peer: Peer, j: int, message: str) -> bool:
    """Send message j as a failure (never waited: the peer may have failed too); False where
    its size is unknown here."""
    _, kind, b, mb = peer.order[j]
    link = peer.links[b]
    if j in peer.follows:  # as the peer counts it: in its header's room, or not
        carried = link.merged(kind)
        if carried is None:
            return False
        if carried:
            return True
    t = link.failure(kind, message)
    if t is None:
        return False
    peer.sent.append((t.numel(), link.tag(kind, mb)))
    link.isend(t, kind, mb)
    return True


def _post(peer: Peer, j: int) -> bool:
    """Post the receive of the peer's message j; False where the peer will never send it: a
    gradient of activations this rank never sent, or a peer whose header says it failed."""
    _, kind, b, mb = peer.order[j]
    link = peer.links[b]
    if kind == GRAD and link.meta is None:
        return False
    try:
        if kind == ACT and link.meta is None:  # its size: in the header, posted before it
            link.read_header(ACT_HEADER)
        if j in peer.follows and link.merged(kind):
            link.in_room(kind, mb)
            return True
        size = link.size(kind)
        link.post(kind, mb, size)
    except Exception:  # noqa: BLE001  (an error header, or the group failed: nothing more comes)
        return False
    peer.posted.append((size, link.tag(kind, mb)))
    return True
