"""The C++ AdamW (csrc/adamw.cpp via pyfast.ops.adamw_) and pyfast.optim.AdamW against
adamw_reference_ and torch.optim.AdamW (foreach=False: the single-tensor arithmetic the kernel
copies), at ragged sizes (not multiples of the 8-wide vector), 100 steps.

Bound, fp32: |a - b| <= 8 ulps of max(|a|, |b|) + sum over steps of lr * 2^-22. The kernel
performs torch's ops in torch's order and fuses where torch's vector kernels fuse (lerp,
addcmul): the moments come out bit-equal or nearly. The update does not: torch's CPU sqrt (its
vectorized math library) is within 1 ulp but not correctly rounded (411 of 65,537 random
values differ from IEEE sqrt on this machine), the kernel's is exact; a 1-ulp denominator
moves a step of at most ~lr by lr * 2^-23, and such moves add up over the steps, which near
p = 0 is many ulps of p (64 seen at 65,537 elements over 100 steps), hence the lr term.
"""
from __future__ import annotations

import copy
import re

import pytest
import torch

import pyfast.optim
from pyfast.ops import BackendUnavailable
from pyfast.ops.adamw import adamw_, adamw_reference_

SIZES = (1, 7, 31, 1000, 4097, 65537)
# gradients of very different scales side by side in one call: each element's update is
# normalized by its own history (eps 1e-8 still below sqrt(v) ~ 1e-6), so every tensor must
# match torch within the same bound
SCALES = (1e-6, 1e3, 1.0, 1e-2, 1e2, 1.0)
ULPS = 8


def close(a, b, lr_sum=0.0, n_ulps=ULPS) -> bool:
    """|a - b| <= n_ulps ulps of max(|a|, |b|) + lr_sum * 2^-22 (the docstring's bound)."""
    m = torch.maximum(a.abs(), b.abs()).float()
    ulp = torch.nextafter(m, torch.tensor(float("inf"))) - m
    return bool(((a.float() - b.float()).abs() <= n_ulps * ulp + lr_sum * 2.0 ** -22).all())


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in units in the last place of max(|a|, |b|) (fp32 or bf16)."""
    m = torch.maximum(a.abs(), b.abs()).float()
    if a.dtype == torch.bfloat16:  # a bf16 ulp: the fp32 ulp << 16, computed by the exponent
        ulp = torch.ldexp(torch.ones_like(m), torch.frexp(m).exponent - 8)
    else:
        ulp = torch.nextafter(m, torch.tensor(float("inf"))) - m
    return float(((a.float() - b.float()).abs() / ulp.clamp_min(2.0 ** -140)).max())


def _model(dtype=torch.float32):
    return [torch.nn.Parameter(torch.randn(n).to(dtype)) for n in SIZES]


def _groups(ps):  # two groups: different lr and weight decay
    return [{"params": ps[::2], "lr": 1e-2, "weight_decay": 0.1},
            {"params": ps[1::2], "lr": 3e-3, "weight_decay": 0.0}]


def _grads(step, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(n, generator=g) * s).to(dtype) for n, s in zip(SIZES, SCALES)]


def test_fp32_equals_reference_and_torch_adamw_over_100_steps():
    ours, torchs, refs = _model(), _model(), _model()
    with torch.no_grad():
        for a, b, c in zip(ours, torchs, refs):
            b.copy_(a)
            c.copy_(a)
    gs = 0.3  # grad_scale: folded into our pass; torch and the reference get grads * gs
    opt = pyfast.optim.AdamW(_groups(ours), betas=(0.9, 0.99), eps=1e-8)
    topt = torch.optim.AdamW(_groups(torchs), betas=(0.9, 0.99), eps=1e-8, foreach=False)
    ms, vs = [torch.zeros(n) for n in SIZES], [torch.zeros(n) for n in SIZES]
    for step in range(1, 101):
        grads = _grads(step)
        for p, q, g in zip(ours, torchs, grads):
            p.grad, q.grad = g, g * gs
        opt.step(grad_scale=gs)
        topt.step()
        for grp, idx in zip(_groups(refs), (slice(0, None, 2), slice(1, None, 2))):
            adamw_reference_(refs[idx], grads[idx], ms[idx], vs[idx], step=step, lr=grp["lr"],
                             beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=grp["weight_decay"],
                             grad_scale=gs)
    for i, (p, q, r) in enumerate(zip(ours, torchs, refs)):
        st, tst = opt.state[p], topt.state[q]
        for what, a, b in (("p vs torch", p, q), ("p vs reference", p, r),
                           ("exp_avg", st["exp_avg"], tst["exp_avg"]),
                           ("exp_avg_sq", st["exp_avg_sq"], tst["exp_avg_sq"])):
            lr_sum = 100 * opt.param_groups[i % 2]["lr"] if what.startswith("p") else 0.0
            assert close(a.detach(), b.detach(), lr_sum), (what, SIZES[i], ulps(a, b))
        assert float(st["step"]) == float(tst["step"]) == 100.0


def test_bf16_params_keep_fp32_moments():
    """The kernel equals adamw_reference_ (fp32 moments, p rounded once to bf16 a step) within
    1 bf16 ulp, bf16 and fp32 gradients alike. torch.optim.AdamW on bf16 parameters differs by
    design: bf16 moments, and p rounded to bf16 twice a step (after the decay, whose factor
    1 - 1e-3 is below half a bf16 ulp and so is often lost, and after the update). After 20
    steps at lr 1e-2 both are compared with an fp32-master AdamW given the same gradients:
    ours tracks it closer (mean |error| 0.0064 vs torch's 0.0159 on this seed; asserted
    below 0.6x, ours being p's own bf16 rounding, ~1/4 ulp a step, as a random walk)."""
    for gdt in (torch.bfloat16, torch.float32):
        ps = _model(torch.bfloat16)
        refs, tps = [p.detach().clone() for p in ps], [nn_param(p) for p in ps]
        fp32 = [nn_param(p.float()) for p in ps]
        z = lambda: [torch.zeros(n) for n in SIZES]  # noqa: E731
        m1, v1, m2, v2 = z(), z(), z(), z()
        topt = torch.optim.AdamW(tps, lr=1e-2, weight_decay=0.1, foreach=False)
        fopt = torch.optim.AdamW(fp32, lr=1e-2, weight_decay=0.1, foreach=False)
        for step in range(1, 21):
            grads = _grads(step, gdt)
            kw = dict(step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
            adamw_(ps, grads, m1, v1, **kw)
            adamw_reference_(refs, grads, m2, v2, **kw)
            for p, f, g in zip(tps, fp32, grads):
                p.grad, f.grad = g.to(torch.bfloat16), g.float()
            topt.step()
            fopt.step()
        for i, n in enumerate(SIZES):
            assert ps[i].dtype == torch.bfloat16 and m1[i].dtype == torch.float32
            assert ulps(ps[i].detach(), refs[i]) <= 1, (gdt, n)
            assert close(m1[i], m2[i]) and close(v1[i], v2[i]), (gdt, n)
            assert topt.state[tps[i]]["exp_avg"].dtype == torch.bfloat16  # torch's, for contrast
        flat = lambda ts: torch.cat([t.detach().float() for t in ts])  # noqa: E731
        ours, theirs, ideal = flat(ps), flat(tps), flat(fp32)
        err_ours, err_torch = (ours - ideal).abs().mean(), (theirs - ideal).abs().mean()
        assert err_ours < 0.6 * err_torch, (gdt, float(err_ours), float(err_torch))


def nn_param(t):
    return torch.nn.Parameter(t.detach().clone())


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.ln, self.fc2 = torch.nn.Linear(29, 37), torch.nn.LayerNorm(37), \
            torch.nn.Linear(37, 5)
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.fc2(self.ln(torch.tanh(self.fc1(x))))


def _pair(opt_kw=None):
    """(pyfast model, optimizer), (torch model, optimizer) from the same weights; gpt-tiny-like
    odd shapes (a 2-D weight, a bias of 37, a LayerNorm) and one parameter that never gets a
    gradient (both must leave it and its state alone)."""
    torch.manual_seed(0)
    a = _Net()
    b = copy.deepcopy(a)
    kw = {"lr": 2e-2, "betas": (0.8, 0.95), "weight_decay": 0.05, **(opt_kw or {})}
    tkw = {k: v for k, v in kw.items() if k != "max_norm"}  # torch clips outside (_train)
    groups = lambda m: [{"params": [*m.fc1.parameters(), *m.unused.parameters()]},  # noqa: E731
                        {"params": [*m.ln.parameters(), *m.fc2.parameters()], "lr": 5e-3}]
    return (a, pyfast.optim.AdamW(groups(a), **kw)), (b, torch.optim.AdamW(groups(b), **tkw,
                                                                            foreach=False))


def _train(model, opt, steps, first=0, clip=None, sched=None):
    for s in range(first, first + steps):
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(16, 29, generator=g), torch.randn(16, 5, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def _assert_models_close(a, b, lr_sum):
    for (k, p), q in zip(a.named_parameters(), b.parameters()):
        assert close(p.detach(), q.detach(), lr_sum), (k, ulps(p.detach(), q.detach()))


def test_state_dicts_interchange_with_torch_adamw_and_schedulers_work():
    """torch -> pyfast and pyfast -> torch mid-run, an lr scheduler on both (a 0-d tensor lr
    too): the continued runs equal torch's uninterrupted one within the bound."""
    (a, opt), (b, topt) = _pair()
    _train(a, opt, 3)
    _train(b, topt, 3)
    assert a.unused.weight.grad is None and a.unused.weight not in opt.state  # None: skipped
    assert set(opt.state_dict()["state"][0]) == set(topt.state_dict()["state"][0])
    # the groups carry the same keys (DCP loads only keys it finds), and a torch group with an
    # option this pass does not do is refused on load, not ignored
    for g, tg in zip(opt.state_dict()["param_groups"], topt.state_dict()["param_groups"]):
        assert set(g) == set(tg)
    amsgrad = copy.deepcopy(topt.state_dict())
    amsgrad["param_groups"][0]["amsgrad"] = True
    with pytest.raises(ValueError, match="amsgrad"):
        copy.deepcopy(opt).load_state_dict(amsgrad)
    # swap the states: each optimizer continues from the other's
    sa, sb = opt.state_dict(), topt.state_dict()
    opt.load_state_dict(sb)
    topt.load_state_dict(sa)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (opt, topt)]
    _train(a, opt, 4, first=3, sched=scheds[0])
    _train(b, topt, 4, first=3, sched=scheds[1])
    assert opt.param_groups[1]["lr"] == topt.param_groups[1]["lr"] == 5e-3 / 4
    _assert_models_close(a, b, 7 * 2e-2)
    for p, q in zip(a.parameters(), b.parameters()):
        if p in opt.state:
            assert float(opt.state[p]["step"]) == float(topt.state[q]["step"]) == 7
    # a 0-d tensor lr: torch then computes 1 - lr * wd and lr / bc1 in fp32 tensor arithmetic
    # (for a float lr, in double as pyfast always does): steps differ by a few fp32 ulps of
    # themselves, 16x the lr term of the bound (measured: 6x at step 1)
    (a, opt), (b, topt) = _pair({"lr": torch.tensor(2e-2)})
    _train(a, opt, 3)
    _train(b, topt, 3)
    _assert_models_close(a, b, 16 * 3 * 2e-2)


def test_max_norm_is_clip_grad_norm_folded_in():
    (a, opt), (b, topt) = _pair({"max_norm": 0.05})
    _train(a, opt, 4)
    _train(b, topt, 4, clip=0.05)
    assert float(opt.grad_norm) > 0.05  # the clip acted
    _assert_models_close(a, b, 4 * 2e-2)


def test_meta_params_step_through_the_fake_and_the_op_passes_opcheck():
    ps = [torch.nn.Parameter(torch.empty(n, device="meta")) for n in (7, 33)]
    opt = pyfast.optim.AdamW(ps, max_norm=1.0)
    for p in ps:
        p.grad = torch.empty_like(p)
    opt.step()  # the dry run's path: no data, shapes only
    assert opt.state[ps[1]]["exp_avg"].device.type == "meta"
    p, g = torch.randn(37), torch.randn(37)
    args = ([p], [g], [torch.zeros(37)], [torch.zeros(37)], 1, 1e-3, 0.9, 0.999, 1e-8, 0.01,
            torch.tensor(0.5), 1.0)
    torch.library.opcheck(torch.ops.pyfast.adamw_, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_bad_inputs_raise_naming_the_problem(monkeypatch):
    p, g, m, v = torch.zeros(5), torch.zeros(5), torch.zeros(5), torch.zeros(5)
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    op = torch.ops.pyfast.adamw_
    cases = [
        (lambda: adamw_([p], [g], [m], [], **kw), ValueError, "one tensor per parameter"),
        (lambda: adamw_([p], [torch.zeros(6)], [m], [v], **kw), ValueError, "6 elements"),
        (lambda: adamw_([p.half()], [g.half()], [m], [v], **kw), TypeError, "float32 or bfloat16"),
        (lambda: adamw_([p], [g.bfloat16()], [m], [v], **kw), TypeError, "parameter's dtype"),
        (lambda: adamw_([p], [g], [m.bfloat16()], [v], **kw), TypeError, "must be float32"),
        # the kernel's own checks, for callers of torch.ops.pyfast.adamw_ directly
        (lambda: op([p], [g], [m], [v, v], 1, 1e-3, .9, .9, 1e-8, 0., None, 1.), RuntimeError,
         "one tensor per parameter"),
        (lambda: op([p], [torch.zeros(10)[::2]], [m], [v], 1, 1e-3, .9, .9, 1e-8, 0., None, 1.),
         RuntimeError, "not contiguous"),
        (lambda: op([p], [g], [m], [torch.zeros(4)], 1, 1e-3, .9, .9, 1e-8, 0., None, 1.),
         RuntimeError, "exp_avg_sqs[0] has 4 elements but params[0] has 5"),
        (lambda: op([p], [g], [m], [v], 0, 1e-3, .9, .9, 1e-8, 0., None, 1.), RuntimeError,
         "step counts from 1"),
        (lambda: op([p], [g], [m], [v], 1, 1e-3, .9, .9, 1e-8, 0., torch.ones(2), 1.),
         RuntimeError, "one-element"),
        (lambda: pyfast.optim.AdamW([torch.nn.Parameter(p)], amsgrad=True), ValueError,
         "amsgrad"),
        (lambda: pyfast.optim.AdamW([torch.nn.Parameter(p)], maximize=True), ValueError,
         "maximize"),
        (lambda: pyfast.optim.AdamW([torch.nn.Parameter(p)], capturable=True), ValueError,
         "capturable"),
        (lambda: pyfast.optim.AdamW([torch.nn.Parameter(p)], differentiable=True), ValueError,
         "differentiable"),
        (lambda: pyfast.optim.AdamW([torch.nn.Parameter(p.cfloat())]), ValueError, "complex64"),
        (lambda: pyfast.optim.AdamW([torch.nn.Parameter(p)], betas=(1.0, 0.9)), ValueError,
         "betas"),
        (lambda: pyfast.optim.AdamW([torch.nn.Parameter(p)], max_norm=0.0), ValueError,
         "max_norm"),
    ]
    for fn, exc, text in cases:
        with pytest.raises(exc, match=re.escape(text)):
            fn()
    monkeypatch.setenv("PYFAST_BACKEND", "triton")  # asked for by name, cannot run: raises
    with pytest.raises(BackendUnavailable):
        adamw_([p], [g], [m], [v], **kw)


def _zero_pair(rank, world):
    """gpt-tiny in zero() on 2 ranks, stages 1-3, pyfast.optim.AdamW vs torch.optim.AdamW: the
    same data, so the same gradients at step 1; their parameters after 2 steps."""
    from test_zero import _data, _gpt, _loss, _params

    from pyfast.parallel import zero
    out = {}
    for stage in (1, 2, 3):
        for name, cls in (("pyfast", pyfast.optim.AdamW), ("torch", torch.optim.AdamW)):
            torch.manual_seed(0)
            model, opt = zero(_gpt(), cls, stage=stage, lr=1e-2, weight_decay=0.1)
            for s in range(2):
                xs, ys = _data("gpt", world, s)
                _loss("gpt", model, xs[rank], ys[rank]).backward()
                opt.step()
                opt.zero_grad()
            out[stage, name] = _params(model)
    return out


def test_zero_with_pyfast_adamw_equals_zero_with_torch_adamw(pool2):
    for out in pool2.run(_zero_pair):
        for stage in (1, 2, 3):
            ours, theirs = out[stage, "pyfast"], out[stage, "torch"]
            for k in theirs:
                # step 1: equal within the ulp bound (its lr term is 2.4e-9); step 2's
                # gradients then differ by ~1e-7 of themselves, and AdamW's normalized step
                # turns a relative gradient change d into ~lr * d: 4.3e-7 at most seen; gpt-tiny's
                # softmax-invariant key biases (gradients at their noise floor, test_zero.py)
                # see the largest d: 5.3e-6 seen. Bounds: about 4x those.
                bound = 2e-5 if k.endswith("attn.qkv.bias") else 2e-6
                d = float((ours[k] - theirs[k]).abs().max())
                assert d <= bound, (stage, k, d)


def test_job_adamw_is_this_kernel_on_cpu_and_torch_elsewhere(monkeypatch):
    """job_adamw (what the training job and the planner's probe step with): pyfast.optim.AdamW
    for CPU fp32/bf16 parameters, torch.optim.AdamW for an fp16 one, on meta (a dry run models
    the GPU job) and when PYFAST_BACKEND asks for the torch ops; groups and options pass through."""
    cpu, meta = torch.device("cpu"), torch.device("meta")
    w, b = torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3).bfloat16())
    groups = [{"params": [w], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}]
    opt = pyfast.optim.job_adamw(groups, cpu, lr=2e-3, betas=(0.9, 0.95))
    assert type(opt) is pyfast.optim.AdamW
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert opt.param_groups[0]["lr"] == 2e-3 and opt.param_groups[1]["betas"] == (0.9, 0.95)
    half = torch.nn.Parameter(torch.randn(4).half())
    assert type(pyfast.optim.job_adamw([w, half], cpu)) is torch.optim.AdamW
    on_meta = torch.nn.Parameter(torch.empty(4, device=meta))
    assert type(pyfast.optim.job_adamw([on_meta], meta)) is torch.optim.AdamW
    monkeypatch.setenv("PYFAST_BACKEND", "torch")
    assert type(pyfast.optim.job_adamw([w], cpu)) is torch.optim.AdamW


def _job_steps(steps, cls=None):
    """A 1-rank gpt-tiny Job (tied embeddings, LayerNorm and biases) for `steps` steps; cls
    replaces the job's optimizer class. Returns (optimizer type, losses, parameters)."""
    import torch.distributed as dist

    import pyfast.train.job as jobmod
    from pyfast.train.config import TrainConfig
    mp = pytest.MonkeyPatch()
    if cls is not None:
        mp.setattr(jobmod, "job_adamw", lambda groups, device, **kw: cls(groups, **kw))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        job = jobmod.Job(TrainConfig(model="gpt-tiny", batch=4, seq=32, steps=steps, seed=5,
                                     tie_embeddings=True), torch.device("cpu"))  # cpu-literal
        losses = [job.train_step(s)["loss"] for s in range(1, steps + 1)]
        params = [p.detach().clone() for p in job.params]
        kind = type(job.opt)
        job.close()
    finally:
        dist.destroy_process_group()
        mp.undo()
    return kind, losses, params


def test_the_job_steps_this_kernel_on_cpu_and_equals_torch_adamw():
    """The CPU job's optimizer is pyfast.optim.AdamW, and the job trained with it equals the
    job trained with torch.optim.AdamW: after one step (the same gradients) every parameter
    within this file's bound (lr at most 1e-3, module docstring); over 3 steps the losses within
    1e-5 (measured 0 and 4.8e-7, one ulp of a loss near 5: a step's rounding moves the next
    loss by ulps; 1e-5 leaves 20 ulps for other vector widths, AVX2 against AVX-512)."""
    kind, losses, params = _job_steps(1)
    tkind, tlosses, tparams = _job_steps(1, torch.optim.AdamW)
    assert kind is pyfast.optim.AdamW and tkind is torch.optim.AdamW
    assert losses == tlosses  # before any update: the same model and batch
    for p, q in zip(params, tparams):
        assert close(p, q, 1e-3), ulps(p, q)
    _, losses, _ = _job_steps(3)
    _, tlosses, _ = _job_steps(3, torch.optim.AdamW)
    assert max(abs(a - b) for a, b in zip(losses, tlosses)) <= 1e-5, (losses, tlosses)
