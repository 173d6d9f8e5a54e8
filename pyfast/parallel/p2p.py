"""Point-to-point transfers across one pipeline stage boundary, with isend/irecv.

A receive must be posted with exactly the size of its send: on a mismatch gloo aborts the
whole process from its I/O thread ("Received data size doesn't match expected size", measured
with torch 2.13). So the first activation of every step on a boundary comes with a 1 KB
header (the output's tensors: shapes, dtypes, requires_grad; the step number), and the first
gradient coming back with a header too. Shapes are agreed once, as torch's pipelining does,
but may still change between steps: a header message is 1 KB plus room for one message laid
out as the boundary's last completed step was (`Link.agreed`, the same on both ranks); when
this step's layout is that one, the first message rides in its header's room (m messages a
direction for m micro-batches instead of m + 1, and the first receive is posted before the
step's first compute), else the room stays empty and the message follows on its own, sized by
the header.

Every message of a micro-batch (its activations, or their gradients) is one byte buffer: the
tensors of a stage's output (one tensor or a tuple) packed at 16-byte offsets, then a status
byte. A receive lands in a buffer from its link's pool, returned once the micro-batch's backward
no longer reads it (Link.recycle), so steps after the first allocate nothing. Status is how a
failure reaches ranks that are already waiting mid-step: a rank that fails sends, on each
boundary, an error header if it has not opened it this step, else a "failed" message of the
right size for every micro-batch it still owes (the receive posted for it matches, and the text
of the error rides in its payload). A rank that receives one fails in turn and passes it on, so
every rank stops its schedule instead of waiting for the group's timeout. The Pipeline then
agrees on the step's outcome with one all-reduce.

Nothing relies on tags (NCCL has none; tests/test_nccl_lane.py runs with every tag 0): two
ranks issue the messages between them, both ways, in one order that both compute
(pair_orders), the headers included, so receives pair with sends in posting order and NCCL's
one stream per pair of ranks never holds a receive that waits for a send queued behind it.
A failing rank sends the rest of its messages as failures in that order and posts the receives
of what its peers may still send it (p2p_fail.settle: a peer that waits for each send would
otherwise wait for a receive never posted), and after a failed step the ranks drain what is
left unmatched either way, so no message of it can pair with a later one. The tags stay (gloo
matches by them), distinct per Pipeline, kind, boundary and micro-batch.
"""
from __future__ import annotations

import functools
import struct

import torch
import torch.distributed as dist

from pyfast._ranges import ranged
from pyfast.comm.dry import fake_group, moved_nothing, read
from pyfast.comm.failure import CommError, naming
from .schedules import B, F, I, simulate

HEADER_BYTES = 1024
MAX_STAGES, MAX_MICROBATCHES = 256, 8192  # what the tag layout below can name
MAX_DIMS, MAX_TENSORS = 8, 8
_BASE, _PER = 6, 3 + MAX_DIMS  # magic, step, training, status, is_tuple, count; dtype, rg, ndim, shape
_INTS = _BASE + MAX_TENSORS * _PER
_MAGIC = 0x5047  # "PG": header layout 2 (tuples)
_ALIGN = 16  # packed tensors start at multiples of this: .view(dtype) needs aligned offsets
OK, FAILED = 0, 1
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
ACT, GRAD, ACT_HEADER, GRAD_HEADER = range(4)
_HEAD = {ACT: ACT_HEADER, GRAD: GRAD_HEADER}


class PipelineError(RuntimeError):
    """A pipeline step failed on this rank or on another one (the message names which rank,
    stage and micro-batch). The Pipeline that raised it refuses further steps."""


class PipelineCommError(PipelineError, CommError):
    """A pipeline step failed because communication did (a dead or silent peer, a timeout)."""


def tag(uid: int, kind: int, stage: int, mb: int) -> int:
    # 31 bits: pipeline instance (8), message kind (2), boundary stage (8), micro-batch (13);
    # the instance bits keep the next 255 Pipelines on a group from matching stale messages
    # that a failed step left in flight.
    return (uid & 255) << 23 | kind << 21 | stage << 13 | mb


# -- what crosses a boundary: one tensor or a tuple of them --------------------------------------
def as_tensors(y, what: str) -> tuple[bool, list[torch.Tensor]]:
    """(is_tuple, tensors) of a stage output; PipelineError if it is neither a tensor nor a
    tuple/list of tensors."""
    if isinstance(y, torch.Tensor):
        return False, [y]
    if isinstance(y, (tuple, list)) and y and all(isinstance(t, torch.Tensor) for t in y):
        if len(y) > MAX_TENSORS:
            raise PipelineError(f"{what} is a tuple of {len(y)} tensors; at most {MAX_TENSORS}")
        return True, list(y)
    kinds = [type(t).__name__ for t in y] if isinstance(y, (tuple, list)) else type(y).__name__
    raise PipelineError(f"{what} must be a tensor or a non-empty tuple of tensors, got {kinds}")


def spec_of(is_tuple: bool, ts: list[torch.Tensor]) -> tuple:
    """A step's activation layout: (is_tuple, ((shape, dtype, requires_grad), ...))."""
    return is_tuple, tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in ts)


def describe(spec) -> str:
    parts = [f"{shape} {str(dtype).replace('torch.', '')}" for shape, dtype, _ in spec[1]]
    return f"({', '.join(parts)})" if spec[0] else parts[0]


def _nbytes(shape, dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * dtype.itemsize


def _layout(specs) -> tuple[list[int], int]:
    return _layout_of(specs if isinstance(specs, tuple) else tuple(specs))


@functools.lru_cache(maxsize=256)  # a step reads it per message: 1 us cached, not per-dim Python
def _layout_of(specs: tuple) -> tuple[list[int], int]:
    offs, o = [], 0
    for shape, dtype, _ in specs:
        offs.append(o)
        o += -(-_nbytes(shape, dtype) // _ALIGN) * _ALIGN
    return tuple(offs), o + 1  # + the status byte


def pack(ts: list[torch.Tensor], specs, device) -> torch.Tensor:
    # One torch.cat of the tensors' bytes, the zero padding and the status byte: 5x less time
    # than filling an empty buffer piece by piece (35 vs 218 us a message, 4 x 256 fp32, one
    # thread, loaded 2-core Xeon), and a message is packed on every send of every action.
    offs, size = _layout(specs)
    parts, end = [], 0
    for t, o in zip(ts, offs):
        if o > end:
            parts.append(_zeros(o - end, device))
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        parts.append(raw)
        end = o + raw.numel()
    parts.append(_zeros(size - end, device))  # the padding after the last tensor, status OK
    return torch.cat(parts)


_ZEROS: dict = {}


def _zeros(n: int, device) -> torch.Tensor:
    """A cached read-only run of n zero bytes on `device` (padding and the OK status; OK == 0)."""
    key = (n, str(device))
    z = _ZEROS.get(key)
    if z is None:
        z = _ZEROS[key] = torch.zeros(n, dtype=torch.uint8, device=device)
    return z


def unpack(buf: torch.Tensor, specs) -> list[torch.Tensor]:
    """Views into buf (no copy)."""
    offs, _ = _layout(specs)
    return [buf.narrow(0, o, _nbytes(shape, dtype)).view(dtype).view(shape)
            for o, (shape, dtype, _) in zip(offs, specs)]


def failed_message(specs, message: str, device) -> torch.Tensor:
    """A message laid out like `specs` whose status says FAILED, carrying as much of `message`
    as its payload holds."""
    _, size = _layout(specs)
    buf = torch.zeros(size, dtype=torch.uint8, device=device)
    text = message.encode()[:max(0, size - 3)]
    if text:
        raw = struct.pack("<H", len(text)) + text
        buf[:len(raw)].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    buf[-1:].fill_(FAILED)
    return buf


def read_failure(buf: torch.Tensor) -> str | None:
    """None if buf's status is OK, else the text it carries."""
    if read(buf[-1], OK) == OK:  # a dry run's receives hold nothing: taken as OK
        return None
    raw = bytes(buf.cpu().numpy())
    n = struct.unpack_from("<H", raw)[0] if len(raw) >= 3 else 0
    return raw[2:2 + n].decode(errors="replace") if 0 < n <= len(raw) - 3 else ""


# -- headers ---------------------------------------------------------------------------------
def pack_header(step: int, training: bool, spec=None, error: str | None = None,
                device=None, size: int = HEADER_BYTES) -> torch.Tensor:
    """The header's bytes, zero-padded to `size` (HEADER_BYTES + the room the receiver posted)."""
    is_tuple, specs = spec if spec is not None else (False, ())
    ints = [_MAGIC, step, int(training), int(error is not None), int(is_tuple), len(specs)]
    for shape, dtype, rg in specs:
        if len(shape) > MAX_DIMS or dtype not in DTYPES:
            raise PipelineError(f"stage outputs must have at most {MAX_DIMS} dims and a dtype in "
                                f"{DTYPES}; got {shape} {dtype}")
        ints += [DTYPES.index(dtype), int(rg), len(shape), *shape, *[0] * (MAX_DIMS - len(shape))]
    ints += [0] * (_INTS - len(ints))
    head = struct.pack(f"<{_INTS}q", *ints)
    text = (error or "").encode()[:HEADER_BYTES - len(head) - 2]
    raw = head + struct.pack("<H", len(text)) + text
    buf = torch.zeros(size, dtype=torch.uint8, device=device)
    buf[:len(raw)].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    return buf


def unpack_header(buf: torch.Tensor) -> dict:
    raw = bytes(buf[:HEADER_BYTES].cpu().numpy())
    ints = struct.unpack_from(f"<{_INTS}q", raw)
    if ints[0] != _MAGIC:
        raise PipelineError("corrupt pipeline header: another message arrived where the header "
                            "was due (sends and receives paired out of order)")
    n = struct.unpack_from("<H", raw, 8 * _INTS)[0]
    specs = []
    for i in range(ints[5]):
        dt, rg, nd = ints[_BASE + i * _PER:_BASE + i * _PER + 3]
        shape = ints[_BASE + i * _PER + 3:_BASE + i * _PER + 3 + nd]
        specs.append((tuple(shape), DTYPES[dt], bool(rg)))
    return {"step": ints[1], "training": bool(ints[2]), "error": None if not ints[3] else
            raw[8 * _INTS + 2:8 * _INTS + 2 + n].decode(errors="replace"),
            "spec": (bool(ints[4]), tuple(specs))}


def _forwarded(message: str) -> PipelineError:
    err = PipelineError(message)
    err.forwarded = True  # already names its rank; pass it on unchanged
    return err


def _named(e: Exception, op: str):
    """Raise e as naming(op) would have inside its block (a backend failure as CommError
    naming op, anything else unchanged); the callers build op only when something failed."""
    with naming(op):
        raise e


def pair_orders(lists: list, p: int, n_stages: int) -> dict[tuple, list[tuple]]:
    """For every two ranks x < y that exchange messages, all of them, both ways, in one order:
    (sender, kind, boundary, mb), a boundary's header before its first activation and before
    its first gradient. lists: every rank's compute actions. Both ranks issue their sends and
    receives between them in this order: NCCL pairs messages in posting order (no tags) and
    runs the calls between two ranks one after another on one stream, so a receive issued
    before a send on both sides, each waiting for the other's, would hang. The order is that
    of a run of the schedule (schedules.simulate, by the time each message is sent; ties by
    sender), so it never makes a rank wait for a message that needs its own later one."""
    return message_orders(lists, p, n_stages)[0]


def message_orders(lists: list, p: int, n_stages: int) -> tuple[dict, dict]:
    """(pair_orders, when): when[pair][i] is the i-th message's place among all the step's
    messages in that run of the schedule (a failing rank settles its pairs in it)."""
    sent = []
    for q, timeline in enumerate(simulate(lists, n_stages)["timeline"]):
        opened = set()
        for _, end, a in timeline:
            if a.kind == F and a.stage < n_stages - 1:
                b, dst, kind, head = a.stage, (a.stage + 1) % p, ACT, ACT_HEADER
            elif a.kind in (B, I) and a.stage > 0:
                b, dst, kind, head = a.stage - 1, (a.stage - 1) % p, GRAD, GRAD_HEADER
            else:
                continue
            if dst == q:
                continue
            if (head, b) not in opened:
                opened.add((head, b))
                sent.append((end, q, len(sent), dst, head, b, 0))
            sent.append((end, q, len(sent), dst, kind, b, a.mb))
    out: dict[tuple, list[tuple]] = {}
    when: dict[tuple, list[int]] = {}
    for g, (_, q, _, dst, kind, b, mb) in enumerate(sorted(sent)):
        pair = (min(q, dst), max(q, dst))
        out.setdefault(pair, []).append((q, kind, b, mb))
        when.setdefault(pair, []).append(g)
    return out, when


class Peer:
    """This rank's messages with one other rank in a step, both ways, issued in pair_orders'
    order: a send first posts every receive due before it; a receive is posted as far ahead
    as that order allows (never past a send of this rank not made yet) and its size is known
    (a boundary's activations once its header is read). wait_sends: wait for each send as it
    is made (gloo with a lowered I/O thread, whose transfers otherwise wait for this rank to
    block; a failing rank then posts every receive it owes: p2p_fail.settle)."""

    def __init__(self, group, rank: int, me: int, wait_sends: bool = False):
        self.group, self.rank, self.me = group, rank, me  # ranks in `group`
        self.wait_sends = wait_sends
        self.links: dict[int, Link] = {}     # boundary -> Link (each Link adds itself)

    def begin(self, order: list, when: list | None = None):
        self.order = order
        self.when = when if when is not None else list(range(len(order)))
        self.at = {(kind, b, mb): i for i, (_, kind, b, mb) in enumerate(order)}
        # the first message of each boundary and direction, right after its header: it may
        # ride in the header's room (Link.merged)
        self.follows = {i for i in range(1, len(order)) if order[i][1] in _HEAD and
                        order[i - 1] == (order[i][0], _HEAD[order[i][1]], order[i][2], 0)}
        self.next = 0     # the first message of `order` not issued yet
        self.checked = 0  # the headers received before this index have been read
        self.sent: list = []    # (bytes, tag) of each message sent, for drain()
        self.posted: list = []  # (bytes, tag) of each receive posted
        self.unreleased: list = []  # order indexes of this rank's sends not waited yet
        self.post(len(order) - 1, block=False)  # the first headers: before any compute

    def send(self, link, t, kind, mb, carries: bool = False) -> None:
        """carries: t is a header with the next message of the order in its room."""
        i = self.at.get((kind, link.stage, mb))
        if i is None or i < self.next:
            raise PipelineError(f"internal: rank {self.me} sends {(kind, link.stage, mb)} to "
                                f"rank {self.rank}, which its schedule does not (or did)")
        self.post(i - 1, block=True)
        if self.next != i:
            raise PipelineError(f"internal: rank {self.me} sends {(kind, link.stage, mb)} to "
                                f"rank {self.rank} before {self.order[self.next]}")
        self.sent.append((t.numel(), link.tag(kind, mb)))
        link.isend(t, kind, mb)
        if self.wait_sends:
            link.release(kind, mb)
        else:
            self.unreleased.append(i)
        if carries and i + 1 not in self.follows:
            raise PipelineError(f"internal: rank {self.me} put {self.order[i + 1]} in a header's "
                                f"room but the order has no header before it")
        self.next = i + 2 if carries else i + 1

    def post(self, upto: int, block: bool) -> None:
        """Post the receives up to index `upto`, stopping at a send of this rank; block: read
        the headers that size them."""
        while self.next <= upto:
            sender, kind, b, mb = self.order[self.next]
            if sender == self.me:
                return
            link = self.links[b]
            if self.next in self.follows:
                carried = link.merged(kind)
                if carried is None and not block:
                    return
                if carried is None:  # the activations' header tells: it precedes, posted
                    link.read_header(ACT_HEADER)
                    carried = link.merged(kind)
                if carried:
                    link.in_room(kind, mb)
                    self.next += 1
                    continue
            size = link.size(kind)
            if size is None and not block:
                return
            if size is None:  # an activation whose header is unread: it precedes, posted
                link.read_header(ACT_HEADER)
                size = link.size(kind)
            link.post(kind, mb, size)
            self.posted.append((size, link.tag(kind, mb)))
            self.next += 1

    def release(self, kind, b, mb) -> None:
        """Message (kind, b, mb) from the peer has arrived: the peer sent it after posting
        every receive before it in the order (send() posts them first), so this rank's sends
        before it are matched and their waits return at once; drop their buffers now. 1F1B's
        last stage then holds about 2 sent gradients instead of all m until the step ends."""
        i = self.at[(kind, b, mb)]
        while self.unreleased and self.unreleased[0] < i:
            _, kind_j, b_j, mb_j = self.order[self.unreleased.pop(0)]
            self.links[b_j].release(kind_j, mb_j)

    def take(self, kind, b, mb) -> None:
        """Make the receive of (kind, b, mb) ready to wait on: it and every earlier one
        posted, every header received before it read (an error one raises here, so a failed
        peer that stops sending before this message cannot leave this rank waiting for it)."""
        i = self.at[(kind, b, mb)]
        self.post(i, block=True)
        if self.next <= i:
            raise PipelineError(f"internal: rank {self.me} waits for {(kind, b, mb)} from rank "
                                f"{self.rank} before sending {self.order[self.next]}")
        for sender, kind_j, b_j, _ in self.order[self.checked:i]:
            if sender != self.me and kind_j in (ACT_HEADER, GRAD_HEADER):
                self.links[b_j].read_header(kind_j)
        self.checked = max(self.checked, i)

    def drain(self, theirs, device) -> None:
        """After a failed step, every rank alive and done sending: receive what the peer sent
        that this rank never posted, and send what this rank posted that the peer never sent
        (zeros), so that no message of the step is left in the stream to pair with a later
        one (under NCCL, a new Pipeline's). theirs: the peer's (sent, posted)."""
        sent, posted = theirs
        ops = [dist.P2POp(dist.irecv, torch.empty(n, dtype=torch.uint8, device=device),
                          group=self.group, group_peer=self.rank, tag=t)
               for n, t in sent[len(self.posted):]]
        ops += [dist.P2POp(dist.isend, torch.zeros(n, dtype=torch.uint8, device=device),
                           group=self.group, group_peer=self.rank, tag=t)
                for n, t in posted[len(self.sent):]]
        if ops:  # one batch: both ways at once
            with naming(f"Pipeline: draining a failed step's messages with rank {self.rank}"):
                for w in dist.batch_isend_irecv(ops):
                    w.wait()

class Pool:
    """A link's message buffers of one use (receives, or packed sends), kept from message to
    message and step to step: `take` one for (kind, mb), `give` it back once no longer read or
    in flight, `end_step` returns what is left and drops the sizes the step did not use (a batch
    size that changes every step would otherwise keep every size's)."""

    def __init__(self):
        self.free: dict = {}  # (size, device) -> [Buf]
        self.held: dict = {}  # (kind, mb) -> the Buf taken for it this step
        self.used: set = set()  # the keys this step drew from

    def take(self, kind, mb, size, device, make) -> Buf:
        key = (size, device)
        self.used.add(key)
        free = self.free.get(key)
        buf = free.pop() if free else Buf(make(), key)
        self.held[(kind, mb)] = buf
        return buf

    def give(self, kind, mb) -> None:
        buf = self.held.pop((kind, mb), None)
        if buf is not None:
            self.free.setdefault(buf.key, []).append(buf)

    def end_step(self) -> None:
        for kind, mb in list(self.held):
            self.give(kind, mb)
        self.free = {k: v for k, v in self.free.items() if k in self.used}
        self.used = set()


class Buf:
    """A pooled byte buffer, its views by layout (made once), and its bytes as numpy where it is
    host memory (a status byte read without a torch op)."""
    __slots__ = ("data", "key", "views", "host")

    def __init__(self, data: torch.Tensor, key):
        self.data, self.key, self.views = data, key, {}
        on_host = data.device.type == "cpu"  # cpu-literal: numpy can view host memory only
        self.host = data.numpy() if on_host else None

    def viewed(self, specs: tuple) -> list[torch.Tensor]:
        """unpack(data, specs), made once per layout."""
        views = self.views.get(specs)
        if views is None:
            views = self.views[specs] = unpack(self.data, specs)
        return views


class Link:
    """Boundary stage -> stage + 1 as seen by this rank: it is the sender (it owns `stage`),
    the receiver (it owns `stage + 1`), or both (one rank, no messages at all). Its messages
    go through the Peer of the other rank."""

    def __init__(self, group, uid: int, stage: int, src: int, dst: int, me: int, m: int,
                 peer: Peer | None = None):
        self.group, self.uid, self.stage, self.m = group, uid, stage, m
        self.src, self.dst = src, dst  # ranks in `group` (None: the default group)
        self.sender, self.receiver, self.local = src == me, dst == me, src == dst
        self.peer = peer
        if peer is not None:
            peer.links[stage] = self
        # (kind, mb) -> (work, tensor) of each send not yet waited: released as soon as the
        # peer is known to have posted its receive (Peer.release), else at the step's end
        self.sends: dict = {}
        self.abandoned: list = []  # a failed step's pending transfers: their buffers stay alive
        # message buffers reused from micro-batch to micro-batch and step to step: receives
        # return once the micro-batch's backward is done (recycle), packed sends once waited
        self.recv_pool, self.send_pool = Pool(), Pool()
        self.dry_spec = None  # the activations' layout where headers arrive empty (Pipeline.expect)
        self.agreed = None  # the layout of the last step that completed: both ranks have it
        # a dry run's receives hold nothing (read once: get_backend per message cost ~10 us)
        self.fake = fake_group(group)

    def begin(self, step: int, training: bool, device):
        self.abandoned += list(self.sends.values())
        self.sends = {}
        self.step, self.training, self.device = step, training, device
        self.meta = None  # spec_of(...) of this step's activations
        self.opened_b = False  # the gradients' header sent by this rank this step
        self.grad_ok = not training  # gradient header received (or not expected)
        self.heard = set()  # the header kinds whose receive has been waited for
        self.acts, self.grads, self.mailbox = {}, {}, {}
        self._hf = self._hb = None

    # -- transport -------------------------------------------------------------------------
    def _what(self, kind, mb):
        if kind == ACT:
            return f"stage {self.stage}'s output for micro-batch {mb}"
        if kind == GRAD:
            return f"the gradient of stage {self.stage}'s output for micro-batch {mb}"
        if kind == ACT_HEADER:
            return f"stage {self.stage}'s output header"
        return f"the header of stage {self.stage}'s output gradients"

    def tag(self, kind, mb) -> int:
        return tag(self.uid, kind, self.stage, mb)

    def isend(self, t, kind, mb):
        peer = self.dst if kind in (ACT, ACT_HEADER) else self.src
        try:  # the error's name is built only on failure: a step sends one message an action
            w = dist.isend(t, group=self.group, tag=self.tag(kind, mb), group_dst=peer)
        except Exception as e:  # noqa: BLE001  (_named re-raises it)
            _named(e, f"Pipeline: sending {self._what(kind, mb)} to rank {peer}")
        self.sends[(kind, mb)] = (w, t)

    def release(self, kind, mb):
        """Wait for a send the peer has posted the receive of (it returns at once) and drop its
        buffer: the message's bytes are not held until the step ends."""
        sent = self.sends.pop((kind, mb), None)
        if sent is not None:
            try:
                sent[0].wait()
            except Exception as e:  # noqa: BLE001  (_named re-raises it)
                _named(e, f"Pipeline: sending {self._what(kind, mb)}")
            self.send_pool.give(kind, mb)

    def _irecv(self, buf, kind, mb):
        peer = self.src if kind in (ACT, ACT_HEADER) else self.dst
        try:
            work = dist.irecv(buf, group=self.group, tag=self.tag(kind, mb), group_src=peer)
        except Exception as e:  # noqa: BLE001  (_named re-raises it)
            _named(e, f"Pipeline: receiving {self._what(kind, mb)} from rank {peer}")
        return work, buf, kind, mb

    def size(self, kind) -> int | None:
        """Bytes of a message of this kind coming to this rank, None while unknown."""
        if kind in (ACT_HEADER, GRAD_HEADER):
            return HEADER_BYTES + self._room(ACT if kind == ACT_HEADER else GRAD)
        if self.meta is None:
            return None
        return _layout(self.meta[1] if kind == ACT else self._grad_specs())[1]

    def _specs(self, kind, spec) -> list:
        return list(spec[1]) if kind == ACT else [s for s in spec[1] if s[2]]

    def _room(self, kind) -> int:
        """Bytes after a header of this direction: one message of the agreed layout (none on a
        dry run's fake group, whose headers arrive empty)."""
        if self.agreed is None or self.fake:
            return 0
        return _layout(self._specs(kind, self.agreed))[1]

    def merged(self, kind) -> bool | None:
        """Whether this step's first message of `kind` (ACT or GRAD) rides in its header's room:
        its layout (shapes and dtypes; requires_grad decides which gradients exist) is the
        agreed one. None until this step's layout is known here."""
        if self.meta is None:
            return None
        if self.agreed is None or self.fake:
            return False
        lay = lambda spec: [(sh, dt) for sh, dt, _ in self._specs(kind, spec)]  # noqa: E731
        return lay(self.meta) == lay(self.agreed)

    def in_room(self, kind, mb) -> None:
        """Micro-batch mb's message of `kind` is in its header's room: its data, once the header
        is read (Peer.take reads it first), is the header buffer's tail."""
        head = self._hf if kind == ACT else self._hb
        room = head[1].narrow(0, HEADER_BYTES, head[1].numel() - HEADER_BYTES)
        (self.acts if kind == ACT else self.grads)[mb] = (None, room, kind, mb)

    def _header_msg(self, kind, spec, payload=None) -> torch.Tensor:
        """This step's header of `kind` for the peer, carrying `payload` (packed tensors) in its
        room, or with the room empty."""
        head = pack_header(self.step, self.training, spec, device=self.device,
                           size=HEADER_BYTES if payload is not None else self.size(kind))
        return head if payload is None else torch.cat([head, payload])

    def _buffer(self, kind, mb, size) -> torch.Tensor:
        """A receive buffer for (kind, mb) from the pool (or a new one). A message's status byte
        is then read from numpy and its tensors are detached views made once per buffer: 1
        torch op a message instead of 6 (empty, narrow, 2 views, select, item), and no
        allocation. Tiny benchmark model, 1F1B at 4 ranks (32 messages a middle rank), side by
        side, six rounds: 18.3-19.0 -> 17.4-18.2 ms a step (torch's 15.9-17.0), 9.3 -> 8.9 at
        2 ranks; a buffer per micro-batch kept for the next step instead measured the same
        (17.5-18.1). As many buffers as were in flight at once stay allocated between steps
        (torch's pipelining keeps one per micro-batch: stage.py's args_recv_info)."""
        make = lambda: torch.empty(size, dtype=torch.uint8, device=self.device)  # noqa: E731
        return self.recv_pool.take(kind, mb, size, self.device, make).data

    def recycle(self, kind, mb) -> None:
        """Micro-batch mb's received message of `kind` is no longer read (its backward, weight
        gradients included, is done; or the step ended): its buffer goes back to the pool."""
        self.recv_pool.give(kind, mb)

    def _pooled(self, buf, kind, mb) -> Buf | None:
        held = self.recv_pool.held.get((kind, mb))
        return held if held is not None and held.data is buf else None

    def _status(self, buf, kind, mb) -> int:
        held = self._pooled(buf, kind, mb)
        if held is not None and held.host is not None:
            return int(held.host[-1])  # a CPU buffer's byte, no torch op
        return buf[-1].item()

    def _unpack(self, buf, kind, mb, specs) -> list[torch.Tensor]:
        """unpack(buf, specs), from views made once where buf is a pooled buffer: fresh tensors
        (detach), so no .grad or requires_grad carries over to the buffer's next message."""
        held = self._pooled(buf, kind, mb)
        if held is None:
            return unpack(buf, specs)
        return [v.detach() for v in held.viewed(tuple(specs))]

    def _packed(self, kind, mb, ts, specs) -> torch.Tensor:
        """pack(ts, specs) into a buffer from the send pool: one copy a tensor into views made
        once per buffer (its padding and OK status byte zero from its creation), no allocation.
        Tiny benchmark model, 1F1B at 4 ranks, three rounds side by side: 18.0-18.5 -> 17.5-17.7
        ms a step (torch's 16.1-17.5). With each send waited as made (gloo) one buffer a
        direction stays allocated between steps; under NCCL, as many as were in flight."""
        specs = tuple(specs)
        size = _layout(specs)[1]
        make = lambda: torch.zeros(size, dtype=torch.uint8, device=self.device)  # noqa: E731
        buf = self.send_pool.take(kind, mb, size, self.device, make)
        with torch.no_grad():
            for v, t in zip(buf.viewed(specs), ts):
                v.copy_(t)
        return buf.data

    def post(self, kind, mb, size):
        buf = (self._buffer(kind, mb, size) if kind in (ACT, GRAD) else
               torch.empty(size, dtype=torch.uint8, device=self.device))
        pending = self._irecv(buf, kind, mb)
        if kind == ACT_HEADER:
            self._hf = pending
        elif kind == GRAD_HEADER:
            self._hb = pending
        else:
            (self.acts if kind == ACT else self.grads)[mb] = pending

    def read_header(self, kind):
        if kind in self.heard and (self.meta is None if kind == ACT_HEADER else not self.grad_ok):
            # read and failed already: a receive's wait cannot be repeated (gloo's blocks)
            raise PipelineError(f"boundary {self.stage}->{self.stage + 1}: its header said "
                                f"the peer failed")
        if kind == ACT_HEADER and self.meta is None:
            self.heard.add(kind)
            self.meta = self._header(self._hf, f"sender of stage {self.stage}")["spec"]
        elif kind == GRAD_HEADER and not self.grad_ok:
            self.heard.add(kind)
            self._header(self._hb, f"receiver of stage {self.stage}")
            self.grad_ok = True

    def _wait(self, pending) -> torch.Tensor:
        work, buf, kind, mb = pending
        try:
            if work is not None:  # None: in a header's room, which take() has read
                work.wait()
        except Exception as e:  # noqa: BLE001  (_named re-raises it)
            peer = self.src if kind in (ACT, ACT_HEADER) else self.dst
            _named(e, f"Pipeline: receiving {self._what(kind, mb)} from rank {peer}")
        if kind in (ACT, GRAD) and not (self.fake or buf.is_meta) and \
                self._status(buf, kind, mb) != OK:
            text = read_failure(buf)
            peer = self.src if kind == ACT else self.dst
            raise _forwarded(text or f"rank {peer} failed (its message was too small to say why)")
        return buf

    def _header(self, pending, who: str) -> dict:
        buf = self._wait(pending)
        if moved_nothing(buf, self.group):  # a dry run: the header the peer would have sent
            if self.dry_spec is None and pending[2] == ACT_HEADER:
                raise PipelineError(f"boundary {self.stage}->{self.stage + 1}: the header arrived "
                                    "empty (meta tensors or the fake backend) and no layout was "
                                    "given (Pipeline.expect)")
            return {"step": self.step, "training": self.training, "error": None,
                    "spec": self.dry_spec}
        h = unpack_header(buf)
        if h["error"] is not None:
            raise _forwarded(h["error"])
        if h["step"] != self.step or h["training"] != self.training:
            call = lambda t: "step()" if t else "forward()"  # noqa: E731
            raise PipelineError(
                f"ranks out of step at boundary {self.stage}->{self.stage + 1}: the {who} is at "
                f"{call(h['training'])} number {h['step']}, this rank at {call(self.training)} "
                f"number {self.step}; every rank must call step()/forward() the same way")
        return h

    def _grad_specs(self):
        return [s for s in self.meta[1] if s[2]]

    # -- activations, stage -> stage + 1 ---------------------------------------------------
    @ranged("pyfast.pipe.send")
    def send_act(self, mb: int, y):
        is_tuple, ts = as_tensors(y, f"stage {self.stage}'s output")
        meta = spec_of(is_tuple, ts)
        if self.meta is None:
            self.meta = meta
            if not self.local and self.merged(ACT):  # one message: the header and mb's data
                msg = self._header_msg(ACT_HEADER, meta, pack(ts, meta[1], self.device))
                self.peer.send(self, msg, ACT_HEADER, 0, carries=True)
                return
            if not self.local:
                self.peer.send(self, self._header_msg(ACT_HEADER, meta), ACT_HEADER, 0)
        elif meta != self.meta:  # requires_grad too: it decides what the gradient message holds
            raise PipelineError(
                f"stage {self.stage} output for micro-batch {mb} is {describe(meta)} but earlier "
                f"micro-batches of this step gave {describe(self.meta)}; within a step every "
                f"micro-batch must produce the same shapes and dtypes")
        if self.local:
            self.mailbox[mb] = [t.detach() for t in ts]
        else:
            self.peer.send(self, self._packed(ACT, mb, ts, self.meta[1]), ACT, mb)

    @ranged("pyfast.pipe.recv")
    def post_act(self, mb: int):
        """Post the receive (and the peer's earlier ones) as far as their sizes are known;
        never blocks (a receive is posted a few actions ahead)."""
        if not self.local:
            self.peer.post(self.peer.at[(ACT, self.stage, mb)], block=False)

    @ranged("pyfast.pipe.wait")
    def take_act(self, mb: int) -> list[torch.Tensor]:
        if self.local:
            return self.mailbox.pop(mb)
        self.peer.take(ACT, self.stage, mb)
        buf = self._wait(self.acts.pop(mb))
        self.peer.release(ACT, self.stage, mb)
        return self._unpack(buf, ACT, mb, self.meta[1])

    # -- gradients, stage + 1 -> stage -----------------------------------------------------
    @ranged("pyfast.pipe.send")
    def send_grad(self, mb: int, gs: list):
        """gs: one gradient (or None: the output did not reach the input) per activation
        tensor that requires grad, in order."""
        specs = self._grad_specs()
        gs = [g if g is not None else torch.zeros(shape, dtype=dtype, device=self.device)
              for g, (shape, dtype, _) in zip(gs, specs)]
        if self.local:
            self.mailbox[("g", mb)] = gs
            return
        if not self.opened_b:
            self.opened_b = True
            if self.merged(GRAD):
                msg = self._header_msg(GRAD_HEADER, None, pack(gs, specs, self.device))
                self.peer.send(self, msg, GRAD_HEADER, 0, carries=True)
                return
            self.peer.send(self, self._header_msg(GRAD_HEADER, None), GRAD_HEADER, 0)
        self.peer.send(self, self._packed(GRAD, mb, gs, specs), GRAD, mb)

    @ranged("pyfast.pipe.recv")
    def post_grad(self, mb: int):
        """As post_act (the gradient's size is known once this step's output was sent)."""
        if not self.local:
            self.peer.post(self.peer.at[(GRAD, self.stage, mb)], block=False)

    @ranged("pyfast.pipe.wait")
    def take_grad(self, mb: int) -> list[torch.Tensor]:
        if self.local:
            return self.mailbox.pop(("g", mb))
        self.peer.take(GRAD, self.stage, mb)  # the gradients' header is read by now
        gs = self._unpack(self._wait(self.grads.pop(mb)), GRAD, mb, self._grad_specs())
        self.peer.release(GRAD, self.stage, mb)
        return gs

    # -- end of step -----------------------------------------------------------------------
    def failure(self, kind, message: str) -> torch.Tensor | None:
        """What this rank sends in place of a message of this kind it owes: an error header
        or a FAILED message of its size (the text of the error in its payload); None where
        the size is unknown (this step's output layout never reached this rank)."""
        if kind in (ACT_HEADER, GRAD_HEADER):
            return pack_header(self.step, self.training, error=message, device=self.device,
                               size=self.size(kind))
        if self.meta is None:
            return None
        return failed_message(self.meta[1] if kind == ACT else self._grad_specs(), message,
                              self.device)

    def abandon(self):
        """After a failed step: keep this step's pending transfers alive, never wait on them."""
        self.abandoned += list(self.sends.values())
        self.abandoned += list(self.acts.values()) + list(self.grads.values())
        self.abandoned += [h for h in (self._hf, self._hb) if h is not None]
        self.sends, self.acts, self.grads = {}, {}, {}
        # a receive of the failed step may still land in one of these: never reused
        self.recv_pool, self.send_pool = Pool(), Pool()

    def finish(self):
        """The step completed on every rank: wait for the sends and agree on its layout (both
        ranks of the boundary know it: the sender made it, the receiver read it)."""
        with naming(f"Pipeline: completing the sends of boundary {self.stage}->{self.stage + 1}"):
            for w, _ in self.sends.values():
                w.wait()
        if self.meta is not None and not self.local:
            self.agreed = self.meta
        # the headers' receives are read by now: dropped with the sends, so no work object or
        # buffer of this step is held until the next one; forward()'s receives back to the pool
        # (its outputs are concatenated, a copy, before a next step can receive into them)
        self.sends, self._hf, self._hb = {}, None, None
        self.recv_pool.end_step()
        self.send_pool.end_step()
