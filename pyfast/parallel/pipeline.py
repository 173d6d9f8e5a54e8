"""Pipeline parallelism for an nn.Sequential: each rank of a process group holds one stage (or
v interleaved virtual stages) and runs a schedule's action list (schedules.py) in one loop.

    pipe = Pipeline.from_sequential(seq, n_microbatches=8, schedule="1f1b", loss_fn=F.mse_loss)
    loss = pipe.step(x, target)   # x on the first stage, target on the last; None elsewhere
    opt.step(); opt.zero_grad()   # opt over pipe.parameters(): this rank's layers only

Gradients accumulate like loss.backward() on the mean loss over the whole batch: each
micro-batch loss is back-propagated with weight 1/m, and x gets its gradient when
x.requires_grad. Stages may return a tensor or a tuple of tensors. Schedules: gpipe, 1f1b,
interleaved-1f1b, zb-h1 (torch.distributed.pipelining's names, lower-case).

A failure anywhere (a stage, loss_fn, a dead or silent peer) raises PipelineError on every
rank, naming the rank, stage and micro-batch where it started (p2p.py says how it travels);
the ranks agree on each step's outcome with a flag each sends every other (outcome.py).
"""
from __future__ import annotations

import bisect
import contextlib
import time
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import nn

from pyfast._partition import on_a_line
from pyfast._ranges import ranged
from . import schedules
from pyfast.comm.agree import agree, rank_by_rank
from pyfast.comm.dry import fake_group, read
from pyfast.comm.failure import CommError, as_timedelta, new_group_like
from pyfast.comm.threads import lowered, nice_problem
from pyfast.perf import clock
from .outcome import Flags
from .p2p_fail import settle
from .p2p import (ACT, GRAD, MAX_MICROBATCHES, MAX_STAGES, Link, Peer, PipelineCommError,
                  PipelineError, as_tensors, message_orders)
from .stage_costs import cut, problem as stage_costs_problem
from .trace import Recorder
from .zero_bubble import input_grad, weight_grad

__all__ = ["Pipeline", "PipelineError", "PipelineCommError"]
_built = 0  # Pipelines built by this process; SPMD code builds them in the same order on every rank
now = time.perf_counter
# Receives are posted this many compute actions before their consumer, by schedule. Tiny
# benchmark model (8 x Linear(256), batch 32, 8 micro-batches), side by side with torch's
# schedules on the 2-core Xeon, 41-61 steps a run (session 55): 1F1B at 4 ranks 17.0-18.4 ms a
# step at 1 against 18.4-19.1 at 2 (five runs, 1 faster in each), ZB-H1 19.2-19.4 against
# 20.2-20.3 (two), both within 0.2 ms at 2 ranks; GPipe and interleaved-1f1b the other way (one
# run each: 4 ranks 15.8 / 24.5 ms at 2 against 16.4 / 25.8 at 1; 2 ranks 8.5 / 14.5 against
# 9.0 / 15.9). Where forward and backward alternate, one receive in flight seems to suffice (not
# measured apart: a second may wake the peer's I/O thread while both ranks compute). No
# lookahead deadlocks (a sweep of 2-6 and 8 ranks, the four schedules): sends block only on a line
# (_partition.on_a_line).
RECV_LOOKAHEAD = {"1f1b": 1, "zb-h1": 1, "gpipe": 2, "interleaved-1f1b": 2}
# The outcome's root posts the flags' receives this many compute actions before its end
# (outcome.Flags.post_early): gloo moves a message only once its receive is posted, so the
# flags then travel while the root computes. Tiny model, 1F1B at 4 ranks, side by side, one
# step after a barrier (session 57, five runs of 60-81 steps): torch's step / pyfast's
# 0.904-0.957 with the receives posted at the exchange, 0.934-1.004 at 2 (ahead in each run by
# 1.7-9.0%; 0.963 / 1.005 at 1 in the first two); 10 steps in a loop alike either way; the root's
# exchange 283-328 -> 167-198 us. 2: two actions for the flags' round trip where the last is short.
EARLY = 2
ACTION_NAMES = {schedules.F: "forward", schedules.B: "backward",
                schedules.I: "input-gradient backward", schedules.W: "weight-gradient backward",
                schedules.SEND_F: "sending the output",
                schedules.SEND_B: "sending the input gradient",
                schedules.RECV_F: "posting the input's receive",
                schedules.RECV_B: "posting the output gradient's receive"}


class Pipeline(nn.Module):
    """This rank's stage(s) of a pipelined nn.Sequential; build it with from_sequential."""

    @classmethod
    def from_sequential(cls, seq: nn.Sequential, n_microbatches: int, schedule: str = "1f1b",
                        loss_fn=None, group=None, balance="params", virtual_stages: int = 1,
                        example: torch.Tensor | None = None,
                        split_backward: bool | None = None, timeout=None,
                        stage_costs=None, stage_memory=None, io_nice: int | None = 0) -> Pipeline:
        """Split `seq` into world_size * virtual_stages contiguous stages; stage s goes to rank
        s % world_size. balance: "params" (equal parameter counts), "time" (equal measured
        forward+backward time on `example`, a batch like step's x), or a list of layer counts.
        The layers of other ranks' stages are moved to the meta device, freeing their memory.
        split_backward: run each backward as input gradient then weight gradient (always, for
        zero-bubble schedules, which need it); None decides by layer size (see __init__).
        timeout: seconds (or a timedelta) after which a step waiting on a silent peer fails;
        the pipeline then runs on a private group with this timeout, made by a collective over
        the default group (every rank of the job calls from_sequential at the same point, as
        for dist.new_group). None: the group's own timeout. With more than one rank the
        Pipeline always makes one more group, for each step's outcome flags (outcome.py), by
        the same kind of collective over the default group: from_sequential is collective
        whatever the timeout.
        stage_costs (mixed hardware, stage_costs.py): one float per rank, the relative seconds
        that rank takes for the same work (2.0 = half as fast), or "measure" (each rank times
        a 0.5 s matmul probe of the model's largest Linear; collective): the cut then
        minimises the slowest stage's cost x weight (weights from balance "params" or
        "time"; refused with a list of layer counts). self.stage_costs keeps them.
        stage_memory: one byte budget per rank for the parameters and buffers of its stages
        (with v virtual stages, budget / v for each): no cut gives a rank more; ValueError on
        every rank if none fits. Gradients and optimizer state scale with the parameters:
        pass the budget / (1 + the states' multiple), e.g. / 4 for fp32 AdamW.
        io_nice (gloo groups only): the pipeline sends on private groups (made like the timeout
        one) whose gloo I/O thread gets the SCHED_BATCH policy at this nice value (comm/threads.py
        says why: on a core shared with compute a normal thread, woken mid-call, preempts the
        main thread and spins on the pair's mutex; a batch thread never preempts, and runs at
        full weight once the main thread waits: 1F1B on the tiny benchmark model 10.8-11.0 ->
        9.1-9.3 ms a step at 2 ranks against nice 19 with a yield before each send), and each
        send is waited as it is made, as torch's schedules do (the batch thread moves the data
        only once this rank blocks: 18.1 -> 18.9 ms a step at 4 ranks without these waits) where
        the ranks form a line (one stage a rank, or two ranks); with virtual stages on more than
        two ranks, whose boundaries close a ring, a send blocking on a peer could close a cycle
        of waits, so there sends are waited as with None.
        None: the group as given, threads untouched, sends waited when a later message from
        the peer shows their receive posted. Other backends:
        ignored."""
        global _built
        if not isinstance(seq, nn.Sequential):
            raise TypeError(f"Pipeline.from_sequential needs an nn.Sequential, "
                            f"got {type(seq).__name__}")
        if not isinstance(n_microbatches, int) or not 1 <= n_microbatches < MAX_MICROBATCHES:
            raise ValueError(f"n_microbatches must be an int in [1, {MAX_MICROBATCHES - 1}], "
                             f"got {n_microbatches!r}")
        if dist.is_available() and dist.is_initialized():
            group = group if group is not None else dist.group.WORLD
            rank, p = dist.get_rank(group), dist.get_world_size(group)
        elif group is not None:
            raise ValueError("a group was given but torch.distributed is not initialised")
        else:
            rank, p = 0, 1
        v, m, n = virtual_stages, n_microbatches, p * virtual_stages
        compute = schedules.compute_actions(schedule, rank, p, m, v)  # raises on a bad name or v
        if n > MAX_STAGES:
            raise ValueError(f"{n} stages: at most {MAX_STAGES} are supported")
        if n > len(seq):
            raise ValueError(f"more stages than layers: {p} ranks x {v} virtual stages = {n} stages "
                             f"but the Sequential has {len(seq)} layers")
        if isinstance(balance, (list, tuple)):
            if len(balance) != n:
                raise ValueError(f"balance lists {len(balance)} stages but the group has {p} ranks x "
                                 f"{v} virtual stages = {n} stages (world size does not match)")
            if min(balance) < 1 or sum(balance) != len(seq):
                raise ValueError(f"balance {list(balance)} must be >= 1 layers per stage and sum to "
                                 f"the {len(seq)} layers of the Sequential")
        elif balance not in ("params", "time"):
            raise ValueError(f"balance must be 'params', 'time' or a list of layer counts, "
                             f"got {balance!r}")
        last = (n - 1) % p
        problem = None
        if rank == last and loss_fn is None:
            problem = f"loss_fn is missing on the last stage (rank {rank}): step() needs it"
        elif balance == "time" and not isinstance(example, torch.Tensor):
            problem = (f"balance='time' needs example= (a batch like step's x) on every rank; "
                       f"rank {rank} has none")
        # a stage list without parameters probes (stage_costs="measure") on the host
        device = next((t.device for t in seq.parameters()), torch.device("cpu"))  # cpu-literal: above
        problem = problem or stage_costs_problem(stage_costs, stage_memory, balance, p, device)
        problem = problem or nice_problem(io_nice)
        td = as_timedelta(timeout)  # TypeError/ValueError before any collective
        spec = list(balance) if isinstance(balance, (list, tuple)) else balance
        # a check that one rank skipped would leave the others waiting on it
        # (the costs as text: a NaN, refused above, is unequal to itself and would read as
        # ranks that disagree)
        agree((schedule, m, v, spec, len(seq), td and td.total_seconds(), _built,
               repr(stage_costs), repr(stage_memory), repr(io_nice)),
              ValueError(problem) if problem else None, group,
              differ=lambda seen: "ranks disagree on the pipeline (schedule, n_microbatches, "
              "virtual_stages, balance, layers, timeout, pipelines built, stage_costs, "
              "stage_memory, io_nice): "
              + rank_by_rank(seen))
        lower = p > 1 and io_nice is not None and dist.get_backend(group) == "gloo"
        io_threads = []

        def private(g):  # a group like g with the timeout, its gloo I/O thread lowered
            if not lower:
                return new_group_like(g, td)
            made, tids = lowered(lambda: new_group_like(g, td), io_nice)
            io_threads.extend(tids)
            return made
        if p > 1 and (td is not None or lower):
            group = private(group)
        # the step's outcome travels on a group of its own: after a failed step the pipeline's
        # p2p streams hold unmatched messages that a flag posted there would pair with (NCCL,
        # and gloo under the lane, pair per peer in posting order)
        # (torch's fake backend of a dry run moves nothing: no streams to keep apart there)
        flags = None if p == 1 else group if fake_group(group) else private(group)
        counts, stage_costs, probe_s = cut(seq, n, p, balance, stage_costs, stage_memory,
                                           example, m, group, rank, device)
        bounds = [sum(counts[:s]) for s in range(n + 1)]
        mine = {s: range(bounds[s], bounds[s + 1]) for s in range(rank, n, p)}
        kept = {i for r in mine.values() for i in r}
        owner = {}
        for i, layer in enumerate(seq):  # tied weights across stages would need a gradient all-reduce
            for t in (*layer.parameters(), *layer.buffers()):
                j = owner.setdefault(id(t), i)
                if bisect.bisect_right(bounds, j) != bisect.bisect_right(bounds, i):
                    raise ValueError(f"layers {j} and {i} share a parameter but fall in different "
                                     f"stages; tied weights across stages are not supported")
        stages = {s: nn.Sequential(OrderedDict((str(i), seq[i]) for i in r)) for s, r in mine.items()}
        for i, layer in enumerate(seq):
            if i not in kept:
                layer.to(device="meta")
        _built += 1
        # sends block only on a line: around a ring interleaved-1f1b at 3 ranks hung for m = 3,
        # 5, 6, 8 and 12 (session 55 sweep)
        pipe = cls(stages, bounds, m, schedule, loss_fn, group, rank, p, compute, _built,
                   split_backward, flags, wait_sends=lower and on_a_line(p, v))
        pipe.io_threads = io_threads  # the gloo I/O threads given io_nice (tests read them)
        # per rank (None: even speeds); probe_s: each rank's seconds per probe matmul
        pipe.stage_costs = None if stage_costs is None else [float(c) for c in stage_costs]
        pipe.probe_s = probe_s
        return pipe

    def __init__(self, stages, bounds, m, schedule, loss_fn, group, rank, p, compute, uid,
                 split_backward=None, flag_group=None, wait_sends=False):
        super().__init__()
        mods = list(stages.values())
        self.module = mods[0] if len(mods) == 1 else nn.ModuleList(mods)
        self.stages, self.bounds, self.n_stages = stages, bounds, len(bounds) - 1
        self.n_microbatches, self.schedule, self.loss_fn = m, schedule, loss_fn
        self.group, self.rank, self.world_size = group, rank, p
        self.abandoned: list = []  # a failed step's pending work (agreement), kept alive
        ahead = RECV_LOOKAHEAD.get(schedule, 2)
        self.actions = schedules.lower(compute, self.n_stages, ahead)
        self.forward_actions = schedules.lower(schedules.forward_only(compute), self.n_stages,
                                               ahead)
        self.links, self.peers = {}, {}
        for s in stages:
            for b in (s - 1, s):
                if 0 <= b < self.n_stages - 1 and b not in self.links:
                    other = (b + 1) % p if b % p == rank else b % p
                    if other != rank and other not in self.peers:
                        self.peers[other] = Peer(group, other, rank, wait_sends=wait_sends)
                    self.links[b] = Link(group, uid, b, b % p, (b + 1) % p, rank, m,
                                         self.peers.get(other))
        # the messages between this rank and each neighbour, in training and inference
        lists = [compute if q == rank else schedules.compute_actions(
            schedule, q, p, m, self.n_stages // p) for q in range(p)]
        self._orders = {training: message_orders([pick(a) for a in lists], p, self.n_stages)
                        if self.peers else ({}, {})
                        for training, pick in ((True, list), (False, schedules.forward_only))}
        # the outcome's root: the rank that finishes last in a run of the schedule (it finds
        # the others' flags waiting)
        roots = {training: _last([pick(a) for a in lists], self.n_stages)
                 for training, pick in ((True, list), (False, schedules.forward_only))}
        self.flags = Flags(flag_group, rank, p, roots) if p > 1 else None
        # the root posts the flags' receives before its EARLY-th last compute action (-1: never)
        self._early_at = {training: _early(acts, EARLY) if p > 1 and roots[training] == rank
                          else -1 for training, acts in ((True, self.actions),
                                                         (False, self.forward_actions))}
        self._steps, self._broken, self.last_stats = 0, None, {}
        # Split backward (I then W) on every stage for zero bubble; elsewhere only where Linear
        # layers are big enough for the in-place weight gradient to pay for the graph walk:
        # 4 x Linear(1024), 8 micro-batches of 32 rows, 109 -> 101 ms; the walk costs about
        # 50 us per micro-batch, a loss on Linear(256) layers (AMD EPYC, one thread).
        # Transformer blocks lose: gpt-small, 2 stages of 3 blocks, 1f1b, 4 micro-batches of 2 x
        # 256 tokens, 1555 ms a step split vs 1513 fused (the train job passes False).
        zb = any(a.kind == schedules.W for a in compute)
        self._split = {s: zb or (split_backward if split_backward is not None else
                                 any(isinstance(mod, nn.Linear) and mod.weight.numel() >= 1 << 18
                                     for mod in st.modules())) for s, st in stages.items()}
        self._run_action = {schedules.F: self._f, schedules.B: self._b, schedules.I: self._i,
                            schedules.W: self._w, schedules.SEND_F: self._comm,
                            schedules.SEND_B: self._comm, schedules.RECV_F: self._comm,
                            schedules.RECV_B: self._comm}

    # -- public ------------------------------------------------------------------------------
    def expect(self, specs: dict) -> None:
        """The activations' layout on each boundary b (stage b -> b + 1), as p2p.spec_of gives
        it, for receives that hold no data: a dry run (pyfast.train.dryrun) on the meta device
        over the fake backend, where the header a peer sends arrives empty."""
        for b, link in self.links.items():
            link.dry_spec = specs[b]

    def step(self, x: torch.Tensor | None = None, target: torch.Tensor | None = None,
             trace: bool = False) -> torch.Tensor | None:
        """One training iteration: returns the mean micro-batch loss on the last stage (None
        elsewhere) and leaves the gradients of the whole batch's mean loss in .grad (and in x's
        graph when x.requires_grad)."""
        if not torch.is_grad_enabled():
            raise PipelineError("step() needs autograd enabled; use forward() for inference")
        self._run(self.actions, x, target, True, trace)
        if self.n_stages - 1 not in self.stages:
            return None
        return torch.stack([self._losses[k] for k in range(self.n_microbatches)]).mean()

    @torch.no_grad()
    def forward(self, x: torch.Tensor | None = None, trace: bool = False):
        """Inference through the pipeline (no autograd graph kept): the last stage's output for
        the whole batch (a tensor, or a tuple if the stage returns one) on the rank holding it,
        None elsewhere."""
        self._run(self.forward_actions, x, None, False, trace)
        if self.n_stages - 1 not in self.stages:
            return None
        outs = [self._outputs[k] for k in range(self.n_microbatches)]
        if isinstance(outs[0], torch.Tensor):
            return torch.cat(outs)
        return type(outs[0])(torch.cat(parts) for parts in zip(*outs))

    # -- the runtime loop ----------------------------------------------------------------------
    def _device(self, x):
        """Where this step's buffers go: this rank's parameters', else x's (first stage), else
        the default device (a stage without parameters or buffers on a middle rank)."""
        for st in self.stages.values():
            for t in (*st.parameters(), *st.buffers()):
                return t.device
        return x.device if isinstance(x, torch.Tensor) else torch.get_default_device()

    def _run(self, actions, x, target, training: bool, trace: bool):
        op = "Pipeline.step" if training else "Pipeline.forward"
        if self._broken:
            raise PipelineError(f"{op}: this Pipeline is broken: a step failed earlier "
                                f"({self._broken}); messages of that step may still be in "
                                f"flight, so build a new Pipeline")
        self._steps += 1
        self._training, self._rec = training, Recorder(self.rank, self.group) if trace else None
        self._state, self._gin, self._losses, self._outputs = {}, {}, {}, {}
        self._freed = {}  # (stage, mb) -> how many of the two uses of its output gradient ended
        self.last_stats = stats = {"compute": 0.0, "idle": 0.0, "actions": len(actions)}
        self._dev = self._device(x)
        t0 = clock(self._dev)  # the step's wall time; the trace's per-action marks stay host times
        error = None
        try:
            for link in self.links.values():
                link.begin(self._steps, training, self._dev)
            if self.flags is not None:
                self.flags.begin(self._dev, training)
            for q, peer in self.peers.items():
                pair = (min(q, self.rank), max(q, self.rank))
                orders, when = self._orders[training]
                peer.begin(orders.get(pair, []), when.get(pair))
            self._take_inputs(x, target, training)
            early = self._early_at[training]
            for i, a in enumerate(actions):
                if i == early:
                    self.flags.post_early(self._dev)
                self._act(a)
            if self._x_root is not None:
                self._backward_into_x()
        except Exception as e:  # noqa: BLE001  (every failure must reach the other ranks)
            error = e
            with contextlib.suppress(Exception):  # the group itself may be what failed
                settle(list(self.peers.values()), self._message(e))
        finally:
            self._state, self._gin, self._x, self._t, self._x_root = {}, {}, None, None, None
        self._agree(op, error)
        try:  # every rank has received everything: these waits return at once
            for link in self.links.values():
                link.finish()
        except CommError as e:
            self._broken = str(e)
            raise PipelineCommError(f"{op} failed: rank {self.rank}: {e}") from e
        stats["wall"] = clock(self._dev) - t0
        stats["overhead_per_action"] = (stats["wall"] - stats["compute"] - stats["idle"]) / len(actions)
        if trace:
            stats["peak_activation_bytes"] = self._rec.peak_activation_bytes

    def _message(self, e: Exception) -> str:
        if getattr(e, "forwarded", False):  # another rank's error, already named
            return str(e)
        return f"rank {self.rank}: " + (str(e) if isinstance(e, PipelineError) else
                                        f"{type(e).__name__}: {e}")

    def _agree(self, op: str, error: Exception | None):
        """Every rank learns whether any rank failed this step (outcome.Flags: a flag to the
        rank that finishes last, the outcome back; the messages are gathered only on failure)
        and raises the error where it started. A rank that finished its schedule before a peer
        failed raises too. Not comm.agree, which checks arguments before any data moves: this
        runs after a step that may have lost a peer, so the exchange itself may fail, and the
        error it agrees on is a forwarded one."""
        failed, why = error is not None, None
        if self.world_size > 1:
            try:
                if self.flags.exchange(failed, self._dev):
                    # with what each rank sent to and posted from each other, for drain()
                    seen = [None] * self.world_size
                    mine = (self._message(error) if failed else None,
                            failed and not getattr(error, "forwarded", False),
                            {q: (peer.sent, peer.posted) for q, peer in self.peers.items()})
                    dist.all_gather_object(seen, mine, group=self.group)
                    why = next((m for m, origin, _ in seen if origin),
                               next(m for m, _, _ in seen if m is not None))
                    for q, peer in self.peers.items():
                        peer.drain(seen[q][2][self.rank], self._dev)
            except Exception as e:  # noqa: BLE001  (a dead or silent peer: the group failed)
                local = self._message(error) if failed else f"rank {self.rank}: no error here"
                self._broken = f"{local}; {type(e).__name__}: {e}"
                for link in self.links.values():
                    link.abandon()
                raise PipelineCommError(
                    f"{op} failed: {local}; and agreeing on the step with the other ranks failed "
                    f"(a peer is dead or silent): {type(e).__name__}: {e}") from (error or e)
        elif failed:
            why = self._message(error)
        if why is None:
            return
        self._broken = why
        for link in self.links.values():
            link.abandon()
        kind = PipelineCommError if isinstance(error, CommError) else PipelineError
        where = "" if failed and why == self._message(error) else \
            f" (rank {self.rank} stopped because of it)"
        raise kind(f"{op} failed: {why}{where}") from error

    def _act(self, a):
        try:
            self._run_action[a.kind](a)
        except PipelineError:
            raise
        except CommError as e:
            raise PipelineCommError(f"{ACTION_NAMES[a.kind]} of stage {a.stage}, micro-batch "
                                    f"{a.mb}: {e}") from e
        except Exception as e:
            raise PipelineError(f"{ACTION_NAMES[a.kind]} of stage {a.stage} failed on micro-batch "
                                f"{a.mb}: {type(e).__name__}: {e}") from e

    def _take_inputs(self, x, target, training):
        m, self._x, self._t, self._x_root = self.n_microbatches, None, None, None
        if 0 in self.stages:
            if not isinstance(x, torch.Tensor):
                raise PipelineError(f"the first stage (rank {self.rank}) needs x, a tensor; "
                                    f"got {type(x).__name__}")
            if x.dim() == 0 or x.shape[0] % m or x.shape[0] == 0:
                raise PipelineError(f"batch size {x.shape[0] if x.dim() else 0} is not divisible by "
                                    f"n_microbatches={m}: micro-batches must have equal sizes")
            if training and x.requires_grad:  # x gets its gradient, like loss.backward() would
                self._x_root = x
                self._x = [c.detach().requires_grad_() for c in x.detach().split(x.shape[0] // m)]
            else:
                self._x = x.detach().split(x.shape[0] // m)
        if training and self.n_stages - 1 in self.stages and target is not None:
            if not isinstance(target, torch.Tensor) or target.dim() == 0 or target.shape[0] % m:
                rows = target.shape[0] if isinstance(target, torch.Tensor) and target.dim() else target
                raise PipelineError(f"target batch size {rows} is not divisible by n_microbatches={m}")
            self._t = target.split(target.shape[0] // m)

    def _backward_into_x(self):
        """The first stage's input gradients, gathered per micro-batch, into x's graph at once."""
        grads = [c.grad if c.grad is not None else torch.zeros_like(c) for c in self._x]
        torch.autograd.backward(self._x_root, torch.cat(grads))

    def _mark(self, kind: str, a, t0: float, t1: float):
        if kind == "idle":
            self.last_stats["idle"] += t1 - t0
        elif kind not in ("send", "recv"):
            self.last_stats["compute"] += t1 - t0
        if self._rec is not None and t1 > t0:
            self._rec.add(kind, f"{a.kind}{a.mb} s{a.stage}", t0, t1)

    def _saving(self, key):  # when tracing, count the activations this micro-batch keeps
        if self._rec is None or not self._training:
            return contextlib.nullcontext()
        return self._rec.saving(key, self.parameters())

    def _release(self, key):
        if self._rec is not None:
            self._rec.release(key)

    # -- actions -------------------------------------------------------------------------------
    @ranged("pyfast.pipe.F")
    def _f(self, a):
        """State kept for the backward: (handle, xs, y, loss). xs are the inputs whose gradient
        is wanted (the previous stage's outputs that require grad; x's micro-batch when
        x.requires_grad); handle is the single input the split backward walks from."""
        s, mb, last = a.stage, a.mb, a.stage == self.n_stages - 1
        t0 = now()
        if s == 0:
            x = self._x[mb]
            xs = [x] if x.requires_grad else []
            handle = x if xs else None
            if handle is None and self._training and self._split[0] and x.is_floating_point():
                handle = x.detach().requires_grad_()  # for input_grad's walk, never differentiated
                x = handle
        else:
            link = self.links[s - 1]
            ts = link.take_act(mb)
            is_tuple, specs = link.meta
            if self._training:
                for t, (_, _, rg) in zip(ts, specs):
                    if rg:
                        t.requires_grad_()
            xs = [t for t in ts if t.requires_grad]
            x = tuple(ts) if is_tuple else ts[0]
            handle = xs[0] if len(xs) == 1 else None
        t1 = now()
        target = self._t[mb] if last and self._t is not None else None
        rows = (x[0] if isinstance(x, tuple) else x).shape[0]
        if last and target is not None and target.shape[0] != rows:
            raise PipelineError(f"target has {target.shape[0]} rows per micro-batch but the input has "
                                f"{rows}: x and target batch sizes differ")
        loss, what = None, f"stage {s} (layers {self.bounds[s]}..{self.bounds[s + 1] - 1})"
        try:
            with self._saving((s, mb)):
                y = self.stages[s](x)
                if last and self._training:
                    what = f"loss_fn of stage {s}"
                    loss = self.loss_fn(y, target) if target is not None else self.loss_fn(y)
        except Exception as e:
            if s > 0 and not what.startswith("loss_fn"):
                what += f" cannot take stage {s - 1}'s output"
            raise PipelineError(f"{what} failed on micro-batch {mb}, input {_describe(x)}: "
                                f"{type(e).__name__}: {e}") from e
        self._mark("idle", a, t0, t1)
        self._mark("forward", a, t1, now())
        if last and self._training:
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise PipelineError(f"loss_fn of stage {s} must return a scalar tensor, got {got} "
                                    f"on micro-batch {mb}")
            self._losses[mb] = loss.detach()
        elif last:
            self._outputs[mb] = y
        if not last:
            as_tensors(y, f"stage {s}'s output on micro-batch {mb}")  # fail here, naming it
        self._state[(s, mb)] = [handle, xs, y, loss]

    def _out_grad(self, s, mb, y, loss):
        """What to back-propagate from: the loss weighted 1/m, or the outputs that require grad
        with their gradients."""
        if s == self.n_stages - 1:
            return [loss], [torch.full_like(loss, 1.0 / self.n_microbatches)]
        outs = [t for t in as_tensors(y, "")[1] if t.requires_grad]
        return outs, self.links[s].take_grad(mb)

    def _backward_input(self, s, handle, xs, outs, grads):
        """(plan for W, the gradients of xs). With no plan the whole backward has run (fused)."""
        if len(outs) == 1 and outs[0].requires_grad and handle is not None and self._split[s]:
            params = [p for p in self.stages[s].parameters() if p.requires_grad]
            split = input_grad(outs[0], grads[0], handle, params, want_x=bool(xs))
            if split is not None:
                return split[0], [split[1]] if xs else []
        live = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
        if live:
            torch.autograd.backward([o for o, _ in live], [g for _, g in live])
        return None, [t.grad for t in xs]

    @ranged("pyfast.pipe.B")
    def _b(self, a):
        s, mb = a.stage, a.mb
        handle, xs, y, loss = self._state.pop((s, mb))
        t0 = now()
        outs, grads = self._out_grad(s, mb, y, loss)
        t1 = now()
        plan, gin = self._backward_input(s, handle, xs, outs, grads)
        self._keep_input_grad(s, mb, xs, plan, gin)
        if plan:
            weight_grad(plan)
        self._recycle(s, mb, "backward")
        self._release((s, mb))
        self._mark("idle", a, t0, t1)
        self._mark("backward", a, t1, now())

    @ranged("pyfast.pipe.I")
    def _i(self, a):
        s, mb = a.stage, a.mb
        handle, xs, y, loss = self._state[(s, mb)]
        t0 = now()
        outs, grads = self._out_grad(s, mb, y, loss)
        t1 = now()
        plan, gin = self._backward_input(s, handle, xs, outs, grads)
        self._keep_input_grad(s, mb, xs, plan, gin)
        self._state[(s, mb)] = plan  # W needs only the plan: y, loss and the rest can go
        self._mark("idle", a, t0, t1)
        self._mark("backward", a, t1, now())

    def _keep_input_grad(self, s, mb, xs, plan, gin):
        if s > 0:
            self._gin[(s, mb)] = gin  # for SEND_B
        elif xs and plan is not None and gin[0] is not None:  # split: x's chunk has no .grad yet
            xs[0].grad = gin[0] if xs[0].grad is None else xs[0].grad + gin[0]

    @ranged("pyfast.pipe.W")
    def _w(self, a):
        t0 = now()
        plan = self._state.pop((a.stage, a.mb))
        if plan:
            weight_grad(plan)
        self._recycle(a.stage, a.mb, "backward")
        self._release((a.stage, a.mb))
        self._mark("weight-grad", a, t0, now())

    def _recycle(self, s, mb, done: str):
        """Stage s is done with micro-batch mb's "backward" (weight gradients included) or has
        "sent" its input gradient: the buffer its input arrived in goes back to its link's pool
        after the former, the one its output gradient arrived in after both (the input
        gradient may be that very tensor, through an identity)."""
        if s > 0 and done == "backward":
            self.links[s - 1].recycle(ACT, mb)
        if s == self.n_stages - 1:
            return
        n = self._freed.pop((s, mb), 0) + 1
        if n < (2 if s > 0 else 1):
            self._freed[(s, mb)] = n
        else:
            self.links[s].recycle(GRAD, mb)

    def _comm(self, a):
        """Post a receive (it never blocks: take_* waits) or send a tensor produced earlier."""
        t0, key = now(), (a.stage, a.mb)
        if a.kind == schedules.SEND_F:
            y = self._state[key][2] if self._training else self._state.pop(key)[2]
            self.links[a.stage].send_act(a.mb, y)
        elif a.kind == schedules.SEND_B:
            self.links[a.stage - 1].send_grad(a.mb, self._gin.pop(key))
            self._recycle(a.stage, a.mb, "sent")
        elif a.kind == schedules.RECV_F:
            self.links[a.stage - 1].post_act(a.mb)
        else:  # RECV_B: before this step's first forward is sent, take_grad posts it
            self.links[a.stage].post_grad(a.mb)
        self._mark("send" if a.kind in (schedules.SEND_F, schedules.SEND_B) else "recv", a, t0,
                   now())


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{tuple(x.shape)} {x.dtype}"
    return "(" + ", ".join(_describe(t) for t in x) + ")"


def _early(actions: list, k: int) -> int:
    """The index in `actions` of the k-th last compute action (-1 when there are fewer, or
    k < 1: the receives are then posted at the exchange)."""
    compute = [i for i, a in enumerate(actions) if a.kind in schedules.COMPUTE]
    return compute[-k] if 1 <= k <= len(compute) else -1


def _last(lists: list, n_stages: int) -> int:
    """The rank whose schedule ends last in a run of it (the lowest such rank on a tie)."""
    ends = [max((end for _, end, _ in t), default=0.0)
            for t in schedules.simulate(lists, n_stages)["timeline"]]
    return max(range(len(ends)), key=lambda q: (ends[q], -q))
