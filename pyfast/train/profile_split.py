"""Where a step goes, read from a torch profiler trace (Chrome/Perfetto JSON, the file
`pyfast train --profile` writes per rank): per step, the seconds and share of compute, exposed
communication, codec, pipeline bubble, data and other. Pure Python on the JSON (no torch), so
any trace can be split again later: `split(json.load(open(path)))`.

The step is the job's `pyfast.train.step#N` range (N: the job's step number) on the thread that ran it (the training
thread). Each instant of it goes to exactly one part, the first of PARTS (in this order of
precedence) whose ranges on that thread cover it, so the parts add up to the step:
- data:   pyfast.data.* (the batch fetch)
- codec:  pyfast.codec.* (compress / decode), also inside a collective's range, and the
          codec kernels of pyfast._C (the pyfast:: operators but adamw_)
- bubble: pyfast.pipe.wait (a stage waiting for its neighbour's activation or gradient)
- comm:   the other communication ranges the training thread sat in: pyfast.comm.*, dp.*,
          tp.*, cp.*, pipe.send / pipe.recv, zero.reduce / wait / gather, and torch's own
          c10d collectives (the job's small all-reduce of the loss and norm). Exposed: what
          ran on other threads meanwhile (the FIFO worker, the native engine, gloo's own:
          collectives in flight) is overlapped and reported apart: "background", the union
          of their comm and codec ranges and operators over the step
- compute: every torch operator (cpu_op: forward, autograd's backward nodes, the optimizer)
          and pyfast.pipe.F/B/I/W, pyfast.optim.*, pyfast.zero.step
- other:  the rest (Python between the operators: the loop, hooks, bookkeeping).
On CUDA the host thread's split is what the host waited on; each step also gets "device":
the GPU's kernel-busy seconds, its NCCL kernel seconds and the NCCL seconds no other kernel
overlapped (the device's exposed communication).
"""
from __future__ import annotations

STEP = "pyfast.train.step#"  # + the job's step number
PARTS = ("data", "codec", "bubble", "comm", "compute", "other")  # precedence order
COMM = ("pyfast.comm.", "pyfast.dp.", "pyfast.tp.", "pyfast.cp.", "pyfast.pipe.send",
        "pyfast.pipe.recv", "pyfast.zero.reduce", "pyfast.zero.wait", "pyfast.zero.gather")
TORCH_COMM = ("c10d::", "record_param_comms")  # the call itself: what the thread spent in it
# gloo's and NCCL's own annotations span a collective from its issue to its completion: on the
# training thread a receive posted ahead (the pipeline's) is in flight, not waited on (gpt-tiny
# pp2: 4.69 s of gloo:recv spans in two steps of 4.03 s), so they count as background only
IN_FLIGHT = ("gloo:", "nccl:")
NOT_CODEC = ("pyfast::adamw_",)  # pyfast._C's operators that are no codec
COMPUTE = ("pyfast.pipe.F", "pyfast.pipe.B", "pyfast.pipe.I", "pyfast.pipe.W", "pyfast.optim.",
           "pyfast.zero.step")


def part_of(name: str, cat: str) -> str | None:
    """The part a range or operator of the training thread belongs to (None: none, e.g. the
    step ranges themselves, Python function events)."""
    if name.startswith("pyfast.data."):
        return "data"
    if name.startswith("pyfast.codec.") or (name.startswith("pyfast::") and name not in NOT_CODEC):
        return "codec"
    if name == "pyfast.pipe.wait":
        return "bubble"
    if name.startswith(COMM) or name.startswith(TORCH_COMM):
        return "comm"
    if name.startswith(COMPUTE) or cat == "cpu_op":
        return "compute"
    return None


def merge(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint union of intervals."""
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        elif b > a:
            out.append([a, b])
    return [(a, b) for a, b in out]


def subtract(iv, cut) -> list[tuple[float, float]]:
    """merged iv minus merged cut (both sorted, disjoint)."""
    out, j = [], 0
    for a, b in iv:
        while j < len(cut) and cut[j][1] <= a:
            j += 1
        k, s = j, a
        while k < len(cut) and cut[k][0] < b:
            if cut[k][0] > s:
                out.append((s, cut[k][0]))
            s = max(s, cut[k][1])
            k += 1
        if s < b:
            out.append((s, b))
    return out


def length(iv) -> float:
    return sum(b - a for a, b in iv)


def _clip(a: float, b: float, lo: float, hi: float):
    return (max(a, lo), min(b, hi)) if a < hi and b > lo else None


def _events(trace: dict) -> list[dict]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def split(trace: dict) -> list[dict]:
    """One dict per pyfast.train.step#N range of the trace, in order: {"step" (N), "step_s", "<part>_s" and "<part>_pct" for each of
    PARTS, "background": {"comm_s", "codec_s"}, and on CUDA "device"}. Times in seconds."""
    evs = _events(trace)
    steps = sorted((e for e in evs if e["name"].startswith(STEP)), key=lambda e: e["ts"])
    kernels = [e for e in evs if e.get("cat") == "kernel"]
    out = []
    for st in steps:
        lo, hi, tid, pid = st["ts"], st["ts"] + st["dur"], st["tid"], st["pid"]
        by = {p: [] for p in PARTS}
        bg = {"comm": [], "codec": []}
        for e in evs:
            c = _clip(e["ts"], e["ts"] + e["dur"], lo, hi)
            if c is None or e is st:
                continue
            if e["tid"] == tid and e["pid"] == pid:
                p = part_of(e["name"], e.get("cat", ""))
                if p is not None:
                    by[p].append(c)
            else:  # overlapped: what the other threads did is told apart
                p = "comm" if e["name"].startswith(IN_FLIGHT) else part_of(e["name"], "")
                if p in bg:
                    bg[p].append(c)
        taken: list[tuple[float, float]] = []
        rec = {"step": int(st["name"][len(STEP):]), "step_s": (hi - lo) / 1e6}
        for p in PARTS[:-1]:
            own = subtract(merge(by[p]), taken)
            rec[f"{p}_s"] = length(own) / 1e6
            taken = merge(taken + own)
        rec["other_s"] = (hi - lo - length(taken)) / 1e6
        for p in PARTS:
            rec[f"{p}_pct"] = 100 * rec[f"{p}_s"] / rec["step_s"] if rec["step_s"] else 0.0
        rec["background"] = {f"{k}_s": length(merge(v)) / 1e6 for k, v in bg.items()}
        if kernels:
            rec["device"] = _device(kernels, lo, hi)
        out.append(rec)
    return out


def _device(kernels: list[dict], lo: float, hi: float) -> dict:
    """The GPU's side of the step window: busy (union of kernels), NCCL kernels, and the NCCL
    time that no compute kernel overlapped."""
    nccl, comp = [], []
    for k in kernels:
        c = _clip(k["ts"], k["ts"] + k["dur"], lo, hi)
        if c is not None:
            (nccl if "nccl" in k["name"].lower() else comp).append(c)
    nccl, comp = merge(nccl), merge(comp)
    return {"busy_s": length(merge(nccl + comp)) / 1e6, "nccl_s": length(nccl) / 1e6,
            "nccl_exposed_s": length(subtract(nccl, comp)) / 1e6}


def mean(steps: list[dict]) -> dict:
    """The parts averaged over the steps (seconds; shares of the mean step)."""
    if not steps:
        return {}
    n = len(steps)
    m = {"step_s": sum(s["step_s"] for s in steps) / n}
    for p in PARTS:
        m[f"{p}_s"] = sum(s[f"{p}_s"] for s in steps) / n
        m[f"{p}_pct"] = 100 * m[f"{p}_s"] / m["step_s"] if m["step_s"] else 0.0
    return m


def table(ranks: list[dict]) -> str:
    """The split of every rank's steps, one line each: ms and % of the step per part."""
    head = f"{'rank':>4} {'step':>5} {'step ms':>9} " + " ".join(f"{p:>15}" for p in PARTS)
    lines = [head]
    for r in ranks:
        for s in r["steps"]:
            cells = " ".join(f"{1e3 * s[p + '_s']:8.1f} {s[p + '_pct']:4.0f}%" for p in PARTS)
            lines.append(f"{r['rank']:>4} {s['step']:>5} {1e3 * s['step_s']:9.1f} {cells}")
    return "\n".join(lines)
