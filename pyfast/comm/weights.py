"""Per-rank sample weights for the gradient reductions (DataParallel and ZeRO's `samples=`).

Ranks with different batch sizes: rank r's loss is a mean over its own n_r samples, as with DDP,
and its gradient g_r enters the reduction weighted so that the result is the gradient of the
concatenated batch, sum_r n_r g_r / N (N = sum_r n_r). The weight goes in where the gradient
enters the bucket (the copy-in, where compressor none already takes its 1/W): a bucket then holds
g_r * n_r * W / N and the reduction stays the plain average it is (W ranks), so every compressor,
error feedback and the native engine run unchanged. The error-feedback memory then holds
weighted residuals: what this rank's weighted contribution did not send, in the units of the
average, which is what the next step's (weighted) bucket must add back, whatever its own weight.

N: each rank knows only its own n. At forward (the one that arms the reduction) every rank puts
its n at its own index of a W-element fp32 vector of zeros and starts one all-reduce (sum) of it
on the path the buckets take (same FIFO, same group), so it is done long before backward's
first bucket. The weight is then computed on the vector's device (no host read: on CUDA the
stream waits, the host does not). The vector is read on the host once, after the step's
reductions: a rank that gave n < 1 (or a non-integer) makes every rank raise the same
ValueError naming the ranks and their values, with no hang (the bad rank's weight is taken as 0
and N as at least 1 for the step, so the reductions run to their end with finite values first).
fp32 holds every integer up to 2^24 exactly: a sum of samples above 16,777,216 a step raises.

Setting samples=None (the default) costs nothing: no vector, no all-reduce, the plain mean
(bit-identical to a reducer without this module). Whether samples is None or an int must be the
same on every rank at each step (the all-reduce is a collective).
"""
from __future__ import annotations

import operator

import torch

from pyfast.comm.dry import read

EXACT = 2 ** 24  # fp32's exact integers: the vector's sum must stay below


def check_samples(n, who: str):
    """n as this rank may give it: None, or anything an int can be read from without loss (an
    int or a 0-d integer tensor / numpy int); TypeError otherwise, raised on the caller's rank
    (a type is a programming error, the same on every rank). Values < 1 pass here: they are
    refused collectively by SampleWeights.check."""
    if n is None:
        return None
    if isinstance(n, bool):
        raise TypeError(f"{who}: samples must be an int (this rank's samples this step), "
                        f"got {n!r}")
    try:
        return operator.index(n)
    except TypeError:
        raise TypeError(f"{who}: samples must be an int (this rank's samples this step), got "
                        f"{type(n).__name__} {n!r}") from None


class SampleWeights:
    """One reducer's weights (module docstring). world: the ranks the gradient is averaged
    over (a hybrid ZeRO: shard group x replica group); index: this rank's place among them."""

    def __init__(self, who: str, world: int, index: int, device=None):
        self.who, self.world, self.index, self.device = who, world, index, device
        self.n = None  # this rank's samples this step (None: the plain mean)
        self._vec = self._handle = self._sent = None
        self._scaled: dict = {}

    @property
    def active(self) -> bool:
        """Whether this step is weighted (a vector is in flight or reduced)."""
        return self._vec is not None

    def start(self, issue) -> None:
        """At the forward that arms a reduction (or at a reduce_gradients() call): this rank's n
        into a fresh vector, summed over the ranks by issue(vector) -> a handle, on the path the
        buckets take. A vector still unread (a forward without backward) is waited for first.
        n None: nothing is sent and the step is unweighted."""
        self.drop()
        if self.n is None:
            return
        vec = torch.zeros(self.world, dtype=torch.float32, device=self.device)
        vec[self.index] = float(self.n)
        self._vec, self._sent, self._scaled = vec, self.n, {}
        self._handle = issue(vec)

    def drop(self) -> None:
        """Wait for a vector in flight (if any) and forget it: the step is unweighted."""
        h, self._handle, self._vec = self._handle, None, None
        if h is not None:
            h.wait()

    def weight(self, scale=None):
        """The factor this rank's gradient is multiplied by on its way into a bucket: n*W/N
        (averaged buckets), times `scale` where the bucket takes its 1/W there too (summed
        ones); a 0-d fp32 tensor on the vector's device, computed once a step per scale."""
        if scale not in self._scaled:
            if self._handle is not None:
                self._handle.wait()
                self._handle = None
            v = torch.nan_to_num(self._vec, nan=0.0).clamp(min=0.0)
            w = v[self.index] * self.world / v.sum().clamp(min=1.0)
            self._scaled[scale] = w if scale is None else w * scale
        return self._scaled[scale]

    def check(self, group=None) -> None:
        """After the step's reductions: every rank raises the same ValueError if a rank gave
        n < 1 or the sum is not exact in fp32 (one host read of W floats). The vector is then
        forgotten (the next step starts a new one)."""
        if self._vec is None:
            return
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
        every = read(self._vec, [float(self._sent)] * self.world, group)
        self._vec = None
        bad = [(r, x) for r, x in enumerate(every) if not (x >= 1)]
        if bad:
            raise ValueError(f"{self.who}: samples must be >= 1 on every rank; got "
                             f"{_ints(every)} (rank(s) {', '.join(f'{r}: {_int(x)}' for r, x in bad)}): "
                             "a rank with no sample this step cannot be weighted (give it at "
                             "least one, or leave it out of the group)")
        if sum(every) > EXACT:
            raise ValueError(f"{self.who}: the samples of a step sum to {sum(every):.0f} over "
                             f"{self.world} ranks, above {EXACT} (fp32's exact integers, what "
                             "the weights are summed in)")


def _int(x: float):
    return int(x) if x == x and float(x).is_integer() else x


def _ints(xs) -> list:
    return [_int(x) for x in xs]
