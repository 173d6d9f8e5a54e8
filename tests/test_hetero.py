"""pyfast.hetero: a CPU cap that really bites, and is undone (the emulated slow rank of issue 36's
mixed-hardware benchmarks)."""
import os
import pathlib
import time

import pytest

from pyfast import hetero

pytestmark = pytest.mark.skipif(bool(hetero.available()), reason=hetero.available() or "ok")


def _cgroup_line() -> str:
    return pathlib.Path(f"/proc/{os.getpid()}/cgroup").read_text()


def test_throttle_caps_and_restores():
    before = _cgroup_line()
    with hetero.throttle(0.2) as group:
        assert group.name in _cgroup_line()
        t = time.perf_counter()
        while time.perf_counter() - t < 0.35:  # busy: at 0.2 CPU it must hit the quota
            pass
        throttled, periods = hetero.throttled_usage(group)
        assert periods >= 2 and throttled >= 1, (throttled, periods)
    assert _cgroup_line() == before
    assert not group.exists()


def test_bad_share():
    with pytest.raises(ValueError, match="share must be > 0"):
        with hetero.throttle(0):
            pass


def test_hold_outlives_its_caller():
    import gc
    group = hetero.hold(0.9)
    gc.collect()  # a bare throttle(...).__enter__() would be collected here and lift the cap
    assert group.name in _cgroup_line()
    cm = hetero._held.pop()
    cm.__exit__(None, None, None)
    assert group.name not in _cgroup_line()
