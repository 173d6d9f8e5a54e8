"""Calibration probes of compute (pyfast.plan.calibrate): each module's forward and backward
at a plan's local shape, the optimizer, a copy, the codecs, a cp plan's block on cp ranks."""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from .hardware import Cluster
from .spec import ModelShape, Plan, Workload, gpt_model_flag
from . import timing
from .calibrate_link import REPEATS, _child, _finish


def _time(fn, repeats: int = REPEATS) -> float:
    import time
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _local_block(shape: ModelShape, plan: Plan, work: Workload):
    """pyfast's GPT Block at a tp rank's shard sizes (qkv/fc columns and proj rows / tp:
    Attention takes its local head count from qkv's rows, as under parallelize)."""
    import torch
    from pyfast import models
    model = models.build(gpt_model_flag(replace(shape, layers=1)), shape.vocab, work.seq)
    block = model[1]
    t, h, f = plan.tp, shape.hidden, shape.ffn
    if t > 1:
        block.attn.qkv = torch.nn.Linear(h, 3 * h // t)
        block.attn.proj = torch.nn.Linear(h // t, h)
        block.mlp.fc = torch.nn.Linear(h, f // t)
        block.mlp.proj = torch.nn.Linear(f // t, h)
    block.checkpointed = plan.activation_checkpointing
    return model, block


def _fwd_bwd(module, make_in, loss_of=None) -> tuple[float, float]:
    """(forward, backward) seconds, medians."""
    import time
    fs, bs = [], []
    for i in range(REPEATS + 1):
        x = make_in()
        t0 = time.perf_counter()
        y = module(x)
        out = loss_of(y) if loss_of else y
        t1 = time.perf_counter()
        if loss_of:
            out.backward()
        else:
            out.backward(torch_randn_like(out))
        t2 = time.perf_counter()
        if i:
            fs.append(t1 - t0)
            bs.append(t2 - t1)
    return statistics.median(fs), statistics.median(bs)


def torch_randn_like(t):
    import torch
    return torch.randn_like(t)


def measure_compute(shape: ModelShape, work: Workload, plans) -> dict:
    """{"compute": ..., "flops_s": ..., "optim_s_per_param": ...} timed here, 1 thread."""
    import torch
    import torch.nn.functional as F
    from pyfast.train.job import AMP
    torch.set_num_threads(1)
    torch.manual_seed(0)
    out, rates = {}, []
    for plan in plans:
        s, b = work.seq // plan.cp, plan.micro_batch
        model, block = _local_block(shape, plan, work)

        def run(mod):  # the job autocasts each top-level layer's forward (autocast_layers)
            if work.precision not in AMP:
                return mod
            return torch.autocast("cpu", dtype=AMP[work.precision])(mod.forward)

        key = timing.compute_key("block", plan, work)
        if key not in out:
            fb = _fwd_bwd(run(block), lambda: torch.randn(b, s, shape.hidden, requires_grad=True))
            out[key] = list(fb)
            _, ps = timing._modules(shape, plan, 0)[1]
            fl = timing._module_s("block", ps, shape, plan, work, _unit_cluster())[0]
            rates.append(fl / fb[0])  # _unit_cluster: 1 FLOP/s, so forward "seconds" = FLOPs
        key = timing.compute_key("embed", plan, work)
        if key not in out:
            ids = lambda: torch.randint(0, shape.vocab, (b, s))  # noqa: E731
            emb = model[0]
            out[key] = list(_fwd_bwd(run(emb), ids, lambda y: y.float().square().mean()))
        key = timing.compute_key("head", plan, work)
        if key not in out:
            head = model[-1]
            if plan.tp > 1 and shape.vocab >= timing.VOCAB_PARALLEL_MIN:
                head.lm_head = torch.nn.Linear(shape.hidden, shape.vocab // plan.tp, bias=False)
            v = head.lm_head.out_features
            tgt = torch.randint(0, v, (b * s,))
            out[key] = list(_fwd_bwd(run(head), lambda: torch.randn(b, s, shape.hidden,
                                                                    requires_grad=True),
                                     lambda y: F.cross_entropy(y.flatten(0, -2).float(), tgt)))
    # the optimizer the job steps with, over the whole model's parameters (per-tensor Python
    # costs included), with the job's fused norm pass and zero_grad
    from pyfast import models
    model = models.build(gpt_model_flag(shape), shape.vocab, work.seq)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    from pyfast.optim import job_adamw  # the job's: pyfast's fused pass on CPU
    opt = job_adamw(params, params[0].device, lr=1e-3, betas=(0.9, 0.95))

    def step():
        torch.stack(torch._foreach_norm([p.grad for p in params])).double().square().sum()
        opt.step()
    n = sum(p.numel() for p in params)
    big = torch.randn(1 << 22)  # 16 MB: DataParallel's copy of the reduced buckets into .grad
    dst = torch.empty_like(big)
    copy = _time(lambda: dst.copy_(big)) / big.nbytes
    return {"compute": out, "flops_s": statistics.median(rates) if rates else None,
            "optim_s_per_param": _time(step) / n, "copy_s_per_byte": copy}


def _unit_cluster() -> Cluster:
    from .hardware import Gpu
    one = Gpu("unit", 1, 1.0, 1.0, float("inf"), 1.0)
    return Cluster(1, 1, one, 1.0, 1.0, mfu=1.0)


def measure_codecs(specs, shape: ModelShape) -> dict:
    """{spec: [enc_a, enc_b, dec_a, dec_b]} from cost.codec_seconds at two sizes (PowerSGD on
    hidden x k matrices, the others flat)."""
    import torch
    import pyfast.compress as C
    from pyfast.comm import cost
    torch.set_num_threads(1)
    out = {}
    for spec in sorted(set(specs) - {"none", ""}):
        pts = []
        for cols in (shape.hidden, 4 * shape.hidden):
            x = torch.randn(shape.hidden, cols)
            x = x if spec.startswith("powersgd") else x.reshape(-1)
            # with its error-feedback memory, as the job's DataParallel runs it
            enc, dec = cost.codec_seconds(C.wrap(C.get(spec)), x, repeats=REPEATS)
            pts.append((x.numel(), enc, dec))
        (n0, e0, d0), (n1, e1, d1) = pts
        eb, db = max(0.0, (e1 - e0) / (n1 - n0)), max(0.0, (d1 - d0) / (n1 - n0))
        out[spec] = [max(0.0, e0 - eb * n0), eb, max(0.0, d0 - db * n0), db]
    return out


def cp_probe(path: str, model: str, seq: int, micro_batch: int, method: str,
             precision: str) -> None:
    """A rank of the cp block probe (env://, gloo, world = cp): pyfast's Block under
    context_parallel (zigzag, as the job) on this rank's seq/cp tokens, forward and backward
    timed as calibrate_dist.timed_chain times tp's block; rank 0 writes [forward_s,
    backward_s] to `path`. The ring's attention runs its own kernels and merges, not the
    local causal SDPA: gpt-tiny's cp2 step measured 44 ms against 22 predicted from the
    local block."""
    import datetime
    import torch
    import torch.distributed as dist
    from pyfast import models
    from pyfast.train.job import AMP
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)
    m = models.build(model, 256, seq)
    m.context_parallel(dist.group.WORLD, layout="zigzag", method=method)
    block = m[1]
    fwd = torch.autocast("cpu", dtype=AMP[precision])(block.forward) if precision in AMP \
        else block
    s = seq // dist.get_world_size()
    from .calibrate_dist import timed_chain  # the tp probe's timing (blocks back to back)
    w = torch.tensor(timed_chain(fwd, lambda: torch.randn(micro_batch, s, m.cfg.d_model,
                                                          requires_grad=True)))
    if dist.get_rank() == 0:
        Path(path).write_text(json.dumps(w.tolist()))
    _finish()


def measure_cp_blocks(shape: ModelShape, work: Workload, plans, timeout: float = 180) -> dict:
    """{compute_key + ":cp": [forward_s, backward_s]} of each cp plan's block (tp 1), timed on
    cp gloo ranks on loopback: the ring's (or Ulysses') compute with its loopback traffic."""
    out = {}
    for plan in plans:
        key = timing.compute_key("block", plan, work) + ":cp"
        if plan.cp == 1 or plan.tp > 1 or key in out:
            continue
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "cp.json")
            argv = ["-c", "from pyfast.plan.calibrate_compute import cp_probe; cp_probe("
                    f"{path!r}, {gpt_model_flag(replace(shape, layers=1))!r}, {work.seq}, "
                    f"{plan.micro_batch}, {plan.cp_method!r}, {work.precision!r})"]
            _child(argv, timeout, world=plan.cp)
            out[key] = json.loads(Path(path).read_text())
    return out
