"""What a launch costs by how its ranks start (`pyfast train --start-method`, issue 32 item 6):
`pyfast train --nproc 2 --dp 2` of gpt-tiny for 2 steps (batch 4, seq 32), command start ->
exit, forkserver and exec alternated in one run; and the same with `--max-restarts 1` and rank
1 SIGKILLed after step 1 (tests/faults' PYFAST_FAULT), so torchrun starts the ranks twice.

    PYTHONPATH=$PWD python bench/launch_start.py [PAIRS] [BEFORE]
        -> bench/results/launch_start.{json,txt}; BEFORE: a checkout of the code before
           (git worktree add --detach DIR 7e555a3, its pyfast/_C*.so copied in), timed as a third
           column in the same alternation
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
FLAGS = ["--nproc", "2", "--dp", "2", "--model", "gpt-tiny", "--steps", "2", "--batch", "4",
         "--seq", "32", "--no-tensorboard", "--ckpt-every", "1"]
# the tests' fault injection (tests/faults/sitecustomize.py) for the restart case
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "faults"), str(REPO)])}


def one(method: str, restart: bool, before: str | None = None) -> float:
    """method "before": the BEFORE checkout's launcher (exec'd ranks, the interpreter's
    teardown at exit)."""
    with tempfile.TemporaryDirectory() as d:
        extra = ["--max-restarts", "1"] if restart else []
        env = {**ENV, "PYFAST_FAULT": "step@1:1"} if restart else dict(ENV)
        start = []
        if method == "before":
            env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests" / "faults"), before])
        else:
            start = ["--start-method", method]
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "pyfast", "train", *FLAGS, *extra, *start,
                            "--out", d], env=env, capture_output=True, text=True, timeout=600,
                           cwd=before if method == "before" else REPO)
        took = time.monotonic() - t0
        if p.returncode != 0 or (restart and "SIGKILL rank 1" not in p.stderr):
            raise RuntimeError(f"{method} restart={restart}: exit {p.returncode}\n"
                               f"{p.stderr[-3000:]}")
        return took


def main(pairs: int = 3, before: str | None = None) -> None:
    methods = ("forkserver", "exec") + (("before",) if before else ())
    rows = {f"{m} {c}": [] for c in ("launch", "restart") for m in methods}
    for _ in range(pairs):
        for case in ("launch", "restart"):
            for m in methods:  # alternated: the machine's drift hits each alike
                rows[f"{m} {case}"].append(one(m, case == "restart", before))
    load = os.getloadavg()[0]
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "machine": f"{platform.node()} {os.cpu_count()} cores", "flags": FLAGS,
           "pairs": pairs, "before": before, "load1_after": load, "seconds": rows,
           "median_s": {k: statistics.median(v) for k, v in rows.items()}}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "launch_start.json").write_text(json.dumps(out, indent=1) + "\n")
    lines = [f"# bench/launch_start.py, {out['date']}, {out['machine']}, {pairs} alternated rounds"
             + (f"; before = {before}" if before else ""),
             f"# pyfast train {' '.join(FLAGS)}; restart: --max-restarts 1, rank 1 SIGKILLed "
             "after step 1", "# case                 median s   runs (s)"]
    for k, v in rows.items():
        lines.append(f"{k:22s} {statistics.median(v):8.2f}   " + " ".join(f"{x:.2f}" for x in v))
    for case in ("launch", "restart"):
        med = {m: out["median_s"][f"{m} {case}"] for m in methods}
        lines.append(f"# {case}: forkserver / exec = {med['forkserver'] / med['exec']:.2f}" +
                     (f", forkserver / before = {med['forkserver'] / med['before']:.2f}, "
                      f"exec / before = {med['exec'] / med['before']:.2f}" if before else "")
                     + " (medians)")
    (RESULTS / "launch_start.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3, sys.argv[2] if len(sys.argv) > 2 else None)
