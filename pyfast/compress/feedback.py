"""Error feedback (Seide et al. 2014; Karimireddy et al. 2019): a memory per tensor name.

Composes with any compressor: what a step did not send is added to the next step's input, so
biased compressors (sign, top-k) still converge. Compressors with a fused kernel (top-k) do the
update in the same pass as the selection.
"""
from __future__ import annotations

import torch

from pyfast.compress.base import Compressor, Payload


class ErrorFeedback:
    """device: where the memory lives, the device of the tensors it serves (the parameters'):
    a checkpoint's memory (saved on the CPU) is loaded onto it. None: each memory is made on,
    or moved once to, the device of the tensor it first serves (a DDP hook's state, which sees
    its first tensor only in backward)."""

    def __init__(self, compressor: Compressor, device: torch.device | str | None = None):
        self.compressor = compressor
        self.device = torch.device(device) if device is not None else None
        self.memory: dict[str, torch.Tensor] = {}
        # staged (begin_step .. commit / rollback): name -> the new memory written this step,
        # memory[name] left as it was; spare: last step's old memories, reused as the targets
        self._staged: dict[str, torch.Tensor] | None = None
        self._made: set[str] = set()  # names first made this step (rollback drops them)
        self._spare: dict[str, torch.Tensor] = {}

    def _buffer(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """The memory to update in place under `name`. While staged, a copy of it (rolled
        back by not keeping it): for callers that cannot write out of place (pair())."""
        e, out = self.pair(x, name)
        if out is not e:
            out.copy_(e)
            self._staged[name] = out
        return out

    def pair(self, x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(read, write): the memory under `name` and where its update goes, the same tensor
        unless staged (begin_step): then a spare buffer, kept by commit(), and `read` stays
        as it was, so a skipped step costs no copy (pyfast.comm.guard)."""
        if self._staged is not None and name in self._staged:  # updated again this step
            e = self._staged[name]
            return e, e
        e = self.memory.get(name)
        if e is None:
            e = self.memory[name] = torch.zeros(x.numel(), dtype=torch.float32, device=x.device)
            if self._staged is not None:
                self._made.add(name)
        elif e.numel() != x.numel():
            raise ValueError(f"error feedback {name!r} holds {e.numel()} elements but the tensor "
                             f"has {x.numel()}: the same name was used for another tensor")
        elif e.device != x.device:  # loaded where the device was not known: once per name
            e = self.memory[name] = e.to(x.device)
        if self._staged is None:
            return e, e
        out = self._spare.pop(name, None)
        if out is None or out.shape != e.shape or out.device != e.device:
            out = torch.empty_like(e)
        self._staged[name] = out
        return e, out

    def begin_step(self) -> None:
        """Stage every update until commit() or rollback(); a step left open is committed."""
        self.commit()
        self._staged = {}

    def commit(self) -> None:
        """Keep the staged updates: swap them in (the old memories become the spares)."""
        for name, new in (self._staged or {}).items():
            old = self.memory.get(name)
            self.memory[name] = new
            if old is not None and old is not new:
                self._spare[name] = old
        self._staged, self._made = None, set()

    def rollback(self) -> None:
        """Drop the staged updates and the memories made this step: memory is as before."""
        for name, new in (self._staged or {}).items():
            if name not in self._made:
                self._spare[name] = new
        for name in self._made:
            self.memory.pop(name, None)
        self._staged, self._made = None, set()

    def compress(self, x: torch.Tensor, name: str = "") -> Payload:
        ef, out = self.pair(x, name)
        if out is ef:
            return self.compressor.compress_with_feedback(x, ef, name)
        return self.compressor.compress_with_feedback(x, ef, name, out=out)

    def decompress(self, p: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.compressor.decompress(p, out)

    def reset(self) -> None:
        self.memory.clear()
        self._spare.clear()
        self._staged, self._made = (None if self._staged is None else {}), set()

    def state_dict(self) -> dict:
        return {"memory": {k: v.detach().cpu().clone() for k, v in self.memory.items()}}

    def load_state_dict(self, state: dict, device: torch.device | str | None = None) -> None:
        """Load `state` (state_dict's, on the CPU) onto `device`, else self.device, else
        where it is (see the class)."""
        if device is not None:
            self.device = torch.device(device)
        if set(state) != {"memory"}:
            raise ValueError(f"not an ErrorFeedback state: keys {sorted(state)}")
        for k, v in state["memory"].items():
            if v.dtype != torch.float32 or v.dim() != 1:
                raise (TypeError if v.dtype != torch.float32 else ValueError)(f"error feedback {k!r} must be a 1-D float32 tensor, got "
                                 f"{v.dtype} of shape {tuple(v.shape)}")
        self.memory = {k: v.to(self.device, copy=True) if self.device is not None else v.clone()
                       for k, v in state["memory"].items()}
        self._spare.clear()  # and a step staged before the load writes nothing over it
        self._staged, self._made = (None if self._staged is None else {}), set()


class WithFeedback(Compressor):
    """A compressor whose compress() goes through an ErrorFeedback memory: hand it to a
    collective and every compression it does (of a chunk, or of a reduced sum) remembers what
    it did not send, keyed by the name the collective gives it."""

    def __init__(self, compressor: Compressor, feedback: ErrorFeedback | None = None,
                 device: torch.device | str | None = None):
        if isinstance(compressor, WithFeedback):
            raise ValueError("compressor already has error feedback")
        self.inner = compressor
        self.feedback = feedback or ErrorFeedback(compressor, device)
        self.spec = compressor.spec

    # what the collectives read (base.Compressor) is the inner compressor's
    algorithm = property(lambda self: self.inner.algorithm)
    block = property(lambda self: self.inner.block)
    per_tensor = property(lambda self: self.inner.per_tensor)
    lossy = property(lambda self: self.inner.lossy)
    deterministic = property(lambda self: self.inner.deterministic)
    native_kind = property(lambda self: self.inner.native_kind)
    base = property(lambda self: self.inner)

    def compress(self, x, name=""):
        return self.feedback.compress(x, name)

    def decompress(self, p, out=None):
        return self.inner.decompress(p, out)

    def decode_add(self, p, out):
        return self.inner.decode_add(p, out)

    def layout(self, numel):
        return self.inner.layout(numel)

    def to_wire(self, p):
        return self.inner.to_wire(p)

    def from_wire(self, buf, shape, dtype, meta=None):
        return self.inner.from_wire(buf, shape, dtype, meta)

    def state_dict(self):
        return {"compressor": self.inner.state_dict(), "feedback": self.feedback.state_dict()}

    def load_state_dict(self, state, device=None):
        self.inner.load_state_dict(state.get("compressor", {}))
        self.feedback.load_state_dict(state.get("feedback", {"memory": {}}), device)

    def __repr__(self):
        return f"WithFeedback({self.inner!r})"


def wrap(compressor: Compressor, error_feedback: bool = True,
         device: torch.device | str | None = None) -> Compressor:
    """The rule every reducer follows: a lossy compressor gets an error-feedback memory when
    error_feedback is on; an exact one (none, fp16, bf16) stays as it is. device: the
    parameters' (where the memory lives, checkpoints loaded included; ErrorFeedback)."""
    if error_feedback and compressor.lossy:
        return WithFeedback(compressor, device=device)
    return compressor
