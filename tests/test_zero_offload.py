"""zero(offload="optimizer"): ZeRO 1/2/3 with the fp32 master shards, their gradients and the
optimizer state in host memory (pyfast.parallel.zero.offload_step), on 2 gloo ranks (one pool
launch for every case), gpt-tiny (LayerNorm and biases of odd sizes, a tied embedding), against
the same run without offload.

Tolerances: offloading moves storage, not arithmetic: the same reduce-scatter output is copied
to the host, the same foreach AdamW runs on the same values (CPU either way here), the same
segment bytes (padding included) are all-gathered. So parameters, optimizer state and losses
are asserted BITWISE equal. The delayed update (delay=True) is checked against a one-process
reference written here (SGD with momentum, torch ops only, gradient N-1 applied at step N):
the runs differ only in how the two ranks' micro-batch gradients are summed (gloo's
reduce-scatter vs autograd over the averaged loss), a few fp32 ulps per gradient; SGD turns
that into lr * ulps per step, so atol 1e-6 over 3 steps at lr 0.05 (the reference without the
delay differs by > 1e-3: asserted too, so the check can tell a delayed update from a plain one).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

V, SEQ, STEPS = 97, 16, 3


def _gpt():
    from pyfast import models
    torch.manual_seed(0)
    return models.build("gpt-tiny", V, SEQ)


def _data(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, V, (2, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _loss(m, x, y):
    return nn.functional.cross_entropy(m(x).reshape(-1, V), y.reshape(-1))


def _run(rank, stage, compressor, offload, clip, optim=torch.optim.AdamW, delay=False,
         steps=STEPS, **kw):
    """(losses, full state dict) after `steps` steps of zero() on gpt-tiny."""
    from pyfast.parallel.zero import checkpoint as ck, zero
    opts = dict(lr=0.05, momentum=0.9) if optim is torch.optim.SGD else \
        dict(lr=1e-3, weight_decay=0.1)
    model, opt = zero(_gpt(), optim, stage=stage, compressor=compressor, offload=offload,
                      delay=delay, **opts, **kw)
    losses = []
    for s in range(steps):
        loss = _loss(model, *_data(s, rank))
        loss.backward()
        if clip:  # the norm (2 or inf) of host gradients, all-reduced on the device
            opt.clip_grad_norm_(0.05, norm_type=clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    sd = ck.full_state_dict(model, opt)
    model.close()
    return torch.stack(losses), sd


def _flat(sd) -> dict:
    out = {f"model.{k}": v for k, v in sd["model"].items()}
    for fqn, st in sd["optim"]["state"].items():
        out.update({f"optim.{fqn}.{k}": v for k, v in st.items() if isinstance(v, torch.Tensor)})
    return out


CASES = [(1, None, False), (2, None, 2.0), (2, "int8", False), (3, None, False),
         (3, "int8", float("inf"))]


def _same_as_without(rank, world):
    """Per case: the names of the tensors that differ between offload and no offload."""
    out = {}
    for stage, comp, clip in CASES:
        la, a = _run(rank, stage, comp, None, clip)
        lb, b = _run(rank, stage, comp, "optimizer", clip)
        a, b = _flat(a), _flat(b)
        assert a.keys() == b.keys(), (stage, comp, set(a) ^ set(b))
        bad = [k for k in a if not torch.equal(a[k], b[k])]
        out[(stage, comp, clip)] = (bad, torch.equal(la, lb), len(a))
    return out


def _delayed(rank, world):
    """delay=True (stages 2, 3) and its one-process reference: max |difference| per case."""
    out = {}
    for stage in (2, 3):
        _, sd = _run(rank, stage, None, "optimizer", False, torch.optim.SGD, delay=True)
        out[stage] = sd["model"]
    return out


def _reference(world, delay):
    """One process, torch only: SGD(momentum) on the average of the ranks' micro-batch losses,
    gradient N-1 applied at step N (delay) or gradient N at step N. With delay the last
    gradient is applied at the end, as the checkpoint's flush (full_state_dict) does."""
    m = _gpt()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    prev = None
    for s in range(STEPS):
        loss = sum(_loss(m, *_data(s, r)) for r in range(world)) / world
        grads = torch.autograd.grad(loss, list(m.parameters()))
        use = prev if delay else grads
        if use is not None:
            for p, g in zip(m.parameters(), use):
                p.grad = g
            opt.step()
        prev = grads
    if delay:
        for p, g in zip(m.parameters(), prev):
            p.grad = g
        opt.step()
    return dict(m.named_parameters())


def _solo(rank, world):
    """ZeRO-Offload on one rank (`pyfast train --nproc 1 --zero S --offload ...`): zero() over a
    group of this rank alone, against plain torch AdamW on the same micro-batches in this process:
    the names of the parameters that differ (bitwise: an average over one rank divides by 1, and
    the host step runs torch's CPU AdamW on the same values, only stored in flat host shards)."""
    import torch.distributed as dist
    solo = [dist.new_group([r]) for r in range(world)][rank]  # collective: every rank makes all
    out = {}
    for stage, mode in ((2, "optimizer"), (3, "params")):
        _, sd = _run(rank, stage, None, mode, False, group=solo, engine="python")
        ref = _gpt()
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
        for s in range(STEPS):
            _loss(ref, *_data(s, rank)).backward()
            opt.step()
            opt.zero_grad()
        out[stage] = [n for n, p in ref.named_parameters() if not torch.equal(sd["model"][n], p)]
    return out


def _host_short(rank, world):
    """Rank 1 sees no free host memory, then rank 1's pinned allocation is refused (a CPU build
    of torch refuses pin_memory=True: Host.empty's own conversion runs): OffloadError on both
    ranks each time (no hang), naming GiB."""
    from pyfast.parallel.zero import offload, zero
    got = []
    saved, init = offload.available_bytes, offload.Host.__init__

    def pinned(self, device):
        init(self, device)
        self.pin = True
    for patch in ("memory", "pin"):
        if rank == 1 and patch == "memory":
            offload.available_bytes = lambda: 0
        if rank == 1 and patch == "pin":
            offload.Host.__init__ = pinned
        try:
            zero(_gpt(), torch.optim.AdamW, stage=2, offload="optimizer")
            got.append(None)
        except offload.OffloadError as e:
            got.append(str(e))
        finally:
            offload.available_bytes, offload.Host.__init__ = saved, init
    return got


def test_offload_equals_no_offload_and_delay_reference(pool2):
    got = pool2.run(_same_as_without)
    for case in CASES:
        for r in (0, 1):
            bad, losses_equal, n = got[r][case]
            assert not bad and losses_equal, (case, r, bad)
            assert n > 20  # parameters and AdamW's moments of every parameter were compared
    delayed = pool2.run(_delayed)[0]
    ref, plain = _reference(2, True), _reference(2, False)
    for stage, sd in delayed.items():
        for name, p in ref.items():
            torch.testing.assert_close(sd[name], p.detach(), atol=1e-6, rtol=0,
                                       msg=lambda m: f"stage {stage} {name}: {m}")
        assert max((sd[n] - p).abs().max().item() for n, p in plain.items()) > 1e-3
    for solo in pool2.run(_solo):
        assert solo == {2: [], 3: []}, solo
    for short, pin in pool2.run(_host_short):
        assert short is not None and "GiB" in short and "host memory" in short, short
        assert pin is not None and "pinned host memory refused" in pin and "GiB" in pin, pin


def _resume(rank, world, root):
    """Per stage and direction: save at step 2 with / without offload, load into a model built
    the other way, step 3; the full state against a run that never stopped (bitwise)."""
    from pyfast.parallel.zero import checkpoint as ck, zero
    out = {}
    for stage in (2, 3):
        _, never = _run(rank, stage, None, None, False)
        for saved, loaded in (("optimizer", None), (None, "optimizer")):
            path = f"{root}/s{stage}-{saved}"
            model, opt = zero(_gpt(), torch.optim.AdamW, stage=stage, offload=saved, lr=1e-3,
                              weight_decay=0.1)
            for s in range(STEPS - 1):
                _loss(model, *_data(s, rank)).backward()
                opt.step()
                opt.zero_grad()
            ck.save(path, model, opt)
            model.close()
            model, opt = zero(_gpt(), torch.optim.AdamW, stage=stage, offload=loaded, lr=0.5,
                              weight_decay=0.0)  # other options: the checkpoint's must win
            ck.load(path, model, opt)
            _loss(model, *_data(STEPS - 1, rank)).backward()
            opt.step()
            sd = _flat(ck.full_state_dict(model, opt))
            model.close()
            ref = _flat(never)
            out[(stage, saved, loaded)] = (sorted(set(sd) ^ set(ref)),
                                           [k for k in ref if k in sd and not
                                            torch.equal(sd[k], ref[k])])
    return out


def test_checkpoint_resumes_across_offload_bit_exact(pool2, tmp_path):
    for r, got in enumerate(pool2.run(_resume, str(tmp_path))):
        for case, (keys, bad) in got.items():
            assert not keys and not bad, (r, case, keys, bad)


def test_dry_run_splits_device_and_host_bytes():
    """--offload optimizer --zero 2 on memoryless tensors (fake group, W=2): the host holds
    master + gradient + two AdamW moments = 16 psi / W bytes, + the step's temporaries (torch's
    foreach AdamW makes one fp32 list, its denominator: at most 4 psi / W more; measured 11%);
    the device's peak drops by about the state, 8 psi / W (fp32 parameters: the master was a
    view of the parameter, the gradient shard a view of the reduce-scatter's output)."""
    from pyfast.train.config import TrainConfig
    from pyfast.train.dryrun import dry_run
    shape = "gpt:layers=2,heads=4,hidden=256"
    rows = {off: dry_run(TrainConfig(model=shape, dp=2, zero=2, batch=2, seq=32, offload=off),
                         2, [0])[0] for off in ("none", "optimizer")}
    from pyfast import models
    with torch.device("meta"):
        psi = sum(p.numel() for p in models.build(shape, 256, 32).parameters())
    assert rows["none"]["host_bytes"] == 0
    host, saved = rows["optimizer"]["host_bytes"], \
        rows["none"]["peak_bytes"] - rows["optimizer"]["peak_bytes"]
    assert 16 * psi / 2 <= host <= 20 * psi / 2, (host, psi)
    assert 0.9 * 8 * psi / 2 <= saved <= 1.1 * 8 * psi / 2 + 4 * psi / 2, (saved, psi)
