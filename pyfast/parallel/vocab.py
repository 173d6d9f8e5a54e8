"""Vocabulary-parallel embedding and cross-entropy (Megatron-LM, Shoeybi et al. 2019,
arXiv:1909.08053, section 3: the input embedding and the output logits are split along the
vocabulary, the largest dimension of a language model).

    embedding: weight [V/tp, D]   ids -> mask ids this rank does not own -> local lookup (zeros
                                  where masked) -> reduce_from_tp_region (all-reduce)
    loss:      logits [..., V/tp] (a ColumnParallelLinear lm head, gather_output=False) ->
                                  cross-entropy with two all-reduces of [...]-sized
                                  statistics (the row max; then the exp-sums and target
                                  logits together), never of the [..., V] logits

Rank r owns vocabulary rows [r*V/tp, (r+1)*V/tp), the same rows a ColumnParallelLinear over
the vocabulary holds, so a tied lm head can use `embedding.weight` as its shard.

Every rank of the group must see the same ids and targets (as it does in tensor parallelism):
the range checks then raise on every rank together instead of leaving the others waiting in a
collective.

Failures as in pyfast.parallel.tensor: the embedding takes `timeout=` (a private group with it)
and a failed all-reduce raises CommError naming the module and breaks it; the loss's
all-reduces raise CommError naming vocab_parallel_cross_entropy (its group's timeout holds).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function
from torch.autograd.function import once_differentiable

from pyfast.comm.failure import Breaker, naming, new_group_like

from .tp_comm import CommGuard, reduce_from_tp_region, tp_world

_ID_DTYPES = (torch.int64, torch.int32)  # what nn.Embedding and F.cross_entropy accept
_REDUCTIONS = ("mean", "sum", "none")


def _check_ids(ids, what: str, name: str) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dtype not in _ID_DTYPES:
        got = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise TypeError(f"{name}: {what} must be an integer tensor (torch.int64 or "
                        f"torch.int32), got {got}")


def _check_range(ids: torch.Tensor, size: int, what: str, name: str) -> None:
    """One min/max pass over the ids (no collective: every rank decides the same)."""
    if ids.numel() == 0 or ids.device.type == "meta":  # a dry run: ids without values
        return
    lo, hi = torch.aminmax(ids)
    lo, hi = int(lo), int(hi)
    if lo < 0 or hi >= size:
        raise IndexError(f"{name}: {what} {lo if lo < 0 else hi} is out of range [0, {size})")


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding with its rows (the vocabulary) split across the TP group: this rank holds
    weight [num_embeddings/tp, embedding_dim], rows [vocab_start_index, vocab_end_index). The
    output is the whole [..., embedding_dim] embedding on every rank.

    padding_idx behaves as in nn.Embedding (its row starts at zero and gets no gradient); it
    is handled by the rank that owns it. max_norm, scale_grad_by_freq and sparse are not
    supported. timeout: a private group like `group` with that timeout (made collectively
    here)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 group=None, device=None, dtype=None, timeout=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.group = new_group_like(group, timeout) if timeout is not None else group
        self.breaker = Breaker(self._name())
        self.tp_size, self.tp_rank = tp_world(self.group)
        if num_embeddings % self.tp_size:
            raise ValueError(f"{self._name()}: num_embeddings {num_embeddings} (weight shape "
                             f"{(num_embeddings, embedding_dim)}) is not divisible by the "
                             f"tensor-parallel size {self.tp_size}")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"{self._name()}: padding_idx {padding_idx} is out of range "
                                 f"[{-num_embeddings}, {num_embeddings})")
            padding_idx %= num_embeddings  # as nn.Embedding: -1 is the last row
        self.padding_idx = padding_idx
        per_rank = num_embeddings // self.tp_size
        self.vocab_start_index = self.tp_rank * per_rank
        self.vocab_end_index = self.vocab_start_index + per_rank
        self._local_padding_idx = (padding_idx - self.vocab_start_index
                                   if padding_idx is not None and
                                   self.vocab_start_index <= padding_idx < self.vocab_end_index
                                   else None)
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim, device=device,
                                               dtype=dtype))
        self._mark()
        self.reset_parameters()

    def _name(self) -> str:
        return (f"{type(self).__name__}(num_embeddings={self.num_embeddings}, "
                f"embedding_dim={self.embedding_dim})")

    def _mark(self):
        self.weight.tensor_parallel, self.weight.partition_dim = True, 0

    @property
    def guard(self) -> CommGuard:
        """Names this module in a failed collective's error and breaks `breaker`."""
        return CommGuard(self._name(), self.breaker)

    def reset_parameters(self):
        # Every rank draws the FULL table exactly as nn.Embedding does (normal(0, 1) from torch's
        # default generator, padding row zeroed) and keeps its rows. So the sharded table is the
        # nn.Embedding that seed gives whatever the TP size (tp=2 and tp=4 runs start from the
        # same model), with no communication, only the same seed on every rank as data-parallel
        # replicas already need. Drawing only this rank's rows from a per-rank seed would give a
        # table that no dense model has; drawing them from the shared seed would repeat rank
        # 0's rows on every rank. The cost is one transient full table per rank (V*D elements:
        # 0.8 GB fp32 for a 50k x 4096 vocabulary); from_embedding avoids it.
        if self.weight.is_meta:
            return
        full = nn.Embedding(self.num_embeddings, self.embedding_dim, self.padding_idx,
                            device=self.weight.device, dtype=self.weight.dtype)
        self._copy_shard(full)

    @torch.no_grad()
    def _copy_shard(self, embedding: nn.Embedding):
        self.weight.copy_(embedding.weight[self.vocab_start_index:self.vocab_end_index])

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group=None,
                       timeout=None) -> "VocabParallelEmbedding":
        """This rank's shard of `embedding` (its rows), same dtype, device and padding_idx:
        the module computes exactly what `embedding` did."""
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"{cls.__name__}.from_embedding needs an nn.Embedding, got "
                            f"{type(embedding).__name__}")
        for option, off in (("max_norm", None), ("scale_grad_by_freq", False),
                            ("sparse", False)):
            if getattr(embedding, option) != off:
                raise NotImplementedError(f"{cls.__name__}.from_embedding: {option}="
                                          f"{getattr(embedding, option)} is not supported")
        w = embedding.weight
        m = cls(embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx,
                group=group, device="meta", dtype=w.dtype,  # meta: no init drawn, thrown away
                timeout=timeout)
        m.weight = nn.Parameter(torch.empty(m.weight.shape, dtype=w.dtype, device=w.device),
                                requires_grad=w.requires_grad)
        m._mark()
        m._copy_shard(embedding)
        return m

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.breaker.check()
        _check_ids(ids, "ids", self._name())
        _check_range(ids, self.num_embeddings, "id", self._name())
        # Megatron's masking: ids owned elsewhere look up local row 0 and are zeroed after, so
        # they add nothing to the all-reduce and get no gradient.
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local = (ids - self.vocab_start_index).masked_fill(outside, 0)
        y = F.embedding(local, self.weight, self._local_padding_idx)
        return reduce_from_tp_region(y.masked_fill(outside.unsqueeze(-1), 0.0), self.group,
                                     self.guard)

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        return s


class _VocabParallelCrossEntropy(Function):
    """Per-token cross-entropy of vocabulary-sharded logits (Megatron's
    _VocabParallelCrossEntropy), in fp32 whatever the logits' dtype.

    Forward: all-reduce MAX of the row max; all-reduce SUM, in one collective, of the rows'
    exp-sums, of the target logit (non-zero on the rank that owns the target only) and, with
    label smoothing, of the rows' logit sums. Backward: softmax - onehot on the local shard
    ((1 - eps) * onehot + eps / V with label smoothing), no communication.

    Memory: the fp32 softmax of the shard [..., V/tp] is saved for backward and rewritten in
    place into the gradient there. That is 4 bytes per logit held from forward to backward (2x
    the bytes of bf16 logits); saving the logits and the rows' log-sum-exp instead would hold
    2 bytes per bf16 logit but cost a second exp pass over the shard in backward. As Megatron,
    we spend the memory to save the compute. A second backward through the same graph
    (retain_graph=True) fails on the saved tensor's version counter instead of reading the
    overwritten softmax."""

    @staticmethod
    def forward(ctx, logits, target, group, ignore_index: int, label_smoothing: float):
        world, rank = tp_world(group)
        shard = logits.shape[-1]
        vocab, start = shard * world, rank * shard
        m = logits.detach().amax(-1, keepdim=True).float()
        if world > 1:
            with naming("vocab_parallel_cross_entropy: forward all-reduce (max)"):
                dist.all_reduce(m, dist.ReduceOp.MAX, group=group)
        x = logits - m  # m is fp32, so this is one new fp32 buffer (never the caller's logits)

        ignored = target == ignore_index
        mine = (target >= start) & (target < start + shard) & ~ignored
        local = (target - start).masked_fill(~mine, 0)
        target_logit = x.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        logit_sum = [x.sum(-1)] if label_smoothing else []
        e = x.exp_()
        stats = torch.stack([e.sum(-1), target_logit] + logit_sum)
        if world > 1:
            with naming("vocab_parallel_cross_entropy: forward all-reduce (sums)"):
                dist.all_reduce(stats, group=group)
        log_z = stats[0].log()
        loss = log_z - stats[1]  # -log softmax[target]
        if label_smoothing:  # mean over the vocabulary of -log softmax
            loss = (1 - label_smoothing) * loss + label_smoothing * (log_z - stats[2] / vocab)
        loss.masked_fill_(ignored, 0.0)

        softmax = e.div_(stats[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, local, mine, ignored)
        ctx.label_smoothing, ctx.vocab, ctx.dtype = label_smoothing, vocab, logits.dtype
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        g, local, mine, ignored = ctx.saved_tensors
        eps = ctx.label_smoothing
        if eps:
            g.sub_(eps / ctx.vocab)
        # -(1 - eps) at the target on the rank that owns it; -0.0 (a no-op) on local row 0 of
        # rows owned elsewhere, so no gather of indices (and no host sync) is needed
        g.scatter_add_(-1, local.unsqueeze(-1), (mine * -(1.0 - eps)).unsqueeze(-1))
        g.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return g.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, group=None,
                                 ignore_index: int = -100, reduction: str = "mean",
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """F.cross_entropy(logits, target, ...) where logits [..., V] is split along its last
    dimension over the TP group and this rank passes its slice [..., V/tp] (rank r: classes
    [r*V/tp, (r+1)*V/tp)). target [...] holds the full-vocabulary class ids, the same on every
    rank. The gradient is this rank's slice of the full one, in the logits' dtype.

    The loss is computed and returned in fp32 (bf16/fp16 logits are upcast shard-locally;
    F.cross_entropy would return their dtype). Rows whose target is ignore_index contribute
    zero loss and zero gradient; "mean" divides by the number of the other rows (NaN if there
    are none, as F.cross_entropy). Every rank returns the same loss bit for bit."""
    name = "vocab_parallel_cross_entropy"
    if not isinstance(logits_shard, torch.Tensor) or not logits_shard.is_floating_point():
        got = (logits_shard.dtype if isinstance(logits_shard, torch.Tensor)
               else type(logits_shard).__name__)
        raise TypeError(f"{name}: logits_shard must be a floating-point tensor, got {got}")
    _check_ids(target, "target", name)
    if logits_shard.dim() == 0 or target.shape != logits_shard.shape[:-1]:
        raise ValueError(f"{name}: target of shape {tuple(target.shape)} does not match "
                         f"logits_shard of shape {tuple(logits_shard.shape)} (expected the "
                         f"logits' shape without its last, vocabulary dimension)")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{name}: reduction={reduction!r}, expected one of {_REDUCTIONS}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{name}: label_smoothing={label_smoothing} is not in [0, 1]")
    vocab = logits_shard.shape[-1] * dist.get_world_size(group)
    _check_range(target.masked_fill(target == ignore_index, 0), vocab,
                 f"target (ignore_index={ignore_index})", name)

    loss = _VocabParallelCrossEntropy.apply(logits_shard, target, group, ignore_index,
                                            float(label_smoothing))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()
