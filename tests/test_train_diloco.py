"""`pyfast train --diloco H --replicas R`: checks before launch (in-process, milliseconds), and
real runs of gpt-tiny (torchrun via --nproc) against DiLoCo driven by hand, resumes and
restarts."""
import contextlib

import pytest
import torch

from pyfast.train import main
from pyfast.train.config import from_args, parser
from pyfast.train.launch import worker_args

TINY = ["--model", "gpt-tiny", "--steps", "2", "--batch", "8", "--seq", "32", "--no-plot"]
DL = ["--diloco", "4", "--replicas", "2"]


@pytest.mark.parametrize("flags,message", [
    (["--diloco", "-1"], "--diloco H: the inner steps per outer step must be >= 1 (0: off), "
                         "got -1"),
    (["--replicas", "2"], "--replicas 2 without --diloco H: replicas meet only in DiLoCo's"),
    (["--fragments", "2", "--outer-lr", "0.5"], "--fragments 2, --outer-lr 0.5 without --diloco"),
    (["--replicas", "0"], "--replicas must be >= 1, got 0"),
    (DL + ["--nproc", "3"], "--replicas 2 x --dp 1 x --tp 1 x --pp 1 = 2 ranks, but --nproc 3"),
    (DL + ["--dp", "2", "--nproc", "2"], "--replicas 2 x --dp 2 x --tp 1 x --pp 1 = 4 ranks, "
                                         "but --nproc 2"),
    (["--diloco", "6", "--fragments", "4"], "--diloco 6 is not a multiple of --fragments 4"),
    (["--diloco", "8", "--fragments", "4", "--diloco-delay", "2"],
     "--diloco-delay 2 must be in [0, H/F = 2) (--diloco 8 / --fragments 4)"),
    (["--diloco", "4", "--diloco-alpha", "1.5"], "--diloco-alpha 1.5 must be in [0, 1]"),
    (["--diloco", "4", "--diloco-alpha", "-0.1"], "--diloco-alpha -0.1 must be in [0, 1]"),
    (["--diloco", "4", "--outer-compress", "int9"], "--outer-compress 'int9': unknown "
                                                    "compressor spec 'int9'"),
    (["--diloco", "4", "--outer-lr", "0"], "need --outer-lr > 0 and 0 <= --outer-momentum < 1"),
    (["--diloco", "4", "--outer-momentum", "1"], "got 0.7, 1.0"),
    (["--diloco", "64", "--fragments", "32"],  # gpt-tiny holds 28 parameter tensors
     "--fragments 32: more fragments than the 28 parameter tensors of gpt-tiny"),
    (DL + ["--batch", "6", "--dp", "2", "--nproc", "4"],
     "--batch 6 is not divisible by replicas 2 x dp 2 x grad-accum 1 x micro-batches 1 = 4"),
    (DL + ["--dp", "2", "--zero", "3"], "--diloco with --zero 3: stage 3 frees the parameters"),
    (DL + ["--precision", "fp16"], "--diloco with --precision fp16"),
    (["--eval-outer"], "--eval-outer True without --diloco H"),
])
def test_bad_diloco_flags_fail_before_any_rank_starts(tmp_path, capsys, flags, message):
    assert main(TINY + ["--out", str(tmp_path)] + flags) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not (tmp_path / "metrics.jsonl").exists()


def test_worker_args_reproduce_the_diloco_flags():
    cfg = from_args(parser().parse_args(TINY + DL + [
        "--fragments", "2", "--diloco-delay", "1", "--outer-compress", "int4", "--outer-lr",
        "0.5", "--outer-momentum", "0.8", "--no-outer-nesterov", "--diloco-alpha", "0.25"]))
    assert not cfg.outer_nesterov and cfg.replicas == 2 and cfg.ranks == 2
    assert "--no-outer-nesterov" in worker_args(cfg)
    assert from_args(parser().parse_args(worker_args(cfg))) == cfg


# ------------------------------------------------------------------ the job on the shared pools
STEPS = 6
# H=4 in 2 fragments, each all-reduce 1 step behind, int8 outer gradients with error feedback:
# fragment 0 is sent after steps 2 and 6 and applied after 3, fragment 1 sent after 4 (so 6
# steps see every kind of step: plain, send, apply)
FLAGS = dict(model="gpt-tiny", batch=8, seq=32, seed=1, steps=STEPS, diloco=4, fragments=2,
             diloco_delay=1, outer_compress="int8")


def _cfg(**kw):
    from pyfast.train.config import TrainConfig
    return TrainConfig(**{**FLAGS, **kw})


def _job_run(rank, world, kw, steps=STEPS):
    """The job's own steps: (records, this rank's parameters after the last step)."""
    from pyfast.train.job import Job
    job = Job(_cfg(**kw), torch.device("cpu"))
    try:
        recs = [job.train_step(s) for s in range(1, steps + 1)]
        return recs, {n: p.detach().clone() for n, p in job.named}
    finally:
        job.close()


def _by_hand(rank, world, kw, steps=STEPS):
    """The same training written out with pyfast.parallel.DiLoCo as a user would: each rank a
    replica on its own half of every global batch, AdamW on the job's parameter groups
    and schedule, clipping by the replica's own gradient norm (the job's rule: squares summed
    in fp64, max_norm / (norm + 1e-6) above max_norm)."""
    import math

    import torch.nn.functional as F

    from pyfast.data import Batches, load_corpus
    from pyfast.optim import job_adamw
    from pyfast.parallel import DiLoCo
    from pyfast.train.config import build_model
    from pyfast.train.job import lr_lambda
    cfg = _cfg(**kw)
    corpus = load_corpus(cfg.data)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, corpus.vocab_size)
    params = list(model.parameters())
    # the job's AdamW (pyfast's fused pass on these CPU ranks): the comparison is bitwise
    opt = job_adamw([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                     {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                    params[0].device, lr=cfg.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    dl = DiLoCo(model, opt, sync_every=cfg.diloco, fragments=cfg.fragments,
                delay=cfg.diloco_delay, compressor=cfg.outer_compress, group=None)
    data = Batches(corpus.train, cfg.batch, cfg.seq, cfg.seed, rank, world)
    losses = []
    for _ in range(steps):
        x, y = data.next()
        loss = F.cross_entropy(model(x).flatten(0, -2).float(), y.flatten())
        loss.backward()
        grads = [p.grad for p in params]
        gnorm = math.sqrt(float(torch.stack(torch._foreach_norm(grads)).double().square().sum()))
        if gnorm > cfg.clip:
            torch._foreach_mul_(grads, cfg.clip / (gnorm + 1e-6))
        dl.step()
        dl.zero_grad()
        sched.step()
        losses.append(float(loss.detach()))
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    outer_val = None
    if cfg.eval_outer:  # the outer parameters (a fragment in flight not in them), validated
        with torch.no_grad():  # as the job validates: the mean over replicas of each one's loss
            for n, p in model.named_parameters():
                p.copy_(dl.global_params[n])
        outer_val = _val_by_hand(model, cfg, corpus, rank, world)
    dl.close()  # after the copy: close() applies a fragment in flight (as the job's close)
    return losses, out, outer_val


def _val_by_hand(model, cfg, corpus, rank, world):
    import torch.distributed as dist
    import torch.nn.functional as F

    from pyfast.data import Batches
    n = min(cfg.eval_batches, (len(corpus.val) - 1) // cfg.seq // cfg.batch)
    val = Batches(corpus.val, cfg.batch, cfg.seq, cfg.seed, rank, world, shuffle=False)
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for _ in range(n):
            x, y = val.next()
            total += F.cross_entropy(model(x).flatten(0, -2).float(), y.flatten())
    v = total / n / world
    dist.all_reduce(v)
    return float(v)


def test_replicas_equal_diloco_driven_by_hand(pool2):
    """--diloco 4 --replicas 2 --fragments 2 --diloco-delay 1 --outer-compress int8 against
    DiLoCo written out by hand on the same two ranks: the same ops in the same order, so the
    parameters after 6 steps (two outer steps applied, one in flight) are bitwise equal. The
    logged loss is replica 0's (rank 0's own batch slice, fp32 widened to fp64: bitwise); the
    mean of the replicas' losses comes with the steps where they meet (before each send and
    at the last step), summed in fp64 in another order than (a + b) / 2: within 1e-12."""
    job = pool2.run(_job_run, {"replicas": 2}, timeout=240)
    hand = pool2.run(_by_hand, {"replicas": 2}, timeout=240)
    for r in (0, 1):
        assert job[r][1].keys() == hand[r][1].keys()
        for n in job[r][1]:
            assert torch.equal(job[r][1][n], hand[r][1][n]), (r, n)
    # the replicas really differ between outer steps: a sync is not a no-op
    assert not all(torch.equal(job[0][1][n], job[1][1][n]) for n in job[0][1])
    mean = [(a + b) / 2 for a, b in zip(hand[0][0], hand[1][0])]
    recs = job[0][0]
    assert [rec["loss"] for rec in recs] == hand[0][0]
    assert [rec["loss"] for rec in job[1][0]] == hand[1][0]  # each replica logs its own
    met = [rec.get("replicas_loss") for rec in recs]
    assert met[0] is met[2] is met[4] is None  # steps 1, 3, 5: no send, no meeting
    assert [met[i] for i in (1, 3, 5)] == pytest.approx([mean[i] for i in (1, 3, 5)], rel=1e-12)
    # all ranks' bytes since the last meeting: the sum over both replicas of bytes_sent
    both = [a["bytes_sent"] + b["bytes_sent"] for a, b in zip(recs, job[1][0])]
    met = [rec.get("replicas_bytes_sent") for rec in recs]
    assert [m is None for m in met] == [True, False] * 3 and sum(met[1::2]) == sum(both)
    assert [rec["outer_sent"] for rec in recs] == [None, 0, None, 1, None, 0]
    assert [rec["outer_applied"] for rec in recs] == [None, None, 0, None, 1, None]
    sent = [rec["outer_payload_bytes"] for rec in recs]
    assert sent[1] > 0 and sent[3] > 0 and sent[0] == sent[2] == sent[4] == 0


def _job_eval(rank, world, kw, steps=STEPS):
    """_job_run, then validation of the replicas' own and of the outer parameters, and whether
    the own ones came back bit for bit."""
    from pyfast.train.job import Job
    job = Job(_cfg(**kw), torch.device("cpu"))
    try:
        recs = [job.train_step(s) for s in range(1, steps + 1)]
        own = {n: p.detach().clone() for n, p in job.named}
        local, outer = job.evaluate(), job.evaluate_outer()
        back = all(torch.equal(own[n], p) for n, p in job.named)
        return recs, own, local, outer, back, job.evaluate()
    finally:
        job.close()


def test_cosine_schedule_outer_validation_and_outer_bytes(pool2):
    """--lr-decay-steps 4 (cosine to the floor at step 4 of 6, constant after) and --eval-outer
    against DiLoCo driven by hand with the same schedule: the parameters bitwise equal, the
    outer parameters' validation loss equal to the by-hand one (the same sums in the same
    order), the replicas' own parameters restored bit for bit after it. Every byte of the outer
    all-reduces is in bytes_sent: over the run, all ranks' bytes are at least the analytic
    payload (each replica's int8 pseudo-gradients to the other) and at most 10% + 16 KB over it
    (gloo's framing, the replicas' small meetings)."""
    kw = {"replicas": 2, "lr_decay_steps": 4, "warmup": 1, "eval_outer": True}
    job = pool2.run(_job_eval, kw, timeout=240)
    hand = pool2.run(_by_hand, kw, timeout=240)
    for r in (0, 1):
        for n in job[r][1]:
            assert torch.equal(job[r][1][n], hand[r][1][n]), (r, n)
        recs, _, local, outer, back, again = job[r]
        assert back and again == local  # the own parameters back, bit for bit
        assert outer == hand[r][2] and outer != local  # between syncs they differ
    from pyfast.train.job import lr_lambda
    f = lr_lambda(_cfg(**kw))
    lrs = [rec["lr"] for rec in job[0][0]]
    assert lrs == [1e-3 * f(i) for i in range(STEPS)]
    assert lrs[3] == lrs[4] == lrs[5] == pytest.approx(1e-4) and lrs[2] > 1e-4  # the floor
    recs = job[0][0]
    total = sum(rec.get("replicas_bytes_sent") or 0 for rec in recs)
    payload = 2 * sum(rec["outer_payload_bytes"] for rec in recs)  # each replica's, to 1 peer
    assert payload <= total <= 1.1 * payload + 16384, (total, payload)
    # replica 0's own steps (bytes_sent: its one rank) hold what it sent: its payload, once
    mine = sum(rec["outer_payload_bytes"] for rec in recs)
    assert mine <= sum(rec["bytes_sent"] for rec in recs) <= 1.1 * mine + 8192


def _gap_write(rank, world, n, hidden, steps=STEPS):
    """The job's steps with n bytes written to a file after step 2, while fragment 0's
    all-reduce is in flight (delay 1): plainly, or inside Job.not_sent(). Every step's
    bytes_sent, summed."""
    import tempfile

    from pyfast.train.job import Job
    job = Job(_cfg(replicas=2), torch.device("cpu"))
    try:
        total = 0
        for s in range(1, steps + 1):
            total += job.train_step(s)["bytes_sent"]
            if s == 2:
                assert job.mark is not None  # in flight past the step's count
                # its writes done before the file's: inside not_sent() they would be left out
                # too (as Job.not_sent says), 67 KB of them once, so the runs would differ by
                # when the transfer ran, not by the write
                job.diloco.in_flight.handle.wait()
                with tempfile.TemporaryFile() as f, \
                        job.not_sent() if hidden else contextlib.nullcontext():
                    f.write(b"x" * n)
                    f.flush()
        return total
    finally:
        job.close()


def test_bytes_written_between_steps_count_unless_not_sent(pool2):
    """What an in-flight outer all-reduce writes between two steps is the next step's bytes
    (Job.mark; the transfer is waited for before the gap's write, so it lands outside the
    window in both runs): a file write in that gap stands in for it, n bytes more in the run's total
    (the rest of its bytes the same in both runs: each lands in some step's count), and the
    same write inside Job.not_sent() (a run's log, its checkpoints) none. Within 256 bytes:
    a small write of another thread may land in a step in one run and in not_sent() in the
    other (4 bytes seen once under two pytest workers); the code before counted 0 of n."""
    n = 10_000
    seen = pool2.run(_gap_write, n, False)
    hidden = pool2.run(_gap_write, n, True)
    assert all(abs(a - b - n) <= 256 for a, b in zip(seen, hidden)), (seen, hidden)


def test_replicas_of_dp2_equal_flat_replicas(pool2, pool4):
    """--replicas 2 --dp 2 (world 4: DataParallel inside each replica) against --replicas 2 on
    two ranks: the same tokens per replica, each replica's gradient the mean over its 4 rows,
    here averaged over 2 dp ranks of 2 rows each: fp32 sums in another order, so the losses
    within 1e-5 relative over the first 4 steps (test_train.py's bar for dp vs one process).
    Outer gradients in fp32 here: with int8 one element in 12,288 crossed a rounding boundary
    (1e-5 apart after 4 steps), which says nothing about the composition."""
    kw = {"replicas": 2, "outer_compress": "none"}
    pool4.submit(_job_run, {**kw, "dp": 2}, 4)
    flat = pool2.run(_job_run, kw, 4, timeout=240)
    dp2 = pool4.wait(timeout=240)
    a, b = [r["loss"] for r in flat[0][0]], [r["loss"] for r in dp2[0][0]]
    assert b == pytest.approx(a, rel=1e-5)
    worst = 0.0
    for n in flat[0][1]:  # replica k is ranks 2k, 2k + 1 of the dp2 world, rank k of the flat
        for k in (0, 1):
            assert torch.equal(dp2[2 * k][1][n], dp2[2 * k + 1][1][n])  # dp ranks agree exactly
            worst = max(worst, float((dp2[2 * k][1][n] - flat[k][1][n]).abs().max()))
    assert worst < 1e-5, worst  # lr 1e-3 x 4 AdamW steps move a weight by <= 4e-3



COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast",
               "reduce_scatter_tensor", "all_to_all_single", "barrier", "send", "recv",
               "isend", "irecv", "all_gather_object", "broadcast_object_list")


def _who_talks(rank, world, kw):
    """Every torch.distributed collective the main thread issues during each step: (step,
    the group's ranks)."""
    import threading

    import torch.distributed as dist

    from pyfast.train.job import Job
    job = Job(_cfg(**kw), torch.device("cpu"))
    seen, step = [], [0]
    real = {n: getattr(dist, n) for n in COLLECTIVES}

    def spy(name):
        def call(*a, group=None, **k):
            if threading.current_thread() is threading.main_thread():
                seen.append((step[0], tuple(dist.get_process_group_ranks(group)) if group
                             is not None else tuple(range(world))))
            return real[name](*a, group=group, **k)
        return call
    try:
        for n in COLLECTIVES:
            setattr(dist, n, spy(n))
        for s in range(1, STEPS + 1):
            step[0] = s
            job.train_step(s)
    finally:
        for n, f in real.items():
            setattr(dist, n, f)
        job.close()
    return seen


def test_plain_inner_steps_never_cross_between_replicas(pool4):
    """--replicas 2 --dp 2, H 4 in 2 fragments: on steps 1, 3, 5 (no send, no meeting) the
    main thread's collectives stay inside the rank's replica (ranks 0-1 or 2-3: DataParallel's
    and the step's all-reduce); on steps 2, 4, 6 the replicas meet once over all 4 ranks."""
    got = pool4.run(_who_talks, {"replicas": 2, "dp": 2}, timeout=240)
    for r, seen in enumerate(got):
        mine = set(range(2 * (r // 2), 2 * (r // 2) + 2))
        assert {s for s, _ in seen} >= {1, 2, 3}, seen  # the spy saw the steps' collectives
        for s, ranks in seen:
            if s % 2:
                assert set(ranks) <= mine, (r, s, ranks)
        # (the last step meets again after its update: its outer bytes, outer.Meeting.settle)
        assert [s for s, ranks in seen if len(ranks) == 4] == [2, 4, 6, 6], (r, seen)


def _nan_on_replica_1(rank, world, kw, at=3):
    """The job's steps with a NaN put into one gradient of replica 1 at step `at`: what each
    rank raised and at which step, and whether replica 1 took an update after the failure."""
    from pyfast.train.job import Job, NonFiniteError
    job = Job(_cfg(**kw), torch.device("cpu"))
    fb = job._forward_backward

    def poisoned(x, y):
        out = fb(x, y)
        job.params[0].grad.view(-1)[0] = float("nan")
        return out
    held = None
    try:
        for s in range(1, STEPS + 1):
            if s == at and job.mesh.replica_rank == 1:
                job._forward_backward = poisoned
            before = [p.detach().clone() for p in job.params]
            try:
                job.train_step(s)
            except NonFiniteError as e:
                return s, str(e), held
            job._forward_backward = fb
            if s == at:
                held = all(torch.equal(a, p) for a, p in zip(before, job.params))
        return None, "", held
    finally:
        job.close()


def test_nan_on_one_replica_stops_every_rank_where_they_meet(pool2):
    """Replica 1's gradient goes NaN at step 3 (no fragment sent then: the replicas do not
    meet): replica 1 holds its update, and at step 4, where the replicas meet before fragment
    1's all-reduce, every rank raises NonFiniteError naming replica 1 and step 3, before any
    outer step reads the broken replica."""
    got = pool2.run(_nan_on_replica_1, {"replicas": 2}, timeout=240)
    for step, msg, _ in got:
        assert step == 4, got
        assert "step 4: NaN/Inf in replica 1 at step 3 (loss " in msg, msg
        assert "gradient norm nan)" in msg and "last complete checkpoint is kept" in msg
    assert got[0][2] is False and got[1][2] is True  # replica 0 stepped at 3, replica 1 held


def _job_and_fragments(rank, world, kw, steps):
    """_job_run's, and the elements of each of DiLoCo's fragments."""
    from pyfast.train.job import Job
    job = Job(_cfg(**kw), torch.device("cpu"))
    try:
        index = dict(zip(job.diloco.names, job.diloco.params))
        sizes = [sum(index[n].numel() for n in f) for f in job.diloco.fragments]
        recs = [job.train_step(s) for s in range(1, steps + 1)]
        return recs, {n: p.detach().clone() for n, p in job.named}, sizes
    finally:
        job.close()


def test_zero2_replicas_equal_zero0(pool4):
    """--replicas 2 --dp 2 --zero 2 against the same run with --zero 0 (DataParallel inside),
    fp32 outer gradients, 4 steps (one outer step per fragment): ZeRO-2 reduce-scatters where
    DataParallel all-reduces, fp32 sums in another order, so the losses within 1e-5 relative
    and the weights within 1e-5 (test_train.py's bar for zero against dp; lr 1e-3 x 4 AdamW
    steps move a weight by <= 4e-3). Each rank sends only its half of a fragment between the
    replicas: 4 bytes x ceil(n_f / 2) per send, half the fragment's fp32 bytes."""
    kw = {"replicas": 2, "dp": 2, "outer_compress": "none"}
    z0 = pool4.run(_job_and_fragments, kw, 4, timeout=240)
    z2 = pool4.run(_job_and_fragments, {**kw, "zero": 2}, 4, timeout=240)
    for r in range(4):
        a, b = [x["loss"] for x in z0[r][0]], [x["loss"] for x in z2[r][0]]
        assert b == pytest.approx(a, rel=1e-5), r
        for n in z0[r][1]:
            torch.testing.assert_close(z2[r][1][n], z0[r][1][n], rtol=0, atol=1e-5)
    sizes = z0[0][2]
    for run in (z0, z2):
        for r in range(4):
            sent = [x["outer_payload_bytes"] for x in run[r][0]]
            assert sent == [0, 4 * -(-sizes[0] // 2), 0, 4 * -(-sizes[1] // 2)], (r, sent)


def _bf16_zero1(rank, world):
    from pyfast.train.job import Job
    job = Job(_cfg(replicas=2, dp=2, zero=1, precision="bf16"), torch.device("cpu"))
    try:
        losses = [job.train_step(s)["loss"] for s in (1, 2, 3)]  # fragment 0 applied at 3
        dtypes = {p.dtype for p in job.params}
        glob = torch.cat([t.reshape(-1) for t in job.diloco.global_params.values()])
        return losses, dtypes, glob
    finally:
        job.close()


def test_zero1_under_bf16_autocast_keeps_fp32_parameters(pool4):
    """--zero 1 --precision bf16 --diloco passes the checks before launch, and bf16 autocast
    keeps the parameters fp32 (zero steps views of them, as DiLoCo needs): the job builds,
    trains, and every rank of both replicas holds one global state after an outer step."""
    from pyfast.train import config as C
    cfg = from_args(parser().parse_args(TINY + DL + ["--dp", "2", "--zero", "1", "--precision",
                                                     "bf16", "--nproc", "4"]))
    C.check(cfg, 4, model=False)
    got = pool4.run(_bf16_zero1, timeout=240)
    for losses, dtypes, glob in got:
        assert dtypes == {torch.float32} and all(3.0 < v < 7.0 for v in losses), losses
        assert torch.equal(glob, got[0][2])


def _zero_resume(rank, world, out):
    """--replicas 2 --dp 2 --zero 2: 6 steps straight; and 3 steps, a checkpoint (mid-interval:
    the replicas differ, fragment 1 not yet sent), a new job loading it, 3 more steps."""
    from pyfast.train.job import Job
    kw = {"replicas": 2, "dp": 2, "zero": 2}
    job = Job(_cfg(**kw), torch.device("cpu"))
    straight = [job.train_step(s)["loss"] for s in range(1, STEPS + 1)]
    job.close()
    job = Job(_cfg(**kw), torch.device("cpu"))
    for s in (1, 2, 3):
        job.train_step(s)
    path = job.save(out, 3)
    job.close()
    job = Job(_cfg(**kw), torch.device("cpu"))
    step, same = job.load(path)
    resumed = [job.train_step(s)["loss"] for s in range(step + 1, STEPS + 1)]
    job.close()
    return straight, resumed, same


def test_zero2_replicas_resume_bit_exact(pool4, tmp_path):
    """Each replica's ZeRO shards are saved under its own key (replica 1's under "replica1")
    and load back from it: the resumed steps' losses, every rank's (each replica logs its
    own), equal the straight run's bit for bit."""
    got = pool4.run(_zero_resume, str(tmp_path), timeout=240)
    for r, (straight, resumed, same) in enumerate(got):
        assert same and resumed == straight[3:], (r, straight, resumed)
    assert got[0][0] != got[2][0]  # the replicas' losses differ: replica 1 is its own


def _snapshot(job):
    dl = job.diloco
    return {"global": {n: t.clone() for n, t in dl.global_params.items()},
            "momentum": {n: t.clone() for n, t in dl.momentum_buffers.items()},
            "local": {n: p.detach().clone() for n, p in job.named},
            "exp_avg": {n: job.opt.state[p]["exp_avg"].clone() for n, p in job.named},
            "step": dl.step_count, "pending": dl._pending is not None}


def _change_replicas(rank, world, out):
    """--replicas 2 for 2 steps (fragment 0's all-reduce in flight), checkpoint; then
    --replicas 1 --dp 2 on the same ranks resumes it and trains on."""
    from pyfast.train.job import Job
    job = Job(_cfg(replicas=2), torch.device("cpu"))
    for s in (1, 2):
        job.train_step(s)
    path = job.save(out, 2)
    before = _snapshot(job)  # after save: the fragment in flight has landed in state_dict
    job.close()
    job = Job(_cfg(replicas=1, dp=2), torch.device("cpu"))
    step, same = job.load(path)
    after = _snapshot(job)
    losses = [job.train_step(s)["loss"] for s in range(3, STEPS + 1)]
    job.close()
    return before, after, step, same, losses


def test_resume_with_another_number_of_replicas(pool2, tmp_path):
    """A checkpoint of --replicas 2 (mid-interval, an outer all-reduce in flight) resumed by
    --replicas 1 --dp 2: the outer state (global parameters, momentum, the step, the fragment
    in flight) is the saved one on every rank, and both dp ranks of the one replica take
    replica 0's parameters and AdamW moments, bitwise (DCP copies them)."""
    from pyfast.train.config import resume_changes
    import dataclasses
    got = pool2.run(_change_replicas, str(tmp_path), timeout=240)
    saved = got[0][0]  # replica 0 = rank 0 of the saved run
    assert saved["step"] == 2 and saved["pending"]
    for r in (0, 1):
        before, after, step, same, losses = got[r]
        assert step == 2 and not same  # another mesh: per-rank state not restored
        assert after["step"] == 2 and after["pending"]
        for what in ("global", "momentum", "local", "exp_avg"):
            assert after[what].keys() == saved[what].keys()
            for n in saved[what]:
                assert torch.equal(after[what][n], saved[what][n]), (r, what, n)
        assert all(v == v and 3.0 < v < 6.0 for v in losses), losses  # trains on, finite
    # the replicas' global state really is one: rank 1 (replica 1) held the same before
    assert all(torch.equal(got[1][0]["global"][n], saved["global"][n]) for n in saved["global"])
    # and --resume lets --replicas change (logged), as it lets the mesh
    record = {"config": dataclasses.asdict(_cfg(replicas=2)), "warmup_steps": 1}
    refused, changed = resume_changes(_cfg(replicas=1, dp=2), record)
    assert not refused and any(c.startswith("--replicas: 2 in the checkpoint, 1 here")
                               for c in changed), changed


# ------------------------------------------------------------------ real runs (torchrun)
RUN = TINY[:2] + ["--steps", str(STEPS), "--batch", "8", "--seq", "32", "--seed", "1",
                  "--ckpt-every", "1", "--eval-batches", "1", "--no-tensorboard", "--no-plot",
                  "--diloco", "4", "--replicas", "2", "--fragments", "2", "--diloco-delay", "1",
                  "--outer-compress", "int8", "--nproc", "2"]


def _train(out, extra=(), env=None):
    import os
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "pyfast", "train", *RUN, "--out", str(out), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def _done(p, code=0):
    out, err = p.communicate(timeout=240)
    assert p.returncode == code, f"exit {p.returncode}\n{out[-3000:]}\n{err[-6000:]}"
    return out, err


def _records(out):
    import json
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.dist
def test_killed_replica_restarts_and_resumes_bit_exact(tmp_path):
    """The whole run, and the same run with replica 1's only rank SIGKILLed after step 3's
    update (before its checkpoint: the restart resumes from step 2, with fragment 0's outer
    all-reduce in flight) under --max-restarts 1; then a --resume from step 3 (just after
    fragment 0's outer step). Every loss, and the bytes of every outer step, byte for byte."""
    import json
    import shutil
    from test_train import pool_train
    ref, crash = tmp_path / "ref", tmp_path / "crash"
    b = _train(crash, ["--max-restarts", "1"], {"PYFAST_FAULT": "step@3:1"})
    # the reference on forked ranks while the launch runs: the launch (and its restart) is
    # the point of `crash` only (a second launch cost ~4 CPU s of imports on 2 cores)
    pool_train(ref, 2, [], base=RUN[:RUN.index("--nproc")])
    _, err = _done(b)
    assert "PYFAST_FAULT step@3:1: SIGKILL rank 1" in err  # replica 1 really died
    keys = ("step", "loss", "outer_sent", "outer_applied", "outer_payload_bytes", "val_loss")

    def seen(d):
        return [json.dumps({k: r.get(k) for k in keys}) for r in _records(d)]
    want = seen(ref)
    assert len(want) == STEPS and seen(crash) == want
    mid = tmp_path / "mid"
    shutil.copytree(ref, mid)
    for d in (mid / "checkpoints").iterdir():
        if d.name != "step-3":
            shutil.rmtree(d)
    # the resume on forked ranks (the launch is the restart's point above, not this one's)
    out = pool_train(mid, 2, ["--resume"], base=RUN[:RUN.index("--nproc")]).stdout
    assert "resumed from" in out and "another mesh" not in out
    assert seen(mid) == want
