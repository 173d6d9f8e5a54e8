"""`--sample-every K --prompt TEXT`: a short sample of the model being trained, on its own mesh.

Every rank runs generate() together: each new token is one full forward of the whole window
(no KV cache: a few dozen tokens at eval time, where a cache per parallelism would be more code
than the forwards cost), so tensor, context and pipeline parallelism run exactly as in
evaluation. The window is right-padded to --seq: attention is causal, so the logits at the last
real position never see the padding, and every forward has the shape of training (cp's chunks,
the pipeline's micro-batches). One rank holds the whole next-token logits (the last stage, tp,
dp and cp rank 0, after gathering tp's vocabulary shards and cp's sequence shards), picks the
token, and a one-element all-reduce gives it to every rank.

The text goes through the data's tokenizer: DATA_DIR/tokenizer.json (Hugging Face `tokenizers`)
when DATA_DIR/manifest.json names one, bytes (UTF-8, undecodable bytes replaced) otherwise.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist


@dataclass
class Tokenizer:
    name: str  # for messages: "bytes" or the tokenizer.json's path
    encode: Callable[[str], list]
    decode: Callable[[list], str]


BYTES = Tokenizer("bytes (UTF-8)", lambda s: list(s.encode("utf-8")),
                  lambda ids: bytes(ids).decode("utf-8", errors="replace"))


def tokenizer_for(data: str | None) -> Tokenizer:
    """The tokenizer of --data: a prepared DATA_DIR's (manifest.json "tokenizer": "bytes" or
    "tokenizer.json"), bytes for the stdlib, a text file or a folder of text; ValueError for
    token ids that come without one (a nanoGPT .bin)."""
    if data is None:
        return BYTES
    root = os.path.dirname(data) if os.path.basename(data) == "manifest.json" else data
    if os.path.isfile(os.path.join(root, "manifest.json")):
        from pyfast.tokens import tokenizer_file
        path, _ = tokenizer_file(root)
        if path is None:
            return BYTES
        from tokenizers import Tokenizer as HF
        tok = HF.from_file(path)
        return Tokenizer(path, lambda s: tok.encode(s, add_special_tokens=False).ids,
                         lambda ids: tok.decode(ids, skip_special_tokens=False))
    if str(data).endswith(".bin"):
        raise ValueError(f"--data {data} holds token ids without a tokenizer to encode the "
                         "prompt or decode a sample (prepare the text with `pyfast data "
                         "prepare`, which keeps its tokenizer)")
    return BYTES


@contextlib.contextmanager
def evaluating(model: torch.nn.Module):
    """model.eval() inside, the mode it had restored after (also on an exception)."""
    was = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was)


def pick(logits: torch.Tensor, top_k: int, gen: torch.Generator) -> int:
    """Greedy (top_k 0), or a draw from the softmax of the top_k logits with `gen` (its own
    generator: the training RNG stays untouched, so a resumed run is still bit-exact)."""
    logits = logits.float().cpu()
    if top_k <= 0:
        return int(logits.argmax())
    v, i = logits.topk(min(top_k, logits.numel()))
    return int(i[torch.multinomial(torch.softmax(v.double(), 0), 1, generator=gen)])


def _last_logits(job, x: torch.Tensor, t: int) -> torch.Tensor | None:
    """The logits after position t - 1 of x [rows, seq] (whole vocabulary) on the rank that
    picks, None elsewhere. Collective over the job's mesh."""
    from pyfast.parallel.context import shard_sequence, unshard_sequence
    cfg, mesh = job.cfg, job.mesh
    if cfg.cp > 1:
        x = shard_sequence(x, mesh.cp_group, dim=1, layout=cfg.cp_layout)
    if job.pipe is not None:
        out = job.pipe(x)  # Pipeline.forward: the last stage's output, None elsewhere
    else:
        out = (job.zero if job.zero is not None else job.model)(x)  # zero 3 gathers
    if out is None:
        return None
    if cfg.cp > 1:  # every cp rank of this stage holds a shard: gather in natural order
        out = unshard_sequence(out, mesh.cp_group, dim=1, layout=cfg.cp_layout)
    last = out[0, t - 1].float().contiguous()
    if cfg.tp > 1 and job.model.vocab_parallel:  # tp rank r holds rows [rV/tp, (r+1)V/tp)
        parts = [torch.empty_like(last) for _ in range(cfg.tp)]
        dist.all_gather(parts, last, group=mesh.tp_group)
        last = torch.cat(parts)
    return last


@torch.no_grad()
def generate(job, prompt: list, n: int, top_k: int = 0, seed: int = 0) -> list:
    """n token ids continuing `prompt` from the job's current model (in eval mode), the same
    list on every rank; every rank of the job must call it together."""
    cfg, mesh = job.cfg, job.mesh
    # a pipeline splits its batch into m micro-batches: m copies of the window
    rows = cfg.m if job.pipe is not None else 1
    picker = job.owns_loss and mesh.dp_rank == 0 and mesh.cp_rank == 0
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    with evaluating(job.model):
        for _ in range(n):
            window = ids[-cfg.seq:]
            x = torch.zeros(rows, cfg.seq, dtype=torch.long)
            x[:, :len(window)] = torch.tensor(window, dtype=torch.long)
            logits = _last_logits(job, x.to(job.device), len(window))
            tok = torch.zeros(1, dtype=torch.int64, device=job.device)
            if picker:
                tok.fill_(pick(logits, top_k, gen))
            dist.all_reduce(tok)  # one rank holds the token, the others add 0
            ids.append(int(tok))
    return ids[len(prompt):]


class Sampler:
    """--sample-every for the run's loop: the prompt encoded once; each call generates on every
    rank together and returns the decoded prompt and sample, which rank 0 (console) prints."""

    def __init__(self, cfg):
        self.cfg, self.tok = cfg, tokenizer_for(cfg.data)
        self.prompt = self.tok.encode(cfg.prompt)

    def __call__(self, job, step: int, console=None) -> str:
        c = self.cfg
        ids = generate(job, self.prompt, c.sample_tokens, c.sample_top_k, seed=c.seed + step)
        text = self.tok.decode(self.prompt + ids)
        if console is not None:
            how = f"top-{c.sample_top_k}" if c.sample_top_k else "greedy"
            console.print(f"sample at step {step} ({how}, {len(ids)} tokens): {text!r}",
                          markup=False, highlight=False)
        return text
