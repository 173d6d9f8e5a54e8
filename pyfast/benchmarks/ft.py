"""Per-step fault tolerance through torchft (`pyfast bench ft`): `pyfast train --ft` with G
replica groups of one rank against plain data parallelism over G ranks, on one link.

  cost       the median step_ms (steps 3.., group 0 / rank 0) of `--ft` (G groups, min G) and
             of `--nproc G --dp G`, same model, batch, seed: run back to back, --repeats times
             alternating; the ratio of the medians per repeat.
  recovery   torchft: G groups at --min-replicas 1, the last one's rank SIGKILLed by this
             process as soon as its metrics.jsonl holds step K (polled every 20 ms; death = the
             kill) and restarted by its own torchrun (--max-restarts 1); the lighthouse drops a
             silent group after --heartbeat-ms.
             Survivors: their step K+1 ended `survivor_s` after the death, `survivor_lost` =
             that time over a median step, minus the one step they would have taken anyway
             (target < 2), and how many of their steps did not commit. Restart: the restarted
             group's first committed step ended `restart_s` after the death (torchrun's
             restart, the imports, the model, the quorum and the heal from a peer).
             torchrun: `--nproc G --dp G --max-restarts 1 --ckpt-every C`, rank G-1 killed
             once rank 0 logged step K; every rank restarts from the checkpoint at C floor(K / C): the
             steps lost are K - that, and `back_s` = when step K+1 ended after the restart,
             counted from the death (the time to get back to where the failure was).
The link: "loopback", or a tc-shaped namespace ("1gbit": the whole scenario, lighthouse
included, runs inside one namespace whose lo is rate-limited; pyfast.netns).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from pyfast import netns, perf

LIGHTHOUSE = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")


def _port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class _Proc:
    """A `pyfast train` (or lighthouse) process, its output kept."""

    def __init__(self, cmd, env=None):
        # one thread a rank, as torchrun sets for more than one rank a node: G one-rank groups
        # on this machine's cores would otherwise oversubscribe them (measured: gpt-small --ft
        # 735 ms a step against plain dp's 431 with 2 threads a group; 460 vs 455 with one)
        e = {"OMP_NUM_THREADS": "1", **os.environ, **(env or {})}
        self.p = subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self):
        for line in self.p.stdout:
            self.lines.append((time.time(), line.rstrip()))

    def wait(self, timeout: float) -> int:
        try:
            return self.p.wait(timeout)
        finally:
            if self.p.poll() is None:
                os.killpg(self.p.pid, 9)
                self.p.wait()
            self._t.join(5)

    def stop(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, 9)
        self.p.wait()

    def tail(self, n=30) -> str:
        return "\n".join(line for _, line in self.lines[-n:])


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out + [g for c in out for g in _children(c)]


def _rank_pid(launcher: int, rank: int) -> int:
    """The pid of torchrun's worker `rank` under `launcher`: a forked rank by its title
    ("pyfast rank R/W: ...", pyfast.train.launch), an exec'd one by RANK in /proc/PID/environ."""
    for pid in _children(launcher):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().startswith(f"pyfast rank {rank}/".encode()):
                    return pid
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if env.get(b"RANK") == str(rank).encode() and b"TORCHELASTIC_RUN_ID" in env:
            return pid
    raise RuntimeError(f"no rank {rank} under pid {launcher}")


class _Killer(threading.Thread):
    """SIGKILL rank `rank` of the job launched as `proc` once `out`'s metrics.jsonl holds step
    `step` (polled every 20 ms); `death` is when."""

    def __init__(self, proc: _Proc, out: str, step: int, rank: int = 0):
        super().__init__(daemon=True)
        self.proc, self.out, self.step, self.rank, self.death = proc, out, step, rank, None
        self.start()

    def run(self):
        while self.proc.p.poll() is None:
            try:
                if any(r["step"] >= self.step for r in _records(self.out)):
                    os.kill(_rank_pid(self.proc.p.pid, self.rank), 9)
                    self.death = time.time()
                    return
            except (OSError, ValueError):  # not written yet, or a line half written
                pass
            time.sleep(0.02)


def _train(args):
    return [sys.executable, "-m", "pyfast", "train", "--tensorboard", "off", "--no-plot", *args]


def _records(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _median_ms(recs) -> float:
    return statistics.median(r["step_ms"] for r in recs[2:] if r.get("committed", True))


def _run_all(procs, timeout) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        code = p.wait(max(1.0, deadline - time.monotonic()))
        if code != 0:
            raise RuntimeError(f"exit {code}:\n{p.tail()}")


def _lighthouse(groups_min: int, heartbeat_ms: int):
    port = _port()
    lh = _Proc([LIGHTHOUSE, "--min_replicas", str(groups_min), "--join_timeout_ms", "200",
                "--heartbeat_timeout_ms", str(heartbeat_ms), "--quorum_tick_ms", "20",
                "--bind", f"127.0.0.1:{port}"])
    return lh, f"127.0.0.1:{port}"


def cost(common, groups, tmp, timeout) -> dict:
    lh, addr = _lighthouse(groups, 1000)
    try:
        ft = [_Proc(_train(common + ["--ft", "--lighthouse", addr, "--replica-id", str(g),
                                     "--min-replicas", str(groups), "--out",
                                     os.path.join(tmp, f"cost_ft{g}")]))
              for g in range(groups)]
        _run_all(ft, timeout)
    finally:
        lh.stop()
    plain = _Proc(_train(common + ["--nproc", str(groups), "--dp", str(groups), "--out",
                                   os.path.join(tmp, "cost_plain")]))
    _run_all([plain], timeout)
    fr, pr = _records(os.path.join(tmp, "cost_ft0")), _records(os.path.join(tmp, "cost_plain"))
    a, b = _median_ms(fr), _median_ms(pr)
    med = lambda rs, k: statistics.median(r[k] for r in rs[2:])  # noqa: E731
    return {"ft_step_ms": a, "plain_step_ms": b, "ratio": a / b,
            "ft_quorum_ms": med(fr, "quorum_ms"), "ft_exposed_comm_ms": med(fr, "exposed_comm_ms"),
            "plain_exposed_comm_ms": med(pr, "exposed_comm_ms")}


def recovery_ft(common, groups, kill_at, heartbeat_ms, tmp, timeout) -> dict:
    lh, addr = _lighthouse(1, heartbeat_ms)
    last = groups - 1
    try:
        procs = [_Proc(_train(common + ["--ft", "--lighthouse", addr, "--replica-id", str(g),
                                        "--min-replicas", "1", "--out",
                                        os.path.join(tmp, f"rec_ft{g}")]
                              + (["--max-restarts", "1"] if g == last else [])))
                 for g in range(groups)]
        killer = _Killer(procs[last], os.path.join(tmp, f"rec_ft{last}"), kill_at)
        _run_all(procs, timeout)
    finally:
        lh.stop()
    death = killer.death
    surv = _records(os.path.join(tmp, "rec_ft0"))
    step = _median_ms(surv) / 1e3
    ok = [r for r in surv if r["committed"]]
    # the survivors' step K (the victim's last logged one: the kill follows it), their first
    # step without the dead group, and the steps they committed from one to the other
    before = next(r for r in ok if r["step"] == kill_at)
    # None: the restarted group was back in the quorum before the lighthouse dropped it (its
    # heartbeat timeout), so the survivors never stepped without it (forked ranks restart in
    # well under a second: seen with gpt-tiny at a 500 ms timeout)
    after = next((r for r in ok if r["time"] > death and r["participants"] < groups), None)
    failed = sum(not r["committed"] for r in surv if r["time"] > death)
    back = [r for r in _records(os.path.join(tmp, f"rec_ft{last}")) if r["time"] > death
            and r["committed"]]
    healed = bool(back) and back[0]["step"] > kill_at + 1  # it rejoined a running quorum
    out = {"step_s": step, "survivor_failed_commits": failed, "rejoined_before_drop": after is None,
           "restart_s": back[0]["time"] - death if back else None,
           "restart_first_step": back[0]["step"] if back else None, "healed": healed}
    if after is None:
        return {**out, "death_to_survivor_step_s": None, "survivor_steps_lost": None,
                "participants_after": groups, "survivor_step_after": None}
    return {**out, "death_to_survivor_step_s": after["time"] - death,
            # the time from their last step before the death to their first without the dead
            # group, over a median step, less the steps they committed in it (failed commits
            # and the wait for the lighthouse to drop the group are what is left)
            "survivor_steps_lost": (after["time"] - before["time"]) / step
            - (after["step"] - before["step"]),
            "participants_after": after["participants"], "survivor_step_after": after["step"]}


def recovery_torchrun(common, groups, kill_at, ckpt_every, tmp, timeout) -> dict:
    out = os.path.join(tmp, "rec_plain")
    p = _Proc(_train(common + ["--nproc", str(groups), "--dp", str(groups), "--max-restarts",
                               "1", "--ckpt-every", str(ckpt_every), "--out", out]))
    killer = _Killer(p, out, kill_at, rank=groups - 1)
    _run_all([p], timeout)
    death = killer.death
    recs = [r for r in _records(out) if r["time"] > death]
    ck = ckpt_every * (kill_at // ckpt_every)
    again = next(r for r in recs if r["step"] == kill_at + 1)
    return {"ckpt_step": ck, "steps_lost": kill_at - ck, "step_s": _median_ms(recs) / 1e3,
            "first_step_after_restart_s": recs[0]["time"] - death,
            "back_s": again["time"] - death}


def run(model, groups, batch, seq, steps, kill_at, ckpt_every, heartbeat_ms, repeats, link,
        cost_steps=20, timeout=1200, compress="none") -> dict:
    if link != "loopback":  # the whole scenario inside one shaped namespace
        args = [sys.executable, "-m", "pyfast.benchmarks.ft", "--inner", "--link", "loopback",
                "--model", model, "--groups", str(groups), "--batch", str(batch), "--seq",
                str(seq), "--steps", str(steps), "--kill-at", str(kill_at), "--ckpt-every",
                str(ckpt_every), "--heartbeat-ms", str(heartbeat_ms), "--repeats", str(repeats),
                "--cost-steps", str(cost_steps), "--compress", compress]
        r = netns.run(args, link=link, timeout=timeout * 3)
        if r.returncode:
            raise RuntimeError(f"on {link}: exit {r.returncode}\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
        res = json.loads(r.stdout.strip().splitlines()[-1])
        res["link"] = link
        return res
    common = ["--model", model, "--batch", str(batch), "--seq", str(seq), "--steps",
              str(steps), "--eval-batches", "1", "--lr", "3e-4", "--compress", compress]
    rows = []
    with tempfile.TemporaryDirectory(prefix="pyfast-bench-ft-") as tmp:
        for i in range(repeats):
            d = os.path.join(tmp, str(i))
            short = common[:common.index("--steps") + 1] + [str(cost_steps)] + \
                common[common.index("--steps") + 2:]
            rows.append({"repeat": i, **cost(short, groups, d, timeout),
                         "ft": recovery_ft(common, groups, kill_at, heartbeat_ms, d, timeout),
                         "torchrun": recovery_torchrun(common, groups, kill_at, ckpt_every, d,
                                                       timeout)})
    return {"benchmark": "ft", "machine": perf.machine(), "date": time.strftime("%Y-%m-%d %H:%M"),
            "link": link, "model": model, "groups": groups, "batch": batch, "seq": seq,
            "steps": steps, "cost_steps": cost_steps, "compress": compress,
            "kill_at": kill_at, "ckpt_every": ckpt_every,
            "heartbeat_ms": heartbeat_ms, "load": os.getloadavg()[0], "rows": rows,
            "cost_ratio_median": statistics.median(r["ratio"] for r in rows)}


def table(res) -> str:
    lines = [f"pyfast bench ft: {res['model']}, {res['groups']} groups of 1 rank, batch "
             f"{res['batch']} x {res['seq']}, --compress {res.get('compress', 'none')}, link "
             f"{res['link']}, kill after step "
             f"{res['kill_at']}, lighthouse heartbeat {res['heartbeat_ms']} ms, torchrun "
             f"--ckpt-every {res['ckpt_every']}; {res['machine']}; load {res['load']:.1f}"]
    for r in res["rows"]:
        f, t = r["ft"], r["torchrun"]
        solo = ("no step without it: the restarted group was back before the lighthouse dropped "
                f"it (step {f['step_s']:.2f} s), {f['survivor_failed_commits']} failed commits"
                if f.get("rejoined_before_drop") else
                f"survivors' first step without it (step {f['survivor_step_after']}) "
                f"{f['death_to_survivor_step_s']:.2f} s after the death (step {f['step_s']:.2f} "
                f"s): {f['survivor_steps_lost']:.2f} steps lost, {f['survivor_failed_commits']} "
                f"failed commits, {f['participants_after']} group(s) then")
        lines.append(
            f"repeat {r['repeat']}: cost --ft {r['ft_step_ms']:.0f} ms vs plain dp "
            f"{r['plain_step_ms']:.0f} ms a step = {r['ratio']:.3f}x | torchft: {solo}; restarted group's first "
            f"committed step {_s(f['restart_s'])} s after the death (step "
            f"{f['restart_first_step']}, healed {f['healed']}) | torchrun: {t['steps_lost']} "
            f"steps lost (checkpoint at {t['ckpt_step']}), first step "
            f"{t['first_step_after_restart_s']:.2f} s after the death, back at step "
            f"{res['kill_at'] + 1} after {t['back_s']:.2f} s")
    lines.append(f"cost ratio, median over repeats: {res['cost_ratio_median']:.3f}x")
    return "\n".join(lines)


def _s(x):
    return "-" if x is None else f"{x:.2f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pyfast bench ft", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--cost-steps", type=int, default=20, help="steps of the cost runs")
    p.add_argument("--kill-at", type=int, default=6)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--heartbeat-ms", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--link", default="loopback")
    p.add_argument("--compress", default="none", help="both runs' gradient compressor (--ft: "
                   "across the groups; plain: over dp)")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    res = run(a.model, a.groups, a.batch, a.seq, a.steps, a.kill_at, a.ckpt_every,
              a.heartbeat_ms, a.repeats, a.link, a.cost_steps, compress=a.compress)
    if a.inner:  # inside the namespace: the result for the outer process
        print(json.dumps(res))
        return 0
    return perf.finish(res, table, a.out, width=200)


if __name__ == "__main__":
    raise SystemExit(main())
