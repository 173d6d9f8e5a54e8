"""Context parallelism's costs beyond its FLOPs (pyfast.plan.timing): the attention kernel's
efficiency on short blocks, and ring attention's per-step latency, exposed exchange and merge.

A flash-attention kernel (FlashAttention-2, torch's SDPA on GPUs) gives each thread block one
tile of TILE query rows and walks the key tiles; a causal block computes whole tiles on its
diagonal, and each query tile pays a fixed prologue/epilogue (loading Q, the final rescale,
writing O) that the model counts as one key tile's work. So a block whose query tiles walk n
keys runs at n / (n + TILE) of the kernel's long-block rate, and a causal block of n tokens
wastes the upper halves of its diagonal tiles: n / (n + TILE) again. At 8,192 keys that is 98%,
at 512 (gpt-1b's zigzag chunks at seq 2048 and cp 4: 256 keys) 67%. Model, not measurement:
no published run here uses blocks that short (torchtitan's CP tables keep 32,768 tokens a
rank); a GPU run with pyfast's ring at seq 2048 is the check still to make.

Ring attention (pyfast.parallel.ring_attention), per block and per step of the cp - 1 steps:
forward, a p2p latency (the step's batch_isend_irecv is waited before the next step) plus the
K/V transfer not hidden behind that step's attention, plus merging the step's output into the
fp32 accumulator (ring_attention._merge: acc.mul_ and addcmul_: 16 bytes of fp32 read and
written and the block's output read, per element of the rows it covers: all rows when the
block comes from an earlier rank, half when later: 3/4 on average); backward, the same latency
and the K/V + fp32 dK/dV transfer not hidden behind the step's backward attention, plus the
dQ and dK/dV accumulations (read and write).
"""
from __future__ import annotations

TILE = 128             # FlashAttention-2's query/key tile at head dim 128 (kBlockM = kBlockN)
MERGE_BYTES = 16       # fp32 accumulator read + written by mul_ and again by addcmul_


def block_efficiency(keys: float) -> float:
    """The kernel's rate on query tiles that walk `keys` keys, over its long-block rate."""
    return keys / (keys + TILE) if keys > 0 else 1.0


def causal_efficiency(tokens: float) -> float:
    """A causal block of `tokens` tokens: the diagonal tiles' waste times the per-tile cost of
    query rows that walk tokens / 2 keys on average."""
    return block_efficiency(tokens) * block_efficiency(tokens / 2)


def ring_steps(shape, plan, work, link, act: float, attn_off_f: float, hbm_bps: float
               ) -> tuple[float, float]:
    """(forward, backward) seconds a block adds for its cp - 1 ring steps, beyond the attention
    FLOPs (attn_off_f: the forward seconds of all the off-diagonal blocks' attention, as
    timing_compute counts them; backward is 2x)."""
    steps = plan.cp - 1
    if steps < 1:
        return 0.0, 0.0
    toks = plan.micro_batch * work.seq // plan.cp
    hl, kvl = shape.hidden // plan.tp, shape.kv_dim // plan.tp
    kv = 2.0 * toks * kvl * act                     # K and V of one block
    step_f = attn_off_f / steps
    x_f = link.seconds("p2p", kv) - link.lat
    x_b = link.seconds("p2p", kv + kv * 4 / act) - link.lat   # K/V + the fp32 dK/dV on its way
    merge = 0.75 * toks * hl * (MERGE_BYTES + act) / hbm_bps
    acc_b = (0.75 * toks * hl * 3 * act + 2 * toks * kvl * (8 + act)) / hbm_bps
    fwd = steps * (link.lat + max(0.0, x_f - step_f) + merge)
    bwd = steps * (link.lat + max(0.0, x_b - 2 * step_f) + acc_b)
    return fwd, bwd
