"""DiLoCo / Streaming DiLoCo against references, on gloo ranks.

- H=1, outer SGD lr 1 without momentum, inner SGD, no compression == DataParallel + SGD.
- H=1, outer Nesterov == one process with two torch optimizers (inner, and torch.optim.SGD
  on the global parameters).
- Any H, fragments, delay, alpha, int8/int4 outer gradients with error feedback == a
  single-process simulation of the replicas (`simulate`, run inside rank 0 so that both see
  one torch thread), bit for bit: the simulation compresses with the same pyfast.compress
  objects and sums in rank order in fp32, as the allgather all-reduce does.
- Replicas made of DataParallel pairs == replicas of one rank with the pair's whole batch.
- Resume bit-exact; bad input; a dry run on meta tensors over the fake group.
"""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pyfast.compress as C
from pyfast.parallel.diloco import DiLoCo, fragment_due, split_fragments

VOCAB, D, HID, SEQ, BATCH = 13, 10, 7, 5, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.up = nn.Linear(D, HID)  # odd sizes: biases of 7 and 10 elements
        self.down = nn.Linear(HID, D)

    def forward(self, h):
        return h + self.down(torch.tanh(self.up(self.ln(h))))


class Tiny(nn.Module):
    """Shaped like a GPT: embedding, a stack of blocks, final norm, head tied to the embedding."""

    def __init__(self, layers=3):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x, y):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        logits = self.head(self.ln_f(h))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def tiny(layers=3):
    torch.manual_seed(0)
    m = Tiny(layers)
    with torch.no_grad():  # LayerNorm starts at 1 / 0: make its pseudo-gradients non-trivial
        for n, p in m.named_parameters():
            if "ln" in n:
                p.add_(0.1 * torch.randn_like(p))
    return m


def batch(replica, step, n=BATCH):
    g = torch.Generator().manual_seed(7919 * step + replica)
    x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return x, (x * 3 + 1) % VOCAB  # a learnable map


def inner(m, kind):
    if kind == "sgd":
        return torch.optim.SGD(m.parameters(), lr=0.1)
    return torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.01)


def flat(params):
    return torch.cat([p.detach().reshape(-1).float() for p in params])


# --------------------------------------------------------------------- the reference simulation
def simulate(R, steps, cfg, layers=3):
    """R replicas in one process: DiLoCo's definition, written out once more. Returns the
    replicas' local parameters and the global ones (fp32, flat)."""
    H, F, tau, alpha = cfg["sync_every"], cfg["fragments"], cfg["delay"], cfg["alpha"]
    lr, m_, nest = cfg["outer_lr"], cfg["outer_momentum"], cfg["nesterov"]
    models = [tiny(layers) for _ in range(R)]
    opts = [inner(m, cfg["inner"]) for m in models]
    named = [list(m.named_parameters()) for m in models]
    frags = split_fragments(named[0], F)
    glob = [p.detach().float().clone() for _, p in named[0]]
    buf = [torch.zeros_like(g) for g in glob]
    comps = [C.wrap(C.get(cfg["compressor"]), cfg["error_feedback"]) for _ in range(R)]
    pending = None

    def apply(f, avg):
        o = 0
        for i in frags[f]:
            d = avg[o:o + glob[i].numel()].view(glob[i].shape)
            o += glob[i].numel()
            if m_:
                buf[i].mul_(m_).add_(d)
                d = d.add(buf[i], alpha=m_) if nest else buf[i]
            glob[i].add_(d, alpha=-lr)
            for r in range(R):
                p = named[r][i][1]
                with torch.no_grad():
                    p.copy_(torch.lerp(p.float(), glob[i], 1.0 - alpha) if alpha else glob[i])

    for t in range(1, steps + 1):
        for r in range(R):
            models[r](*batch(r, t)).backward()
            opts[r].step()
            opts[r].zero_grad()
        if pending is not None and pending[0] + tau == t:
            apply(*pending[1:])
            pending = None
        per = H // F
        if t % per == 0:
            f = ((t - 1) % H) // per  # fragment (f + 1) * H / F steps into each interval
            deltas = [torch.cat([(glob[i] - named[r][i][1].detach().float()).reshape(-1)
                                 for i in frags[f]]) for r in range(R)]
            acc = torch.zeros_like(deltas[0])
            if cfg["compressor"] == "none":
                for d in deltas:
                    acc.add_(d)
            else:  # allgather: each rank compresses once (with its feedback), sum in rank order
                for r in range(R):
                    comps[0].decode_add(comps[r].compress(deltas[r], f"diloco.f{f}"), acc)
            pending = (t, f, acc.div_(R))
            if tau == 0:
                apply(*pending[1:])
                pending = None
    return [flat(m.parameters()) for m in models], flat(glob)


CFG = dict(sync_every=4, fragments=1, delay=0, alpha=0.0, outer_lr=0.7, outer_momentum=0.9,
           nesterov=True, compressor="none", error_feedback=True, inner="adamw")


def _run(rank, world, cfg, steps, simulate_too=False, layers=3):
    m = tiny(layers)
    if rank:  # a different start: construction must broadcast the group's rank 0 parameters
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)
    opt = inner(m, cfg["inner"])
    kw = {k: v for k, v in cfg.items() if k not in ("inner",)}
    dl = DiLoCo(m, opt, **kw)
    for t in range(1, steps + 1):
        m(*batch(rank, t)).backward()
        dl.step()
        dl.zero_grad()
    out = {"local": flat(m.parameters()), "global": flat(dl.global_params.values()),
           "bytes": dl.payload_bytes}
    dl.close()
    if simulate_too and rank == 0:
        out["sim"] = simulate(world, steps, cfg, layers)
    return out


# --------------------------------------------------------------------- no ranks needed
def test_fragments_are_strided_over_layers_and_balanced():
    m = tiny(layers=4)
    named = list(m.named_parameters())
    frags = split_fragments(named, 2)
    names = [[named[i][0] for i in f] for f in frags]
    assert sorted(i for f in frags for i in f) == list(range(len(named)))  # each tensor once
    for f, ns in enumerate(names):  # blocks 0, 2 -> fragment 0; blocks 1, 3 -> fragment 1
        assert {n.split(".")[1] for n in ns if n.startswith("blocks.")} == {str(f), str(f + 2)}
    # the embedding (tied head, counted once: 130 floats) and ln_f go whole to the lighter one
    assert "embed.weight" in names[0] and "ln_f.weight" in names[1]
    load = [sum(named[i][1].numel() for i in f) for f in frags]
    assert max(load) - min(load) <= VOCAB * D  # within the largest unit
    # more fragments than units: tensors one by one, every fragment non-empty
    flat_mlp = list(nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2)).named_parameters())
    assert sorted(map(len, split_fragments(flat_mlp, 4))) == [1, 1, 1, 1]


def test_schedule_staggers_fragments():
    got = {t: fragment_due(t, 12, 3) for t in range(1, 25)}
    assert {t: f for t, f in got.items() if f is not None} == {4: 0, 8: 1, 12: 2, 16: 0,
                                                              20: 1, 24: 2}
    assert [t for t in range(1, 10) if fragment_due(t, 3, 1) is not None] == [3, 6, 9]


@pytest.mark.parametrize("kw, kind, text", [
    ({"sync_every": 0}, ValueError, "sync_every must be >= 1"),
    ({"sync_every": 2.0}, TypeError, "sync_every must be an integer"),
    ({"sync_every": 10, "fragments": 3}, ValueError, "multiple of fragments"),
    ({"sync_every": 400, "fragments": 200}, ValueError, "trainable parameter tensors"),
    ({"sync_every": 8, "fragments": 2, "delay": 4}, ValueError, "delay (4) must be < "),
    ({"alpha": 1.5}, ValueError, "alpha must be in [0, 1]"),
    ({"alpha": -0.1}, ValueError, "alpha must be in [0, 1]"),
    ({"compressor": "int5"}, ValueError, "unknown compressor spec"),
    ({"compressor": 8}, TypeError, "compressor spec must be a string"),
    ({"outer_momentum": 0.0}, ValueError, "nesterov needs outer_momentum > 0"),
])
def test_bad_input_fails_before_training(kw, kind, text):
    m = tiny()
    with pytest.raises(kind, match=None) as e:
        DiLoCo(m, inner(m, "sgd"), **kw)
    assert text in str(e.value)


def test_inner_optimizer_must_hold_the_model():
    m = tiny()
    with pytest.raises(ValueError, match="inner_opt does not hold 3 of"):
        DiLoCo(m, torch.optim.SGD(list(m.parameters())[:-3], lr=0.1))
    with pytest.raises(TypeError, match="must be a torch.optim.Optimizer"):
        DiLoCo(m, object())


# --------------------------------------------------------------------- on ranks
def _dp_vs_diloco(rank, world, steps):
    from pyfast.parallel import DataParallel
    out = {}
    m = tiny()
    dp = DataParallel(m, None)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for t in range(1, steps + 1):
        dp(*batch(rank, t)).backward()
        opt.step()
        opt.zero_grad()
    out["dp"] = flat(m.parameters())
    dp.close()
    cfg = {**CFG, "sync_every": 1, "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False,
           "inner": "sgd"}
    out["diloco"] = _run(rank, world, cfg, steps)["local"]
    return out


def test_h1_sgd_equals_data_parallel(pool2):
    for o in pool2.run(_dp_vs_diloco, 5):
        # global - (global - lr * grad) rounds once more than DP's update: a few fp32 ulps a
        # step, over 5 steps of parameters of size ~1: 1e-6 absolute
        torch.testing.assert_close(o["diloco"], o["dp"], rtol=0, atol=1e-6)


def _two_optimizers(rank, world, steps):
    out = _run(rank, world, {**CFG, "sync_every": 1}, steps)
    if rank == 0:  # the reference: R local models, torch.optim.SGD on the global ones
        models = [tiny() for _ in range(world)]
        opts = [inner(m, "adamw") for m in models]
        glob = [nn.Parameter(p.detach().clone()) for p in models[0].parameters()]
        outer = torch.optim.SGD(glob, lr=CFG["outer_lr"], momentum=CFG["outer_momentum"],
                                nesterov=True)
        for t in range(1, steps + 1):
            for r, (m, o) in enumerate(zip(models, opts)):
                m(*batch(r, t)).backward()
                o.step()
                o.zero_grad()
            for i, g in enumerate(glob):
                locals_ = [list(m.parameters())[i].detach() for m in models]
                g.grad = sum((g.detach() - loc for loc in locals_[1:]),
                             g.detach() - locals_[0]) / world
            outer.step()
            with torch.no_grad():
                for m in models:
                    for p, g in zip(m.parameters(), glob):
                        p.copy_(g)
        out["ref"] = flat(glob)
    return out


def test_h1_nesterov_equals_two_optimizer_reference(pool2):
    o = pool2.run(_two_optimizers, 5)
    # same elementwise ops as torch.optim.SGD; 1e-6: torch may fuse (foreach) differently
    torch.testing.assert_close(o[0]["global"], o[0]["ref"], rtol=0, atol=1e-6)
    assert torch.equal(o[0]["global"], o[1]["global"])


SIM_CASES = {
    "diloco-H4": {},
    "fragments-delay-alpha": {"sync_every": 6, "fragments": 3, "delay": 1, "alpha": 0.5},
    "int8-ef-streaming": {"sync_every": 4, "fragments": 2, "delay": 1, "alpha": 0.5,
                          "compressor": "int8"},
    "int4-ef-offload": {"compressor": "int4", "offload": True, "delay": 2},
    "e3m0-ef-fragments": {"compressor": "e3m0", "fragments": 2, "delay": 1},
    "int4-no-ef-sgd": {"compressor": "int4", "error_feedback": False, "outer_momentum": 0.5,
                       "nesterov": False, "alpha": 1.0},
}


def _sim_cases(rank, world, steps):
    return {k: _run(rank, world, {**CFG, **v}, steps, simulate_too=True)
            for k, v in SIM_CASES.items()}


def test_equals_single_process_simulation(pool2):
    steps = 13  # ends mid-interval, with fragments in flight for the delayed cases
    out = pool2.run(_sim_cases, steps)
    for k in SIM_CASES:
        locals_, glob = out[0][k]["sim"]
        for r in range(2):  # the same bits: same ops, same compressor, same order
            assert torch.equal(out[r][k]["global"], glob), k
            assert torch.equal(out[r][k]["local"], locals_[r]), k
        assert not torch.equal(locals_[0], locals_[1])  # replicas did train apart
    named = list(tiny().named_parameters())
    sizes = [sum(named[i][1].numel() for i in f) for f in split_fragments(named, 2)]
    # int8: a byte an element + a 4-byte scale per 512; each fragment sent 3 times in 13 steps
    assert out[0]["int8-ef-streaming"]["bytes"] == sum(3 * (n + 4 * -(-n // 512)) for n in sizes)
    assert out[0]["diloco-H4"]["bytes"] == 3 * 4 * sum(sizes)  # fp32, the whole model 3 times


def _other_compressors(rank, world, specs):
    return {s: _run(rank, world, {**CFG, "sync_every": 2, "compressor": s}, 5) for s in specs}


def test_per_tensor_and_sparse_compressors_keep_replicas_identical(pool2):
    specs = ["topk:0.3", "powersgd:1", "randomk:0.5", "bf16"]
    r0, r1 = pool2.run(_other_compressors, specs)
    init = flat(tiny().parameters())
    for s in specs:  # the outer steps moved the global parameters, identically everywhere
        assert torch.equal(r0[s]["global"], r1[s]["global"]), s
        assert torch.isfinite(r0[s]["global"]).all() and not torch.equal(r0[s]["global"], init)
        # sizes known for the dense formats only: bf16, 2 bytes an element, sent twice in 5 steps
        assert r0[s]["bytes"] == (2 * 2 * init.numel() if s == "bf16" else None), s


def _replicas_of(rank, world, dp, steps, kind="dp"):
    """World = replicas x dp; replica i is ranks [i*dp, (i+1)*dp), each a DataParallel (or
    ZeRO-2) group on half the replica's batch; the replica group of rank r: the ranks with its
    dp index."""
    from pyfast.parallel import DataParallel, zero
    R = world // dp
    dp_groups = [dist.new_group(list(range(i * dp, (i + 1) * dp))) for i in range(R)]
    rep_groups = [dist.new_group(list(range(j, world, dp))) for j in range(dp)]
    replica, j = divmod(rank, dp)
    m = tiny()
    if kind == "zero2":
        net, opt = zero(m, torch.optim.AdamW, stage=2, group=dp_groups[replica], lr=0.01,
                        weight_decay=0.01)
    else:
        net = DataParallel(m, None, group=dp_groups[replica]) if dp > 1 else m
        opt = inner(m, "adamw")
    cfg = {k: v for k, v in {**CFG, "sync_every": 4, "fragments": 2, "delay": 1,
                             "alpha": 0.5}.items() if k != "inner"}
    dl = DiLoCo(net, opt, group=rep_groups[j], **cfg)
    for t in range(1, steps + 1):
        x, y = batch(replica, t, 2 * BATCH)  # the replica's batch, split over its dp ranks
        net(x[j::dp], y[j::dp]).backward()
        dl.step()
        dl.zero_grad()
    out = {"local": flat(m.parameters()), "global": flat(dl.global_params.values())}
    dl.close()
    if dp > 1 and hasattr(net, "close"):
        net.close()
    return out


@pytest.mark.parametrize("kind", ["dp", "zero2"])
def test_replicas_of_data_parallel_pairs_equal_flat(pool2, pool4, kind):
    flat_run = pool2.run(_replicas_of, 1, 10)
    pairs = pool4.run(_replicas_of, 2, 10, kind)
    for r in range(4):
        # DP's average of two half-batch means vs one whole-batch mean: fp32 rounding, carried
        # through 10 AdamW steps (lr 0.01) and 4 outer steps: 1e-5 absolute on O(1) weights
        torch.testing.assert_close(pairs[r]["local"], flat_run[r // 2]["local"], rtol=0,
                                   atol=1e-5)
        assert torch.equal(pairs[r]["global"], pairs[0]["global"])  # every rank, bit for bit
    assert torch.equal(pairs[0]["local"], pairs[1]["local"])  # a replica's ranks agree


def _resume(rank, world, cfg, steps, cut):
    kw = {k: v for k, v in cfg.items() if k != "inner"}

    def train(m, opt, dl, ts):
        for t in ts:
            m(*batch(rank, t)).backward()
            dl.step()
            dl.zero_grad()

    m = tiny()
    opt = inner(m, cfg["inner"])
    dl = DiLoCo(m, opt, **kw)
    train(m, opt, dl, range(1, steps + 1))
    straight = flat(m.parameters()), flat(dl.global_params.values())
    dl.close()

    m = tiny()
    opt = inner(m, cfg["inner"])
    dl = DiLoCo(m, opt, **kw)
    train(m, opt, dl, range(1, cut + 1))
    saved = copy.deepcopy((m.state_dict(), opt.state_dict(), dl.state_dict()))
    dl.close()

    m2 = tiny()
    with torch.no_grad():  # nothing of the first run may survive but the checkpoint
        for p in m2.parameters():
            p.add_(1.0)
    opt2 = inner(m2, cfg["inner"])
    dl2 = DiLoCo(m2, opt2, **kw)
    m2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    dl2.load_state_dict(saved[2])
    train(m2, opt2, dl2, range(cut + 1, steps + 1))
    resumed = flat(m2.parameters()), flat(dl2.global_params.values())
    dl2.close()
    other = DiLoCo(m2, opt2, **{**kw, "delay": 0})
    try:
        other.load_state_dict(saved[2])
        mismatch = "no error"
    except ValueError as e:
        mismatch = str(e)
    other.close()
    return straight, resumed, sorted(saved[2]), mismatch


def test_resume_is_bit_exact(pool2):
    cfg = {**CFG, "sync_every": 8, "fragments": 2, "delay": 1, "alpha": 0.5,
           "compressor": "int8"}
    # fragment 0 is sent after step 4 and applied after 5, fragment 1 sent 8 applied 9:
    # cut 5: just after an outer step; 6: mid-interval; 8: with a fragment in flight
    for cut in (5, 6, 8):
        for straight, resumed, keys, mismatch in pool2.run(_resume, cfg, 13, cut):
            assert torch.equal(straight[0], resumed[0]) and torch.equal(straight[1], resumed[1])
            assert "schedule differs in ['delay']: saved [1], now [0]" in mismatch
    assert keys == ["compression", "global", "momentum", "payload_bytes", "pending",
                    "schedule", "step"]


def _bad_groups(rank, world):
    from dist_utils import value_error_text
    a, b = dist.new_group([0, 1, 2]), dist.new_group([3])
    c, d, e = dist.new_group([0, 1]), dist.new_group([1, 2]), dist.new_group([2, 3])
    m = tiny()
    sizes = value_error_text(lambda: DiLoCo(m, inner(m, "sgd"), group=a if rank < 3 else b))
    overlap = value_error_text(lambda: DiLoCo(m, inner(m, "sgd"),
                                              group=[c, c, d, e][rank]))
    return sizes, overlap


def test_replica_groups_must_tile_the_world(pool4):
    for sizes, overlap in pool4.run(_bad_groups):
        assert "do not tile the world of 4 ranks" in sizes and "different sizes" in sizes
        assert "overlap but differ" in overlap


def test_dry_run_on_meta_tensors():
    from pyfast.train.dryrun import dry_world
    with dry_world(4, 1):
        with torch.device("meta"):
            m = tiny()
        opt = inner(m, "adamw")
        dl = DiLoCo(m, opt, sync_every=4, fragments=2, delay=1, compressor="int4",
                    group=dist.new_group([1, 3]))
        for t in range(1, 6):  # both fragments sent, one applied after its delay
            x, y = batch(1, t)
            m(x.to("meta"), y.to("meta")).backward()
            dl.step()
            dl.zero_grad()
        held = [*dl.global_params.values(), *dl.momentum_buffers.values(),
                *dl.compressor.feedback.memory.values()]
        assert dl.compressor.feedback.memory and all(t.is_meta for t in held)
        dl.close()


def _beside_the_default_group(rank, world):
    """delay 1 on the default group (group=None) while the caller all-reduces on the default
    group after every step, as a training loop's loss all-reduce would."""
    m = tiny()
    dl = DiLoCo(m, inner(m, "adamw"), sync_every=4, fragments=2, delay=1, compressor="int8",
                group=None)
    sums = []
    for t in range(1, 9):  # fragments sent after 2, 4, 6, 8, each in flight for a step
        m(*batch(rank, t)).backward()
        dl.step()
        dl.zero_grad()
        x = torch.full((3,), float(rank + 1))
        dist.all_reduce(x)
        sums.append(x.tolist())
    dl.close()
    return flat(dl.global_params.values()), sums, dl._comm is not None


def test_delay_on_the_default_group_runs_on_a_private_copy(pool2):
    """NCCL and gloo pair a group's collectives in issue order: the outer all-reduce behind
    the caller's own all-reduces on the default group would pair with them (gloo: a size
    mismatch or a hang). DiLoCo makes a private copy of the default group for it."""
    a, b = pool2.run(_beside_the_default_group)
    assert a[2] and torch.equal(a[0], b[0])
    assert a[1] == b[1] == [[3.0] * 3] * 8


def _sliced(rank, world, spec):
    """2 replicas x DataParallel pairs (world 4): DiLoCo without and with inner_group (each
    rank of a pair sends its half of a fragment, the halves all-gathered in the pair)."""
    from dist_utils import value_error_text

    from pyfast.parallel import DataParallel
    dp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    rep_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, j = divmod(rank, 2)
    out = {}
    for sliced in (False, True):
        m = tiny()
        net = DataParallel(m, None, group=dp_groups[replica])
        dl = DiLoCo(net, inner(m, "adamw"), sync_every=4, fragments=2, delay=1, alpha=0.5,
                    compressor=spec, group=rep_groups[j],
                    inner_group=dp_groups[replica] if sliced else None)
        sizes = [sum(dl.params[dl._index[n]].numel() for n in f) for f in dl.fragments]
        for t in range(1, 10):  # fragment 0 sent after 2, 6; 1 after 4, 8; each applied at +1
            x, y = batch(replica, t, 2 * BATCH)
            net(x[j::2], y[j::2]).backward()
            dl.step()
            dl.zero_grad()
        out[sliced] = flat(m.parameters()), flat(dl.global_params.values()), dl.payload_bytes
        dl.close()
        net.close()
    m = tiny()
    out["topk"] = value_error_text(lambda: DiLoCo(m, inner(m, "sgd"), group=rep_groups[j],
                                                  compressor="topk:0.5",
                                                  inner_group=dp_groups[replica]))
    return out, sizes


@pytest.mark.parametrize("spec", ["none", "int8"])
def test_inner_group_sends_each_byte_between_replicas_once(pool4, spec):
    """inner_group: each rank of a DataParallel pair all-reduces half of every fragment
    between the replicas. fp32 (none): an element's average is the same two fp32 values
    summed, whole or sliced, so the result is bitwise the unsliced one. int8: the slices' own
    blocks and scales, so not bitwise, but every rank of both replicas holds the same global
    parameters, bit for bit, and they stay within int8's rounding of the unsliced run: each
    coding is off by up to half a step, a block's max / 254 (pseudo-gradients <= 0.04 after 4
    AdamW steps at lr 0.01: 1.6e-4), so the two runs' averages by up to 3.2e-4, times outer
    lr 0.7 and Nesterov's 1 + m + m^2 = 2.7 over a fragment's two syncs: 6e-4 (seen 4e-4).
    The payload per rank: the halves, ceil(n / 2)."""
    got = pool4.run(_sliced, spec)
    for r, (out, sizes) in enumerate(got):
        whole, half = out[False], out[True]
        assert torch.equal(half[1], got[0][0][True][1]), r  # one global state everywhere
        if spec == "none":
            assert torch.equal(half[0], whole[0]) and torch.equal(half[1], whole[1]), r
            assert whole[2] == 4 * 2 * sum(sizes)  # each fragment sent twice
            assert half[2] == 4 * 2 * sum(-(-n // 2) for n in sizes)
        else:
            torch.testing.assert_close(half[1], whole[1], rtol=0, atol=6e-4)
            assert half[2] < 0.52 * whole[2]  # the halves' codes and their blocks' scales
        assert "selects or factors whole tensors" in out["topk"]
