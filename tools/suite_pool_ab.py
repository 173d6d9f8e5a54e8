"""A/B of the suite's lever: test_hf_parallel's (and test_train_cp's) fixture runs as CLI launches
(tests/test_train.train_many, 2 at a time, as before) or as the job on forked RankPool ranks
(pool_runs). Run from the repo root: python tools/suite_pool_ab.py cli|pool OUT [--hf-only]
(bench/results/test_suite.txt, 2026-11-28: --hf-only, in a cpuacct cgroup per run)."""
import os
import sys
import time

sys.path.insert(0, "tests")
import conftest  # noqa: F401,E402  (TRITON_INTERPRET, the faults path, as pytest sets them)
from test_train import ok, pool_runs, train_many  # noqa: E402
from test_hf_parallel import JOBS as HFJ  # noqa: E402
from test_train_cp import CP  # noqa: E402
if __name__ == "__main__":
    mode, root = sys.argv[1], sys.argv[2]
    jobs = {f"hf-{n}": v for n, v in HFJ.items()}
    if "--hf-only" not in sys.argv:
        jobs.update({f"cp-{n}": v[:2] for n, v in CP.items()})
    t0 = time.time()
    if mode == "cli":
        for p in train_many({n: (os.path.join(root, n), *v) for n, v in jobs.items()}).values():
            ok(p)
    else:
        pool_runs({n: (os.path.join(root, n), *v) for n, v in jobs.items()})
        from test_train import _POOLS
        for p in _POOLS.values():
            p.close()
    print(f"{mode}: {len(jobs)} jobs in {time.time() - t0:.1f} s wall")
