"""Every timing that can see device work waits for the device first (pyfast.perf.clock): on
CUDA a kernel runs after the call that launched it returns, so a bare perf_counter times the
launch. No GPU here: torch.cuda.synchronize is replaced by a recorder, and the timing paths get
a CUDA device where they read only the device (a device object needs no GPU; a tensor-like
stub where they read `.device`). One process on torch's `fake` process group (world 2)."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pyfast import perf

CUDA = torch.device("cuda", 0)


class _OnCuda:
    """A tensor as a timing path sees it: only its device is read."""
    device = CUDA


pytestmark = pytest.mark.usefixtures("fake_world")  # tests/conftest.py


@pytest.fixture
def syncs(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda device=None: seen.append(torch.device(device)))
    return seen


def test_clock_synchronizes_cuda_only(syncs):
    for device in (CUDA, "cpu", torch.device("meta"), None):
        assert isinstance(perf.clock(device), float)
    assert syncs == [CUDA]
    assert perf.device_of(nn.Linear(2, 3, device="meta")) == torch.device("meta")
    assert perf.device_of(nn.ReLU()) is None
    assert perf.device_of([nn.ReLU(), nn.Linear(2, 3, device="meta")]) == torch.device("meta")


def test_harness_times_sync_each_end(syncs):
    ts = perf.times(lambda: None, repeats=3, warmup=1, device=CUDA)
    assert len(ts) == 3 and syncs == [CUDA] * 7  # the start of min_time, then 2 a call


def test_codec_probe_syncs(syncs):
    from pyfast.comm import cost
    codec = SimpleNamespace(compress=lambda x, name: None, decompress=lambda p: None)
    enc, dec = cost.codec_seconds(codec, _OnCuda(), repeats=2)
    assert enc >= 0 and dec >= 0 and syncs == [CUDA] * 6  # 3 clock reads a repeat


def test_link_probe_syncs(syncs):
    from pyfast.comm import cost
    cost._time(lambda: None, 3, None, CUDA)  # measure_link's timer, after a barrier
    assert syncs == [CUDA] * 6


def test_bucket_timing_on_the_worker_syncs(syncs):
    from pyfast.comm.collectives import Handle
    h = Handle.on_worker(lambda t: t, _OnCuda())
    h.wait()
    assert h.seconds >= 0 and syncs == [CUDA, CUDA]


def test_auto_step_time_syncs(syncs):
    from pyfast.comm.auto import AutoSelector
    sel = AutoSelector([SimpleNamespace(flat=_OnCuda(), index=0, name="b0")], None, True)
    sel.after_step([0.1])  # step 0: only the step's clock is read
    assert syncs == [CUDA]


def test_exposed_comm_time_is_timed_on_the_cuda_stream(monkeypatch, syncs):
    """DataParallel's last_wait_s on CUDA: two events recorded on the stream around the wait and
    copy back, resolved when it is read (one sync then); no host sync during the step, which
    would stop the CPU from queueing the next step's kernels (issue 25: 0.87x DDP on an H200
    with three syncs a step). Elsewhere the host clock."""
    from pyfast.parallel import data
    with torch.device("meta"):
        net = data.DataParallel(nn.Linear(5, 3), None, engine="python")
    made = []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.recorded = self.synced = False
            made.append(self)

        def record(self):
            self.recorded = True

        def synchronize(self):
            self.synced = True

        def elapsed_time(self, other):
            assert other is made[1]
            return 7.0  # milliseconds, as torch's

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(net, "_reduce_and_copy", lambda: [])
    monkeypatch.setattr(net, "_params", [_OnCuda()])
    net._finish()
    assert len(made) == 2 and all(e.recorded for e in made) and not any(e.synced for e in made)
    assert syncs == []
    assert net.last_wait_s == pytest.approx(0.007) and made[1].synced
    monkeypatch.setattr(net, "_params", [torch.empty(1, device="meta")])
    net._finish()  # not CUDA: the host clock, seconds
    assert len(made) == 2 and 0.0 <= net.last_wait_s < 1.0
    net.close()


def test_pipeline_layer_times_read_the_clock_on_the_examples_device(monkeypatch):
    """balance="time" partitions by these times: on CUDA, unsynchronized, they would be launch
    times and every stage boundary would move. Both ends of each timed run read perf.clock with
    the example's device (a CPU example runs here; the device is what is checked)."""
    from pyfast.parallel import schedules
    seen = []
    monkeypatch.setattr(schedules, "clock", lambda d=None: seen.append(torch.device(d)) or 0.0)
    seq = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    times = schedules.layer_times(seq, torch.randn(4, 5), repeats=3)
    assert len(times) == 3
    assert seen == [torch.device("cpu")] * (2 * 3 * 3)  # 2 reads x 3 repeats x 3 layers
