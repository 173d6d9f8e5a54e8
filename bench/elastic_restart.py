"""What an elastic restart costs (issue 35, part 2): `pyfast train --elastic` on gpt-tiny (batch 8,
seq 64), gloo on this machine's CPU cores, one thread a rank, two scenarios:

- node loss under torchrun: two torchrun agents on this machine act as two nodes of 2 ranks
  (`--nnodes 1:2 --rdzv-backend c10d`, agent A hosts the rendezvous store); after step 6
  (checkpoints every 4 steps) agent B and its ranks are SIGKILLed. A's ranks fail in their next
  collective, A re-forms the group alone (rendezvous last call: 3 s), and its new ranks re-plan
  dp 4 -> 2, resume step 4's checkpoint and go on. Timed: kill -> first step after the restart,
  and the new ranks' process start (/proc starttime) -> that first step; steps lost: the steps
  logged past the checkpoint, recomputed.
- restart at another size with pyfast's launcher: a 4-rank run's step-4 checkpoint, continued
  by `pyfast train --elastic --nproc 2` (4 -> 2) and `--nproc 4` (4 -> 4), command start -> first
  step, in one run, each after the other.

    PYTHONPATH=$PWD python bench/elastic_restart.py RUN   -> bench/results/elastic_RUN.json
    (then bench/results/elastic.txt is rewritten from every elastic_*.json there)
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
FLAGS = ["--model", "gpt-tiny", "--batch", "8", "--seq", "64", "--seed", "1", "--dp", "4",
         "--elastic", "--ckpt-every", "4", "--eval-every", "0", "--warmup", "1",
         "--lr-decay-steps", "12", "--no-tensorboard"]
KILL_AFTER, CKPT = 6, 4
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
       "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # pytorch#135712 (launch.py)
PY = sys.executable


def records(out: Path) -> list[dict]:
    p = out / "metrics.jsonl"
    if not p.exists():
        return []
    lines = p.read_text().splitlines()
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return out


def wait_for(pred, timeout: float, what: str, procs=()):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        for p in procs:
            if p.poll() is not None and p.returncode != 0:
                raise RuntimeError(f"{what}: a process exited {p.returncode}")
        time.sleep(0.02)
    raise TimeoutError(f"{what}: not within {timeout} s")


def started_at(pid: int) -> float:
    """The wall-clock time process `pid` started (/proc/PID/stat field 22, ticks since boot)."""
    ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> set[int]:
    try:
        return {int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
    except FileNotFoundError:
        return set()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_loss(tmp: Path) -> dict:
    out, port = tmp / "node_loss", free_port()
    steps = KILL_AFTER + 4

    def agent(host: bool, log: str):
        cmd = [PY, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "elastic-bench", "--max-restarts", "3",
               "--rdzv-conf", f"is_host={int(host)},last_call_timeout=3",
               "-m", "pyfast", "train", *FLAGS, "--steps", str(steps), "--out", str(out)]
        return subprocess.Popen(cmd, env=ENV, stdout=open(tmp / log, "w"),
                                stderr=subprocess.STDOUT)
    a = agent(True, "agent_a.log")
    time.sleep(0.5)  # A binds the store first
    b = agent(False, "agent_b.log")
    try:
        wait_for(lambda: len(records(out)) >= KILL_AFTER, 300, "steps before the kill", (a, b))
        victims = [b.pid, *children(b.pid)]
        for pid in victims:  # node B: its agent and the ranks it started
            os.kill(pid, signal.SIGKILL)
        t_kill = time.time()
        logged = max(r["step"] for r in records(out))
        old = children(a.pid)
        new = wait_for(lambda: children(a.pid) - old or None, 300, "A's new ranks", (a,))
        t_proc = min(started_at(p) for p in new)
        first = wait_for(lambda: next((r for r in records(out) if "elastic" in r), None), 300,
                         "the first step after the restart", (a,))
        t_first = time.time()
        a.wait(timeout=300)
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()
    meta = json.loads((out / "checkpoints" / f"step-{CKPT}" / "meta.json").read_text())
    recs = records(out)
    assert meta["mesh"]["dp"] == 4, "the run before the kill was not at world 4"
    assert not any("elastic" in r for r in recs[:CKPT]), "the first start was not at world 4"
    return {"kill_after_step": logged, "checkpoint_step": first["step"] - 1,
            "steps_lost": logged - (first["step"] - 1), "restart_line": first["elastic"],
            "kill_to_first_step_s": t_first - t_kill,
            "kill_to_new_ranks_s": t_proc - t_kill,
            "process_start_to_first_step_s": t_first - t_proc,
            "first_step_ms": first["step_ms"], "exit_code": a.returncode,
            "steps_done": recs[-1]["step"]}


def launcher(tmp: Path) -> dict:
    src = tmp / "four"
    subprocess.run([PY, "-m", "pyfast", "train", *FLAGS, "--steps", str(CKPT), "--out",
                    str(src), "--nproc", "4"], env=ENV, check=True, capture_output=True)
    res = {}
    for n in (2, 4):
        out = tmp / f"to{n}"
        subprocess.run(["cp", "-r", str(src), str(out)], check=True)
        t0 = time.time()
        p = subprocess.Popen([PY, "-m", "pyfast", "train", *FLAGS, "--steps", str(CKPT + 2),
                              "--allow-change", "steps", "--out", str(out), "--nproc", str(n)],
                             env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_for(lambda: len(records(out)) > CKPT, 300, f"--nproc {n}'s first step", (p,))
        t = time.time() - t0
        log = p.communicate(timeout=300)[0]
        assert p.returncode == 0, log[-3000:]
        first = records(out)[CKPT]
        res[f"4_to_{n}"] = {"command_start_to_first_step_s": t, "first_step_ms": first["step_ms"],
                            "restart_line": first.get("elastic")}
    return res


def main(run: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        rec = {"run": run, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                   timespec="seconds"),
               "machine": f"{platform.node()} ({os.cpu_count()} cores, CPU, gloo)",
               "node_loss": node_loss(tmp), "launcher": launcher(tmp)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"elastic_{run}.json").write_text(json.dumps(rec, indent=1) + "\n")
    write_txt()


def write_txt() -> None:
    runs = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("elastic_*.json"))]
    lines = ["# pyfast train --elastic: restart cost (bench/elastic_restart.py; gpt-tiny, batch 8, "
             "seq 64, gloo, 1 thread a rank)",
             "# other helpers' niced jobs shared the 2 cores during these runs", ""]
    for r in runs:
        nl, la = r["node_loss"], r["launcher"]
        lines += [f"run {r['run']}  {r['date']}  {r['machine']}",
                  f"  node loss (torchrun --nnodes 1:2, 2+2 ranks, node B killed after step "
                  f"{nl['kill_after_step']}, checkpoint at step {nl['checkpoint_step']}):",
                  f"    {nl['restart_line']}",
                  f"    steps lost (recomputed): {nl['steps_lost']}",
                  f"    kill -> first step after restart: {nl['kill_to_first_step_s']:.1f} s "
                  f"(kill -> new ranks started {nl['kill_to_new_ranks_s']:.1f} s; new ranks' "
                  f"process start -> first step {nl['process_start_to_first_step_s']:.1f} s; "
                  f"that step {nl['first_step_ms']:.0f} ms)",
                  "  pyfast's launcher on a 4-rank step-4 checkpoint, command start -> first step:"]
        for k, v in la.items():
            lines.append(f"    {k.replace('_', ' ')}: {v['command_start_to_first_step_s']:.1f} s "
                         f"(that step {v['first_step_ms']:.0f} ms; {v['restart_line']})")
        lines.append("")
    lines += ["Kill -> new ranks: the survivors' collective fails within ~1 s (gloo: connection "
              "reset; 0.9 s in the agent's log of a trial run), then torchrun's c10d rendezvous "
              "drops the dead node only when its heartbeats lapse (keep_alive_interval 5 s x "
              "keep_alive_max_attempt 3, torchrun's defaults, settable in --rdzv-conf) and waits "
              "its last call (last_call_timeout=3 here) for more nodes.", ""]
    (RESULTS / "elastic.txt").write_text("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "a")
