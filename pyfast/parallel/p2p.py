"""Point-to-point transfers across one pipeline stage boundary, with isend/irecv.

A receive must be posted with exactly the size of its send: on a mismatch gloo aborts the
whole process from its I/O thread ("Received data size doesn't match expected size", measured
with torch 2.13). So the first activation of every step on a boundary is preceded by a
1 KB header (shape, dtype, requires_grad, step number), and the first gradient coming back by a
header too. Headers are also how an error reaches the other ranks: a rank that fails sends
error headers on every boundary it has not yet opened this step, and a rank that receives one
raises it, so bad input ends in a named error everywhere instead of a hang on a recv.
"""
from __future__ import annotations

import struct

import torch
import torch.distributed as dist

HEADER_BYTES = 1024
MAX_STAGES, MAX_MICROBATCHES = 256, 8192  # what the tag layout below can name
MAX_DIMS = 8
_INTS = 6 + MAX_DIMS  # magic, step, training, status, ndim, dtype, shape...
_MAGIC = 0x5046  # "PF"
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
ACT, GRAD, ACT_HEADER, GRAD_HEADER = range(4)


class PipelineError(RuntimeError):
    """A pipeline step failed on this rank or, forwarded by a header, on another one."""


def tag(uid: int, kind: int, stage: int, mb: int) -> int:
    # 31 bits: pipeline instance (8), message kind (2), boundary stage (8), micro-batch (13);
    # the instance bits keep the next 255 Pipelines on a group from matching stale messages
    # that a failed step left in flight.
    return (uid & 255) << 23 | kind << 21 | stage << 13 | mb


def pack_header(step: int, training: bool, t: torch.Tensor | None = None, requires_grad=False,
                error: str | None = None) -> torch.Tensor:
    shape = list(t.shape) if t is not None else []
    if len(shape) > MAX_DIMS or (t is not None and t.dtype not in DTYPES):
        raise PipelineError(f"stage outputs must have at most {MAX_DIMS} dims and a dtype in "
                            f"{DTYPES}; got {tuple(shape)} {t.dtype}")
    dtype = DTYPES.index(t.dtype) if t is not None else 0
    ints = [_MAGIC, step, int(training), int(error is not None) + 2 * int(requires_grad),
            len(shape), dtype] + shape + [0] * (MAX_DIMS - len(shape))
    head = struct.pack(f"<{_INTS}q", *ints)
    text = (error or "").encode()[:HEADER_BYTES - len(head) - 2]
    raw = head + struct.pack("<H", len(text)) + text
    buf = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf


def unpack_header(buf: torch.Tensor) -> dict:
    raw = bytes(buf.numpy())
    ints = struct.unpack_from(f"<{_INTS}q", raw)
    if ints[0] != _MAGIC:
        raise PipelineError("corrupt pipeline header: another message used this tag")
    n = struct.unpack_from("<H", raw, 8 * _INTS)[0]
    ndim = ints[4]
    return {"step": ints[1], "training": bool(ints[2]), "error": None if not ints[3] & 1 else
            raw[8 * _INTS + 2:8 * _INTS + 2 + n].decode(errors="replace"),
            "requires_grad": bool(ints[3] & 2), "dtype": DTYPES[ints[5]],
            "shape": tuple(ints[6:6 + ndim])}


class Link:
    """Boundary stage -> stage + 1 as seen by this rank: it is the sender (it owns `stage`),
    the receiver (it owns `stage + 1`), or both (one rank, no messages at all)."""

    def __init__(self, group, uid: int, stage: int, src: int, dst: int, me: int):
        self.group, self.uid, self.stage = group, uid, stage
        self.src, self.dst = src, dst  # group ranks
        self.sender, self.receiver, self.local = src == me, dst == me, src == dst
        self._glob = {r: dist.get_global_rank(group, r) for r in {src, dst}} if group else {}
        self.sends: list = []
        self.act_sends: dict = {}  # mb -> (work, tensor): released when the gradient returns

    def begin(self, step: int, training: bool):
        self.step, self.training = step, training
        self.meta = None            # (shape, dtype, requires_grad) of this step's activations
        self.opened_f = self.opened_b = False  # headers sent by this rank this step
        self.grad_ok = not training  # gradient header received (or not expected)
        self.acts, self.grads, self.mailbox = {}, {}, {}
        self._hf = self._hb = None
        if self.local:
            return
        if self.receiver:
            self._hf = self._irecv(torch.empty(HEADER_BYTES, dtype=torch.uint8), ACT_HEADER, 0)
        if self.sender and training:
            self._hb = self._irecv(torch.empty(HEADER_BYTES, dtype=torch.uint8), GRAD_HEADER, 0)

    # -- transport -------------------------------------------------------------------------
    def _isend(self, t, kind, mb):
        w = dist.isend(t, self._glob[self.dst if kind in (ACT, ACT_HEADER) else self.src],
                       self.group, tag(self.uid, kind, self.stage, mb))
        if kind == ACT and self.training:
            self.act_sends[mb] = (w, t)
        else:
            self.sends.append((w, t))

    def _irecv(self, buf, kind, mb):
        peer = self._glob[self.src if kind in (ACT, ACT_HEADER) else self.dst]
        return dist.irecv(buf, peer, self.group, tag(self.uid, kind, self.stage, mb)), buf

    def _header(self, pending, who: str) -> dict:
        work, buf = pending
        work.wait()
        h = unpack_header(buf)
        if h["error"] is not None:
            err = PipelineError(h["error"])
            err.forwarded = True  # already names its rank; pass it on unchanged
            raise err
        if h["step"] != self.step or h["training"] != self.training:
            call = lambda t: "step()" if t else "forward()"  # noqa: E731
            raise PipelineError(
                f"ranks out of step at boundary {self.stage}->{self.stage + 1}: the {who} is at "
                f"{call(h['training'])} number {h['step']}, this rank at {call(self.training)} "
                f"number {self.step}; every rank must call step()/forward() the same way")
        return h

    # -- activations, stage -> stage + 1 ---------------------------------------------------
    def send_act(self, mb: int, y: torch.Tensor):
        meta = (tuple(y.shape), y.dtype, y.requires_grad)
        if self.meta is None:
            self.meta = meta
            if not self.local:
                self._isend(pack_header(self.step, self.training, y, y.requires_grad),
                            ACT_HEADER, 0)
            self.opened_f = True
        elif meta != self.meta:
            raise PipelineError(
                f"stage {self.stage} output for micro-batch {mb} is {meta[:2]} but earlier "
                f"micro-batches of this step gave {self.meta[:2]}; within a step every "
                f"micro-batch must produce the same shape and dtype")
        y = y.detach()
        if self.local:
            self.mailbox[mb] = y
        else:
            self._isend(y.contiguous(), ACT, mb)

    def post_act(self, mb: int):
        """Post the receive now if this step's shape is known; else take_act posts it after
        reading the header (never block here: a receive is posted one action ahead)."""
        if self.local or mb in self.acts:
            return
        if self.meta is not None:
            shape, dtype, _ = self.meta
            self.acts[mb] = self._irecv(torch.empty(shape, dtype=dtype), ACT, mb)

    def _read_act_header(self):
        h = self._header(self._hf, f"sender of stage {self.stage}")
        self.meta = (h["shape"], h["dtype"], h["requires_grad"])

    def take_act(self, mb: int) -> torch.Tensor:
        if self.local:
            return self.mailbox.pop(mb)
        if self.meta is None:
            self._read_act_header()
        self.post_act(mb)
        work, buf = self.acts.pop(mb)
        work.wait()
        return buf

    # -- gradients, stage + 1 -> stage -----------------------------------------------------
    def send_grad(self, mb: int, g: torch.Tensor | None):
        shape, dtype, _ = self.meta
        if g is None:  # the stage's output did not depend on its input
            g = torch.zeros(shape, dtype=dtype)
        if self.local:
            self.mailbox[("g", mb)] = g
            return
        if not self.opened_b:
            self._isend(pack_header(self.step, self.training), GRAD_HEADER, 0)
            self.opened_b = True
        self._isend(g.contiguous(), GRAD, mb)

    def post_grad(self, mb: int):
        """Post the receive once this step's activation shape is known (the gradient has it)."""
        if not self.local and mb not in self.grads and self.meta is not None:
            shape, dtype, _ = self.meta
            self.grads[mb] = self._irecv(torch.empty(shape, dtype=dtype), GRAD, mb)

    def take_grad(self, mb: int) -> torch.Tensor:
        if self.local:
            return self.mailbox.pop(("g", mb))
        if not self.grad_ok:
            self._header(self._hb, f"receiver of stage {self.stage}")
            self.grad_ok = True
        self.post_grad(mb)
        work, buf = self.grads.pop(mb)
        work.wait()
        # Its gradient is back, so the activation has arrived: this wait returns at once, and
        # dropping the send keeps 1F1B's bound of p micro-batches held (work.is_completed()
        # stays False on gloo until wait() is called, so it cannot be polled instead).
        sent = self.act_sends.pop(mb, None)
        if sent is not None:
            sent[0].wait()
        return buf

    # -- end of step -----------------------------------------------------------------------
    def fail(self, message: str):
        """Tell the neighbours through every header this rank has not sent yet this step."""
        if self.local:
            return
        err = pack_header(self.step, self.training, error=message)
        if self.sender and not self.opened_f:
            self._isend(err, ACT_HEADER, 0)
            self.opened_f = True
        if self.receiver and self.training and not self.opened_b:
            self._isend(err.clone(), GRAD_HEADER, 0)
            self.opened_b = True

    def finish(self):
        for w, _ in self.sends + list(self.act_sends.values()):
            w.wait()
        self.sends, self.act_sends = [], {}


def agree(group, p: int, config: tuple, problem: str | None):
    """Raise on every rank if any rank has a problem or the ranks disagree: a check that one
    rank skipped would leave the others waiting on it."""
    if p == 1:
        seen = [(config, problem)]
    else:
        seen = [None] * p
        dist.all_gather_object(seen, (config, problem), group=group)
    for r, (c, prob) in enumerate(seen):
        if prob:
            raise ValueError(prob)
        if c != seen[0][0]:
            raise ValueError(f"ranks disagree on the pipeline: rank 0 has (schedule, n_microbatches, "
                             f"virtual_stages, balance, layers, pipelines built) = {seen[0][0]}, "
                             f"rank {r} has {c}")
