"""The data path: `pyfast data prepare` throughput and what the train loop's data costs a step.

    pyfast bench data [--mb 16] [--bpe 8192] [--rss-mb 2,200] [--out bench/results/data]

1. prepare: a JSONL of the stdlib's .py files (one document each, cut at --mb MB) tokenized
   with bytes and with a byte-level BPE trained on it (--bpe tokens; its training is timed
   apart), by --workers 1 (one process: the tokenizer's own threads) and 2 (two processes of one
   thread, over 4 MB line ranges); MB/s of text, median of --repeats, variants in turns so the
   machine's load hits them alike.
2. step: gpt-small at batch 8 x seq 256 on one process: Batches.next() from the memory-mapped
   BPE dataset against the model's forward + backward on that batch (medians).
3. rss: a fresh process memory-maps a prepared dataset of each --rss-mb size (bytes of the
   stdlib text repeated) and takes --steps batches; its anonymous RSS (the process's own memory)
   and file RSS (page cache mapped in: reclaimable, bounded by the pages the batches touch) grow
   by the same amount at 2 MB and at 200 MB, except for Batches' epoch permutation (int64 per
   sequence: 1/64 of a uint16 corpus's bytes at seq 256). The same text file read by the bytes
   path (load_corpus(FILE)) is the contrast: it holds the whole corpus in anonymous memory.
   File RSS is page cache mapped in: on this machine (Linux 6.18, ext4) a fault maps the whole
   cached folio around the page a window touches, so it grows faster than the bytes read.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

from pyfast import perf

MB = 1 << 20


def corpus(path: str, mb: float) -> int:
    """Write the stdlib's .py files (sorted, site-packages skipped) as JSONL, `mb` MB of text
    (U+FFFD for the few non-UTF-8 bytes; repeated if the stdlib is smaller); returns its bytes."""
    root = sysconfig.get_paths()["stdlib"]
    names = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "dist-packages"))
        names += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
    n, limit = 0, int(mb * MB)
    with open(path, "w") as out:
        while n < limit:
            for name in names:
                with open(name, "rb") as f:  # the last document cut to size
                    t = f.read(limit - n).decode(errors="replace")
                out.write(json.dumps({"text": t}) + "\n")
                n += len(t.encode())
                if n >= limit:
                    break
    return n


def _prepare_rows(src: str, tok: str, mb: float, repeats: int, d: str) -> list[dict]:
    from pyfast.prepare import prepare
    variants = [(t, w) for t in ("bytes", tok) for w in (1, 2)]
    times = {v: [] for v in variants}
    for r in range(repeats):
        for i in range(len(variants)):  # rotated order: load drift hits every variant alike
            t, w = variants[(i + r) % len(variants)]
            out = os.path.join(d, f"p{r}_{i}")
            t0 = time.perf_counter()
            prepare([src], out, tokenizer=t, workers=w, val_fraction=0.01)
            times[(t, w)].append(time.perf_counter() - t0)
    rows = []
    for (t, w), ts in times.items():
        s = statistics.median(ts)
        rows.append({"tokenizer": "bytes" if t == "bytes" else "bpe", "workers": w, "mb": mb,
                     "median_s": s, "mb_per_s": mb / s})
    return rows


def _step(data: str, model_name: str, batch: int, seq: int, repeats: int) -> dict:
    import torch
    import torch.nn.functional as F

    from pyfast import models
    from pyfast.data import Batches, load_corpus
    c = load_corpus(data)
    b = Batches(c.train, batch, seq, seed=0)
    data_s = perf.times(b.next, repeats=max(repeats, 50), warmup=2)
    torch.manual_seed(0)
    model = models.build(model_name, c.vocab_size, seq)
    x, y = b.next()

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x).flatten(0, -2).float(), y.flatten()).backward()
    compute_s = perf.times(fwd_bwd, repeats=repeats, warmup=1)
    data_m, compute_m = statistics.median(data_s), statistics.median(compute_s)
    return {"model": model_name, "batch": batch, "seq": seq, "threads": torch.get_num_threads(),
            "data_s": data_m, "compute_s": compute_m, "data_share": data_m / compute_m}


RSS_CHILD = r"""
import json, sys
import numpy as np
def rss():
    out = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("RssAnon", "RssFile", "VmHWM"):
            out[k] = int(v.split()[0]) * 1024
    return out
from pyfast.data import Batches, load_corpus
path, steps = sys.argv[1], int(sys.argv[2])
warm = Batches(np.arange(1 << 16, dtype=np.uint16), 8, 256, seed=0)
for _ in range(3):  # torch's and numpy's code paths paged in before the baseline
    warm.next()
r0 = rss()
c = load_corpus(path)
b = Batches(c.train, 8, 256, seed=0)
for _ in range(steps):
    b.next()
r1 = rss()
print(json.dumps({k: r1[k] - r0[k] for k in r0} | {"tokens": len(c.train) + len(c.val),
                                                     "sequences": b.sequences}))
"""


def _rss(path: str, steps: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", RSS_CHILD, path, str(steps)], env=env,
                       capture_output=True, text=True, timeout=600)
    if p.returncode:
        raise RuntimeError(f"rss child failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _rss_rows(sizes, steps: int, d: str) -> list[dict]:
    from pyfast.prepare import prepare
    rows = []
    for mb in sizes:
        src = os.path.join(d, f"rss{mb}.jsonl")
        n = corpus(src, mb)
        out = os.path.join(d, f"rss{mb}")
        prepare([src], out, workers=2, val_fraction=0.01)
        for how, path in (("prepared (memmap)", out), ("text file (read)", src)):
            r = _rss(path, steps)
            rows.append({"mb": n / MB, "path": how, "steps": steps, "tokens": r["tokens"],
                         "anon_mb": r["RssAnon"] / MB, "file_mb": r["RssFile"] / MB,
                         # Batches' epoch permutation: int64 per sequence (randperm)
                         "perm_mb": r["sequences"] * 8 / MB})
    return rows


def run(mb: float = 16, bpe: int = 8192, repeats: int = 3, rss_mb=(2, 200), steps: int = 200,
        model: str = "gpt-small", batch: int = 8, seq: int = 256, step_repeats: int = 5) -> dict:
    from pyfast.prepare import load_tokenizer, prepare
    with tempfile.TemporaryDirectory(prefix="pyfast_bench_data_") as d:
        src = os.path.join(d, "corpus.jsonl")
        text_mb = corpus(src, mb) / MB
        t0 = time.perf_counter()  # the trained BPE, once: its training is a separate cost
        bpe_dir = os.path.join(d, "bpe")
        prepare([src], bpe_dir, train_bpe_n=bpe, workers=2, val_fraction=0.01)
        bpe_s = time.perf_counter() - t0
        tok = os.path.join(bpe_dir, "tokenizer.json")
        vocab = load_tokenizer(tok).get_vocab_size()
        rows = _prepare_rows(src, tok, text_mb, repeats, d)
        step = _step(bpe_dir, model, batch, seq, step_repeats)
        rss = _rss_rows(rss_mb, steps, d)
    return {"machine": perf.machine(), "date": datetime.datetime.now().isoformat(
        timespec="seconds"), "corpus": f"stdlib .py files as JSONL, {text_mb:.1f} MB",
        "bpe_vocab": vocab, "bpe_train_and_prepare_s": bpe_s, "repeats": repeats,
        "rows": rows, "step": step, "rss": rss}


def table(res: dict) -> str:
    lines = [f"pyfast data prepare, {res['corpus']}; medians of {res['repeats']}; "
             f"{res['machine']}; {res['date']}",
             f"{'tokenizer':<10}{'workers':>8}{'MB':>8}{'s':>8}{'MB/s':>8}"]
    for r in res["rows"]:
        lines.append(f"{r['tokenizer']:<10}{r['workers']:>8}{r['mb']:>8.1f}"
                     f"{r['median_s']:>8.2f}{r['mb_per_s']:>8.2f}")
    lines.append(f"bpe: vocab {res['bpe_vocab']:,}, trained + prepared (2 workers) in "
                 f"{res['bpe_train_and_prepare_s']:.1f} s")
    s = res["step"]
    lines += ["", f"train loop, {s['model']} batch {s['batch']} x seq {s['seq']}, one process, "
              f"{s['threads']} threads: data {s['data_s'] * 1e3:.3f} ms/step (Batches.next "
              f"from the memmap), fwd+bwd {s['compute_s'] * 1e3:.0f} ms: data = "
              f"{s['data_share']:.3%} of compute", "",
              "RSS growth of a process that loads the corpus and takes batches (8 x 256); anon: "
              "its own memory (perm: of which Batches' permutation, 8 B per sequence); file: "
              "page cache mapped in (shared, reclaimable)",
              f"{'corpus MB':>10}  {'path':<20}{'steps':>6}{'anon MB':>9}{'perm MB':>9}"
              f"{'file MB':>9}"]
    for r in res["rss"]:
        lines.append(f"{r['mb']:>10.1f}  {r['path']:<20}{r['steps']:>6}{r['anon_mb']:>9.1f}"
                     f"{r['perm_mb']:>9.1f}{r['file_mb']:>9.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pyfast bench data", description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=float, default=16, help="MB of text for the prepare timings")
    p.add_argument("--bpe", type=int, default=8192, help="the trained BPE's vocabulary")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rss-mb", default="2,200", help="corpus sizes for the RSS measurement")
    p.add_argument("--steps", type=int, default=200, help="batches per RSS measurement")
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--out", default="", help="write OUT.json and OUT.txt")
    a = p.parse_args(argv)
    if a.repeats < 1 or a.mb <= 0:
        p.error("--repeats must be >= 1 and --mb > 0")
    res = run(a.mb, a.bpe, a.repeats, tuple(float(x) for x in a.rss_mb.split(",")), a.steps,
              a.model)
    return perf.finish(res, table, a.out)


if __name__ == "__main__":
    sys.exit(main())
