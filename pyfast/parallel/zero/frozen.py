"""Stage 3's frozen parameters (a LoRA base: QuantLinear codes/scales, frozen norms, embeddings,
biases), sharded over the group and all-gathered as they are stored: zero(frozen="shard").

Layout, per unit (the module whose forward gathers it; the same owner rule as the trainable
parameters, stage3.unit_groups): one flat uint8 buffer of W equal segments of S bytes. Parameter
p of n elements of e bytes is split like a trainable one (layout.py: s = ceil(n / W) elements,
rank r owns elements [r*s, min((r+1)*s, n))) and its piece sits at a byte offset that is a
multiple of ALIGN in every segment (S too), so
- between steps this rank keeps only its segment (`seg`, S bytes: ~1/W of the unit's frozen
  bytes, in their own encoding: bf16 stays 2 bytes, packed NF4 half a byte, plus its scales),
  and the parameters are 0-element tensors of their own dtype (no fp32 master, no optimizer
  state, no gradient; never reduced);
- a gather is one all-gather of the segments (the bytes exactly: W * S bytes received per
  unit), queued on the same FIFO as the unit's trainable all-gather, right behind it;
- ALIGN = 16 keeps every piece aligned for any dtype, and S a multiple of 4 lets the native
  engine (float32 only) carry the segment as S / 4 float32 words, bits untouched.

Host (zero(frozen="shard", offload="params")): `seg` is a host buffer (offload.Host: pinned on
CUDA, meta on a dry run) and the device holds none of the base between uses: stage() starts the
segment's host -> device copy (Stage3Model stages it `prefetch` units ahead of its gather), the
gather waits for that copy before it reads, and the device copy is dropped once the gather is
done: a rank's device then holds only the gathered (full) frozen bytes of the units in flight.

Stages 1/2 keep the frozen parameters whole on every rank (frozen="replicate", the default, as
before this module): there is no gather in their forward to hang a frozen gather on.

Placement (the job's --base-placement auto): replicate_fits() says whether the whole base fits.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from pyfast import _dist
from pyfast.comm.collectives import Handle
from pyfast.comm.failure import naming

from .layout import shard_range, shard_size

MODES = ("replicate", "shard")
ALIGN = 16
# dtypes whose storage is plain bytes (a view as uint8 is the value): what a gather can move
SENDABLE = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8, torch.int8,
            torch.int16, torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn,
            torch.float8_e5m2)


def _round_up(x: int, a: int) -> int:
    return -(-x // a) * a


def frozen_named(module, trainable: list) -> list:
    """(FQN, parameter) of every frozen parameter (requires_grad=False; a tied one once, under
    its first name), registration order."""
    ids = {id(p) for _, p in trainable}
    return [(n, p) for n, p in module.named_parameters() if id(p) not in ids]


def check_frozen(named: list, device) -> None:
    """ValueError naming the first frozen parameter a gather cannot move as bytes (a dtype
    outside SENDABLE, a sparse or quantized tensor) or that sits on another device than the
    trainable ones (one buffer per unit lives on one device)."""
    for n, p in named:
        if p.layout != torch.strided or p.dtype not in SENDABLE:
            raise ValueError(f"zero(frozen='shard'): frozen parameter {n!r} is {p.dtype} "
                             f"({p.layout}), which cannot be sent as bytes; sendable dtypes: "
                             f"{', '.join(str(d).replace('torch.', '') for d in SENDABLE)}")
        if p.device != device:
            raise ValueError(f"zero(frozen='shard'): frozen parameter {n!r} is on {p.device}, "
                             f"the trainable ones on {device}")


@dataclass
class FrozenUnit:
    """A unit's frozen parameters over `world` ranks, seen from `rank` (module docstring)."""
    index: int
    names: list
    params: list
    shapes: list
    numels: list
    esizes: list
    offsets: list          # byte offset of each piece in every segment
    S: int                 # segment bytes
    world: int
    rank: int
    module: object = None
    seg: torch.Tensor = field(default=None, repr=False)  # this rank's stored bytes
    device: torch.device = None   # where the gathers run (the trainable parameters' device)
    host: object = None           # offload.Host: seg lives in host memory (module docstring)

    def piece_bytes(self, i: int) -> int:
        return shard_size(self.numels[i], self.world) * self.esizes[i]

    @property
    def nbytes(self) -> int:
        """The unit's frozen bytes, whole."""
        return sum(n * e for n, e in zip(self.numels, self.esizes))

    def _cols(self, full: torch.Tensor, i: int) -> torch.Tensor:
        sb = self.piece_bytes(i)
        return full.view(self.world, self.S)[:, self.offsets[i]:self.offsets[i] + sb]

    def store(self, i: int, src: torch.Tensor) -> None:
        """This rank's piece of parameter i (its full value `src`) into seg."""
        start, length = shard_range(self.numels[i], self.world, self.rank)
        e, off = self.esizes[i], self.offsets[i]
        raw = src.detach().contiguous().reshape(-1).view(torch.uint8)
        self.seg[off:off + length * e].copy_(raw[start * e:(start + length) * e])

    def copy_out(self, full: torch.Tensor, i: int, dst: torch.Tensor) -> None:
        """Parameter i's bytes from a gathered buffer into dst (contiguous, its dtype)."""
        sb = self.piece_bytes(i)
        if sb == 0:
            return
        cols = self._cols(full, i)
        nb = self.numels[i] * self.esizes[i]
        rows, rem = divmod(nb, sb)
        flat = dst.view(-1).view(torch.uint8)
        flat[:rows * sb].view(rows, sb).copy_(cols[:rows])
        if rem:
            flat[rows * sb:].copy_(cols[rows, :rem])

    def stage(self) -> tuple:
        """(device segment, its offload.Copy): the host segment's copy to the device, started.
        Only with a host segment."""
        dev = torch.empty(self.S, dtype=torch.uint8, device=self.device)
        return dev, self.host.to_device(dev, self.seg)

    def start_gather(self, engine, group, staged=None) -> tuple:
        """(handle, full buffer, the device segment it reads): the all-gather of the segments,
        on the native engine's FIFO (engine given) or comm's FIFO worker over `group`. With a
        host segment the gather reads its device copy (`staged`: from stage(), else staged
        now), after waiting for it; the caller keeps that copy until the handle is waited."""
        seg = self.seg
        if self.host is not None:
            seg, copy = staged or self.stage()
            copy.wait()  # the gather (on the current stream's order) reads what the copy wrote
        full = torch.empty(self.world * self.S, dtype=torch.uint8, device=self.device)
        if engine is not None:
            return engine.all_gather_into(full.view(torch.float32),
                                          seg.view(torch.float32)), full, seg
        return Handle.on_worker(_gather_bytes, full, seg, group,
                                f"zero stage 3 frozen all-gather of unit {self.index}"), full, seg

    def describe(self) -> list[str]:
        return [f"frozen {self.index}:{n}:{tuple(s)}:{e}:{o}:{self.S}"
                for n, s, e, o in zip(self.names, self.shapes, self.esizes, self.offsets)]


def _gather_bytes(full, seg, group, what):
    with naming(what):
        _dist.all_gather_single(full, seg, group=group)
    return full


def _offsets(members: list, world: int) -> tuple[list, int]:
    """(each piece's byte offset in a segment, the segment's bytes S) of one unit's members."""
    offsets, off = [], 0
    for _, p in members:
        offsets.append(off)
        off = _round_up(off + shard_size(p.numel(), world) * p.element_size(), ALIGN)
    return offsets, _round_up(off, ALIGN)


def segment_bytes(groups: list, world: int) -> int:
    """The bytes of a rank's segments for these groups (before frozen_units allocates them:
    offload="params"'s host-memory check counts them)."""
    return sum(_offsets(members, world)[1] for members in groups)


def frozen_units(groups: list, modules: list, world: int, rank: int,
                 host=None) -> list[FrozenUnit]:
    """FrozenUnits of `groups` (lists of (FQN, parameter), stage3.unit_groups' order), each
    rank's segment filled from the parameters' current (full) values; in host memory when
    `host` (an offload.Host: offload="params") is given. The parameters are left full:
    Stage3Model frees them."""
    units = []
    for u, (members, mod) in enumerate(zip(groups, modules)):
        offsets, S = _offsets(members, world)
        fu = FrozenUnit(u, [n for n, _ in members], [p for _, p in members],
                        [tuple(p.shape) for _, p in members], [p.numel() for _, p in members],
                        [p.element_size() for _, p in members], offsets, S,
                        world, rank, mod, device=members[0][1].device, host=host)
        if host is None:
            fu.seg = torch.zeros(fu.S, dtype=torch.uint8, device=fu.device)
        else:  # padding zeroed as on the device: the gathered bytes are the same either way
            fu.seg = host.empty(fu.S, torch.uint8).zero_()
        with torch.no_grad():
            for i, (_, p) in enumerate(members):
                fu.store(i, p)
        units.append(fu)
    return units


# ---------------------------------------------------------------------- placement (the job's)
# auto replicates when the whole frozen base plus the rest of a rank's model state fits in
# FIT of the memory a rank may use: what is left for activations, the gathered units and the
# allocator's slack. Budget: CUDA, the device's free memory (torch.cuda.mem_get_info); CPU, the
# physical memory over the ranks of this host (LOCAL_WORLD_SIZE).
FIT = 0.5


def memory_budget(device) -> tuple[int, str]:
    """(bytes a rank may use, where that number came from)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"{free / 2**30:.1f} GiB free on {device}"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return phys // local, f"{phys / 2**30:.1f} GiB of host memory / {local} local rank(s)"


def choose_placement(requested: str, frozen_bytes: int, rest_bytes: int, world: int,
                     budget: tuple[int, str]) -> tuple[str, str]:
    """(replicate|shard, why): `requested` (--base-placement) unless "auto"; auto replicates
    when frozen_bytes (whole) + rest_bytes <= FIT * budget, else shards (frozen_bytes / world a
    rank). A world of one never shards (nothing to gather from)."""
    if requested in MODES:
        return requested, f"--base-placement {requested}"
    if requested != "auto":
        raise ValueError(f"base placement must be auto, replicate or shard, got {requested!r}")
    if world == 1:
        return "replicate", "auto: one rank"
    cap, where = budget
    need = frozen_bytes + rest_bytes
    mb = lambda b: f"{b / 2**20:.1f} MB"  # noqa: E731
    if need <= FIT * cap:
        return "replicate", (f"auto: whole base {mb(frozen_bytes)} + rest {mb(rest_bytes)} "
                             f"<= {FIT} x {where}")
    return "shard", (f"auto: whole base {mb(frozen_bytes)} + rest {mb(rest_bytes)} > {FIT} x "
                     f"{where}")


def summary(mode: str, fmt: str, frozen_bytes: int, world: int, why: str) -> str:
    """The job's log line: 'frozen base: sharded nf4, 12.3 MB a rank of 24.6 (auto: ...)'."""
    per = frozen_bytes / world if mode == "shard" else frozen_bytes
    what = "sharded" if mode == "shard" else "replicated"
    return (f"frozen base: {what} {fmt}, {per / 2**20:.1f} MB a rank of "
            f"{frozen_bytes / 2**20:.1f} ({why})")


def decide(module, requested: str, fmt: str, world: int, device,
           host: bool = False) -> tuple[str, str]:
    """The job's zero(frozen=...) for --base-placement `requested` and its log line: the frozen
    bytes of `module` whole, the rest a rank's ZeRO-3 state of the trainable ones (16 bytes a
    parameter over W: fp32 master, gradient, two Adam moments), the budget memory_budget().
    host (--offload params): auto shards, since only a sharded base lives in host memory."""
    frozen = sum(p.numel() * p.element_size() for p in module.parameters() if not p.requires_grad)
    if requested == "auto" and host and world > 1:
        return "shard", summary("shard", fmt if fmt != "none" else "as built", frozen, world,
                                "auto: --offload params keeps the sharded base in host memory")
    rest = 16 * sum(p.numel() for p in module.parameters() if p.requires_grad) // world
    mode, why = choose_placement(requested, frozen, rest, world,
                                 memory_budget(device) if requested == "auto" else (0, ""))
    return mode, summary(mode, fmt if fmt != "none" else "as built", frozen, world, why)
