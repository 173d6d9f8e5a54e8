"""The `samples` attribute that DataParallel and zero's model share: this rank's samples this
step, for sample-weighted data parallel (the weighting itself: pyfast.comm.weights; the user
guide: docs/hetero.md). A reducer using it holds `_weights` (a comm.weights.SampleWeights) and
answers `_torchft()` (whether torchft's quorum reduces it: samples are refused there, since the
average's divisor is the step's participants, known only after the quorum).
"""
from __future__ import annotations

from pyfast.comm.weights import check_samples


def refuse_torchft(who: str, samples) -> None:
    """FTError if `samples` is set for a reducer under torchft (before any collective)."""
    if check_samples(samples, who) is not None:
        from pyfast.parallel.ft import FTError  # lazily: ft is imported by what imports this
        raise FTError(f"{who}(replicas=..., samples=...): not supported under torchft (the "
                      "average's divisor is the step's participants); give every rank the "
                      "same batch")


class Samples:
    """Mixin: `samples` (module docstring), and the bucketer's weight hook."""

    @property
    def samples(self):
        """This rank's samples this step (an int), or None: the plain mean."""
        return self._weights.n

    @samples.setter
    def samples(self, n) -> None:
        n = check_samples(n, self._weights.who)
        if self._torchft():
            refuse_torchft(self._weights.who, n)
        self._weights.n = n

    def _weight(self, scale):
        """A bucket's copy-in factor: scale, times this rank's weight when the step is
        weighted (comm.buckets.Bucketer.weight)."""
        return self._weights.weight(scale) if self._weights.active else scale
