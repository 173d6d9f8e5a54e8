import os
import zlib

# Triton kernels run on CPU tensors only in Triton's interpreter, which is chosen when a kernel
# is decorated: set it before anything imports pyfast.kernels (no GPU on the test machines).
if os.environ.get("PYFAST_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Fault injection lives in tests, not in pyfast: every process a test starts runs
# tests/faults/sitecustomize.py, which acts only where a test sets PYFAST_FAULT or
# PYFAST_ABLATE_FAULT (it wraps the ranks' functions as their modules load).
_FAULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "faults")
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_FAULTS] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

import pytest  # noqa: E402
import torch  # noqa: E402

from pyfast.ops import status  # noqa: E402


def backend_params():
    """cpp and triton, each skipped with the reason when it cannot run here."""
    out = []
    for name in ("cpp", "triton"):
        ok, why = status(name, torch.device("cpu"))
        out.append(pytest.param(name, marks=pytest.mark.skipif(not ok, reason=why)))
    return out


@pytest.fixture(autouse=True)
def _seed(request):
    # fresh random inputs per test, but reproducible from the test's name
    # crc32, not hash(): str hashes are salted per process (PYTHONHASHSEED), which made
    # "reproducible" seeds change from run to run
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="module")
def pool2():
    """Two ranks started once per test module, for the cases that leave their group in step;
    module scope: each file starts from fresh ranks (forked from dist_utils' forkserver in
    ~0.05 s, so a wider scope would save nothing worth a file's state leaking into the next)."""
    from dist_utils import RankPool
    with RankPool(2) as pool:
        yield pool


@pytest.fixture(scope="module")
def pool4():
    """Four ranks, as pool2."""
    from dist_utils import RankPool
    with RankPool(4) as pool:
        yield pool


@pytest.fixture(scope="module")
def fake_world():
    """This process as rank 0 of 2 on torch's `fake` group, for a module's tests (no peers:
    collectives return at once, a read of their result gets this rank's values). A module asks
    for it with `pytestmark = pytest.mark.usefixtures("fake_world")`."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()
