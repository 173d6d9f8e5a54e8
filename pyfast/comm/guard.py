"""Non-finite gradients under compression, with torch.amp.GradScaler's semantics.

With loss scaling an overflow (inf/NaN in some rank's gradients) is routine: the scaler must see
it on every rank, skip that step everywhere, lower the scale and go on. A compressor with error
feedback would otherwise store the inf in its memory (poisoning every later step), and the
finite ranks would store this step's residual although the step is skipped. So, per step:

1. each rank checks its own bucket before compressing it (one aminmax pass); a non-finite
   bucket is sent as zeros through the compressor without its feedback memory (the collective
   still runs: every rank issues the same ones), and its flag goes into the step's side band;
2. in mode "skip", the feedback memories are double-buffered for the step
   (ErrorFeedback.begin_step): each compression reads the old memory and writes the new one
   into a spare buffer, swapped in when the step commits, so nothing is copied (callers that
   can only update in place, ErrorFeedback._buffer, get a copy); the compressor's own state,
   e.g. PowerSGD's Q, is snapshot at the step's start;
3. once the flags are summed over ranks: "skip" fills the flagged buckets with NaN on every rank
   (what GradScaler checks) and puts memory and state back as they were (drops the staged
   memories), else keeps the staged memories; "raise" raises
   NonFiniteGradient on every rank, naming the bucket and how many ranks had it.

Folded check (folds(): "skip", a bucket reduced whole by a block quantizer, DataParallel's
int8/int4/fp8/sign): step 1 is left out. A block holding NaN/Inf gets a NaN scale and decodes
to NaN throughout, on every rank and through the sums, so after the reduction one element a
block (ops.quantize.blocks_finite) flags the bucket the same on every rank; the rank that
had it sent it and wrote its memory into the staged buffer, dropped with the step.

Costs (9.4M fp32 gradients, one core of this 2-core EPYC): the full check 1.6 ms a step, the
memory copy step 2 replaced 2.8 ms; the folded check 0.14 ms. Before both (a full pass and a
copy per bucket) int8's "skip" cost +5.6% / +8.8% of a `pyfast bench dp_semantics` step
(two quiet runs); side by side in one process (issue 25) the old work
took 5.2-10.7 ms more a step than the new. Nothing when check_finite=False.

Pass-through (passes_through(): "skip" with compressors that lose nothing a later step depends
on -- none, fp16, bf16: not lossy, no feedback memory, no state): no check and no copy at all.
NaN and Inf cross those compressors unchanged and the sum carries them, so every rank's reduced
bucket holds them in the same elements (the ranks get the same bytes): GradScaler sees them
everywhere and skips the same step everywhere, and there is nothing to put back. The reducer
then learns whether the step was non-finite only when asked (DataParallel.skipped: one pass
over the reduced buckets, on demand). The check was 3.1-3.3 ms of CPU a rank-step on
gpt-small (10.8M parameters; `pyfast bench dp --cpu-split`), a third of DataParallel's
main-thread cost over the bare step.
"""
from __future__ import annotations

import torch

import pyfast.compress as C
from pyfast.comm.collectives import NonFiniteGradient, all_finite
from pyfast.ops.quantize import blocks_finite

MODES = ("skip", "raise", False)


def check_mode(mode) -> str | bool:
    if mode is True:  # the old boolean API: True meant "raise"
        return "raise"
    if mode not in MODES:
        raise ValueError(f"check_finite must be one of {MODES}, got {mode!r}")
    return mode


def owns(name: str, key: str) -> bool:
    """Whether state `key` belongs to the reduction named `name` (itself, or a chunk of it)."""
    return key == name or key.startswith(name + ".") or key.startswith(name + ":")


class FiniteGuard:
    """The three steps above for one reducer; `compressors()` lists the compressors in use."""

    def __init__(self, mode, compressors):
        self.mode = check_mode(mode)
        self.compressors = compressors
        self._state: list | None = None
        # True under torchft (pyfast.parallel.ft_reduce): every step is staged whatever the
        # mode, and the verdict is torchft's commit, not this step's finiteness alone
        self.hold = False

    def _memories(self):
        return [c.feedback for c in self.compressors() if c.feedback is not None]

    def begin(self) -> None:
        """A new step ("skip"): stage the feedback memories' updates (ErrorFeedback.begin_step:
        written beside the old ones, nothing copied) and snapshot the compressors' state."""
        self._state = None
        if self.mode == "skip" or self.hold:
            for fb in self._memories():
                fb.begin_step()
            self._state = [(c, c.base.state_dict()) for c in self.compressors()]

    def passes_through(self) -> bool:
        """Whether steps 1-3 can be left to the reduction itself (module docstring)."""
        return self.mode == "skip" and all(not c.lossy and c.feedback is None
                                           for c in self.compressors())

    def local_ok(self, flat: torch.Tensor) -> bool:
        return self.mode is False or all_finite(flat)

    def folds(self, c) -> bool:
        """Whether the check of a bucket reduced whole with c can ride on its quantization
        ("skip" only): a block quantizer decodes a block holding NaN/Inf to NaN throughout
        (compress.quant), on every rank, so the reduced bucket read once a block
        (reduced_ok) tells what the full pass before compressing did, at 1/512 of its reads;
        the memory the non-finite rank wrote is staged like the others' and dropped."""
        return self.mode == "skip" and isinstance(c.base, C.Quantizer) and not c.per_tensor

    @staticmethod
    def reduced_ok(c, flat: torch.Tensor) -> bool:
        """After the reduction, for a bucket that folds(c): whether no rank had NaN/Inf."""
        return blocks_finite(flat, c.base.block)

    def for_bucket(self, c, name: str, ok: bool):
        """The compressor to reduce bucket `name` with: c itself, or c without its memory if
        this rank's bucket is not finite (the caller zeroes the bucket)."""
        return c if ok else c.base

    def commit(self) -> None:
        """Keep the step's feedback updates (swap the staged memories in)."""
        for fb in self._memories():
            fb.commit()
        self._state = None

    def rollback(self) -> None:
        """Put every feedback memory and compressor state back as they were at begin()."""
        for fb in self._memories():
            fb.rollback()
        for c, state in self._state or []:
            c.base.load_state_dict(state)
        self._state = None

    def settle(self, flagged: list[int], names: list[str], fill) -> bool:
        """After the flags were summed over ranks (flagged[i]: how many ranks had a non-finite
        bucket i). Returns True if the step is skipped; `fill(i)` NaN-fills bucket i."""
        bad = [i for i, f in enumerate(flagged) if f]
        if not bad or self.mode is False:
            if self.mode == "skip" and not self.hold:
                self.commit()
            return False
        if self.mode == "raise":
            raise NonFiniteGradient("NaN/Inf gradients in " + ", ".join(
                f"{names[i]} on {flagged[i]} rank(s)" for i in bad) + " (check_finite='raise')")
        self.rollback()
        for i in bad:
            fill(i)
        return True
