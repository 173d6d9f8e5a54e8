"""pyfast.comm.failure: which errors are a communication failure, and when a module breaks."""
import datetime

import pytest
import torch.distributed as dist

from pyfast.comm.failure import Breaker, CommError, as_timedelta, naming


def _raise(e):
    with naming("all_reduce of bucket0 (int8, allgather)"):
        raise e


def test_transport_errors_become_comm_errors_naming_the_op():
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    for e in (gloo, RuntimeError("Application timeout caused pair closure"),
              dist.DistBackendError("NCCL watchdog: collective timed out")):
        with pytest.raises(CommError, match=r"all_reduce of bucket0 \(int8, allgather\) failed"):
            _raise(e)
    with pytest.raises(CommError, match=r"^DataParallel: all_reduce of bucket0 failed"):
        with naming("DataParallel"):
            raise CommError("all_reduce of bucket0 failed")


def test_a_bug_is_not_labelled_a_comm_failure():
    bug = RuntimeError("The size of tensor a (3) must match the size of tensor b (4)")
    with pytest.raises(RuntimeError) as info:
        _raise(bug)
    assert info.value is bug  # unchanged: not a CommError
    with pytest.raises(ValueError):
        _raise(ValueError("bad spec"))


def test_breaker_trips_on_failures_not_on_bad_input():
    b = Breaker("this module")
    with pytest.raises(ValueError):
        with b.guard("step"):
            raise ValueError("NaN/Inf gradients (raised the same way on every rank)")
    b.check()  # still usable
    with pytest.raises(RuntimeError):
        with b.guard("step"):
            raise RuntimeError("shape mismatch on this rank only")
    with pytest.raises(CommError, match="this module is broken by an earlier failure"):
        b.check()


def test_timeouts():
    assert as_timedelta(None) is None
    assert as_timedelta(2.5) == datetime.timedelta(seconds=2.5)
    assert as_timedelta(datetime.timedelta(seconds=3)).total_seconds() == 3
    for bad in (0, -1, datetime.timedelta(0)):
        with pytest.raises(ValueError, match="timeout must be > 0"):
            as_timedelta(bad)
    for bad in ("3", True):
        with pytest.raises(TypeError, match="seconds or a datetime.timedelta"):
            as_timedelta(bad)
