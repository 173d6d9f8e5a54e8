"""The data layer of `pyfast train`: token corpora and batches that do not depend on the mesh.

A corpus is bytes (vocab 256: the stdlib's own .py sources by default, a text file, a folder),
a nanoGPT uint16 .bin, or a folder that `pyfast data prepare` wrote (pyfast.tokens: uint16 or
uint32 token shards, memory-mapped, with the tokenizer's vocabulary and EOS). Batches are
non-overlapping windows of seq+1 tokens in an order that is a function of (seed, epoch) only:
dp ranks take contiguous slices of the same global batch, so a run at dp=4 sees exactly the
tokens of a run at dp=1, and a checkpoint resumes at any dp.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from pyfast._ranges import ranged
from pyfast.tokens import read_manifest, split_tokens, tokenizer_id

VAL_PERCENT = 2  # files (or tail tokens) held out for validation
# a tail split keeps at least one window at nanoGPT's block size (1024) when the corpus is big
# enough for that to be at most a tenth of it
MIN_VAL_TOKENS = 1025
_SKIP_DIRS = {"site-packages", "dist-packages"}  # pyenv puts site-packages inside the stdlib


@dataclass
class Corpus:
    train: np.ndarray  # 1-D token ids: uint8 for bytes, uint16 for a .bin (may be a np.memmap)
    val: np.ndarray
    vocab_size: int  # 256 for bytes; for a .bin max id + 1 rounded up to 128 (tp <= 128 divides)
    source: str  # one line for logs
    eos_id: int | None = None  # a prepared folder's: EOS ends every document
    tokenizer: str | None = None  # a prepared folder's: "bytes" or the path of its tokenizer.json


def is_val_file(rel: str) -> bool:
    """By file, from the path alone: a file's side never depends on which other files exist."""
    return zlib.crc32(rel.encode()) % 100 < VAL_PERCENT


def _tail_val(n: int) -> int:
    """Tokens a tail split of n tokens gives to val."""
    return max(n * VAL_PERCENT // 100, min(MIN_VAL_TOKENS, n // 10))


def _tail_split(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = len(tokens)
    n_val = _tail_val(n)
    return tokens[: n - n_val], tokens[n - n_val:]


def _files(root: str, keep) -> list[str]:
    """Sorted posix relative paths of the regular files under root that keep(name) accepts."""
    rels = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if keep(x, True)]
        for name in names:
            full = os.path.join(d, name)
            if keep(name, False) and os.path.isfile(full):
                rels.append(os.path.relpath(full, root).replace(os.sep, "/"))
    return sorted(rels)


def _stdlib_name(name: str, is_dir: bool) -> bool:
    return name not in _SKIP_DIRS if is_dir else name.endswith(".py")


def _read_split(root: str, rels: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
    parts: tuple[list, list] = ([], [])
    for rel in rels:
        with open(os.path.join(root, rel), "rb") as f:
            parts[is_val_file(rel)].append(f.read())
    train, val = (np.frombuffer(b"".join(p), dtype=np.uint8) for p in parts)
    return train, val, len(parts[1])


def _tree(root: str, rels: list[str], what: str) -> Corpus:
    if not rels:
        raise ValueError(f"empty corpus: no {what} under {root}")
    train, val, n_val = _read_split(root, rels)
    if len(train) + len(val) == 0:
        raise ValueError(f"empty corpus: the {len(rels)} {what} under {root} are all empty")
    how = f"{n_val} files to val by crc32(path) % 100 < {VAL_PERCENT}"
    if len(val) == 0 or len(train) == 0:
        how = f"no file landed in {'train' if len(val) else 'val'}: last 2% of bytes to val"
        train, val = _tail_split(np.concatenate([train, val]))
    return Corpus(train, val, 256, f"{root}: {len(rels)} {what} ({how}), "
                  f"train {len(train):,} / val {len(val):,} bytes")


def _memmap(path: str) -> np.ndarray:
    size = os.path.getsize(path)
    if size == 0:
        raise ValueError(f"empty corpus: {path} has no tokens")
    if size % 2:
        raise ValueError(f"{path} has {size} bytes, an odd number: not a uint16 token file")
    return np.memmap(path, dtype=np.uint16, mode="r")


def _bin(path: str) -> Corpus:
    tokens = _memmap(path)
    val_path = os.path.join(os.path.dirname(path), "val.bin")
    if os.path.basename(path) == "train.bin" and os.path.isfile(val_path):
        train, val, how = tokens, _memmap(val_path), f"val from {val_path}"
    else:
        (train, val), how = _tail_split(tokens), "last 2% of tokens to val"
    # one pass over the file: about a second per GB when it is in the page cache
    top = max(int(train.max()) if len(train) else 0, int(val.max()) if len(val) else 0)
    vocab = (top + 1 + 127) // 128 * 128
    return Corpus(train, val, vocab, f"{path}: uint16 tokens, vocab {vocab} ({how}), "
                  f"train {len(train):,} / val {len(val):,} tokens")


def _prepared(path: str) -> Corpus:
    m = read_manifest(path)
    train, val = split_tokens(path, m, "train"), split_tokens(path, m, "val")
    # the embedding is padded to a multiple of 128, as for a .bin: tp <= 128 divides it
    vocab = (m["vocab_size"] + 127) // 128 * 128
    tok = "bytes" if m["tokenizer"] == "bytes" else os.path.join(path, m["tokenizer"])
    return Corpus(train, val, vocab, f"{path}: prepared, {m['dtype']} tokens of "
                  f"{m['tokenizer']} (vocab {m['vocab_size']:,}, EOS {m['eos_id']}), train "
                  f"{len(train):,} / val {len(val):,} tokens", m["eos_id"], tok)


def load_corpus(path: str | None = None) -> Corpus:
    """The stdlib's .py files (None), a text file's bytes, a folder's files, a .bin, or a
    prepared folder (its manifest.json: memory-mapped shards, nothing read into RAM)."""
    if path is None:
        # 1,790 files, 31.5 MB (Python 3.11.7): 0.09 s warm, 0.25 s first read, on the 2-core
        # dev container: under the 0.5 s where a cache would pay for its invalidation logic
        root = sysconfig.get_paths()["stdlib"]
        return _tree(root, _files(root, _stdlib_name), "stdlib .py files")
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"corpus not found: {path}")
    if os.path.isdir(path) and _prepared_dir(path):
        return _prepared(path)
    if os.path.isdir(path):
        return _tree(path, _files(path, lambda n, is_dir: not n.startswith(".")), "files")
    if path.endswith(".bin"):
        return _bin(path)
    with open(path, "rb") as f:
        data = np.frombuffer(f.read(), dtype=np.uint8)
    if len(data) == 0:
        raise ValueError(f"empty corpus: {path} is empty")
    train, val = _tail_split(data)
    return Corpus(train, val, 256, f"{path}: bytes (last 2% to val), "
                  f"train {len(train):,} / val {len(val):,} bytes")


# formats that load_corpus would read as text bytes without complaint: refused by name
_NOT_TEXT = (".npy", ".npz", ".pt", ".pth", ".pkl", ".safetensors", ".parquet", ".arrow")
_MB = 1 << 20


def _digest(h, path: str, size: int) -> None:
    """Feed h the first and last MB of path (the whole file when it is at most 2 MB)."""
    with open(path, "rb") as f:
        h.update(f.read(min(size, 2 * _MB)))
        if size > 2 * _MB:
            f.seek(size - _MB)
            h.update(f.read())


def _bin_problem(path: str) -> str | None:
    """Why path cannot be a uint16 token file, from its size and first MB (None: it can)."""
    size = os.path.getsize(path)
    if size == 0:
        return "has no tokens (empty)"
    if size % 2:
        return f"has {size} bytes, an odd number: not a uint16 token file"
    with open(path, "rb") as f:
        head = np.frombuffer(f.read(min(size, _MB) // 4 * 4), dtype=np.uint16)
    # uint32 / int32 ids below 65536, little-endian: every second uint16 is 0
    if len(head) >= 64 and not head[1::2].any() and head[0::2].any():
        return ("looks like 32-bit tokens (every second uint16 of its first MB is 0): write "
                "uint16 ids, as nanoGPT's prepare.py does")
    return None


def _prepared_dir(path: str) -> bool:
    """A folder `pyfast data prepare` wrote or started: never read as a folder of text files."""
    return any(os.path.isfile(os.path.join(path, f))
               for f in ("manifest.json", "prepare.json", "train.idx"))


def _check_prepared(path: str, batch: int, seq: int) -> dict:
    m = read_manifest(path)
    n_train = m["train"]["tokens"]
    sequences = max(n_train - 1, 0) // seq
    if sequences < batch:
        raise ValueError(f"{path}: its {n_train:,} training tokens at --seq {seq} make "
                         f"{sequences} sequences, fewer than one global batch of --batch {batch}")
    # content_hash covers the tokens, tokenizer the ids' meaning: a folder prepared with
    # another tokenizer differs in both (config.resume_changes compares the whole dict)
    return {"train": n_train, "unit": "tokens", "blake2b": m["content_hash"],
            "tokenizer": tokenizer_id(path, m), "vocab_size": m["vocab_size"]}


def check(path: str | None, batch: int, seq: int) -> dict:
    """What load_corpus(path) + Batches(train, batch, seq) would raise, found from file sizes and
    a few MB read (no token pass): ValueError naming the path and the problem (missing, empty,
    not the dtype its name says, fewer training tokens than one global batch). Returns the
    corpus's fingerprint: its size and a blake2b of its files' first and last MB (for folders:
    of every file's name, size and first 4 KB), which a resumed run must match. A prepared
    folder: its manifest against its files' sizes (pyfast.tokens.read_manifest); fingerprint:
    the manifest's content hash, the tokenizer file's hash and the vocab size."""
    if path is not None and os.path.isdir(path) and _prepared_dir(os.fspath(path)):
        return _check_prepared(os.fspath(path), batch, seq)
    h = hashlib.blake2b(digest_size=16)
    if path is None or os.path.isdir(os.fspath(path)):
        root = sysconfig.get_paths()["stdlib"] if path is None else os.fspath(path)
        keep = _stdlib_name if path is None else (lambda n, is_dir: not n.startswith("."))
        rels = _files(root, keep)
        if not rels:
            raise ValueError(f"empty corpus: no files under {root}")
        sizes = {rel: os.path.getsize(os.path.join(root, rel)) for rel in rels}
        for rel in rels:  # the stdlib's 1,790 files: 0.2 s here, most of it in open()
            h.update(f"{rel}\0{sizes[rel]}\n".encode())
            with open(os.path.join(root, rel), "rb") as f:
                h.update(f.read(4096))
        total = sum(sizes.values())
        n_val = sum(n for rel, n in sizes.items() if is_val_file(rel))
        if total == 0:
            raise ValueError(f"empty corpus: the {len(rels)} files under {root} are all empty")
        n_train = total - n_val if 0 < n_val < total else total - _tail_val(total)
        unit, what = "bytes", f"{root} ({len(rels)} files)"
    else:
        path = os.fspath(path)
        if not os.path.exists(path):
            raise ValueError(f"corpus not found: {path}")
        if path.endswith(_NOT_TEXT):
            raise ValueError(f"{path}: not a corpus format pyfast reads (a text file, a folder "
                             f"of text files, or a nanoGPT uint16 .bin)")
        total = os.path.getsize(path)
        files = [path]
        if path.endswith(".bin"):
            val_path = os.path.join(os.path.dirname(path), "val.bin")
            split = os.path.basename(path) == "train.bin" and os.path.isfile(val_path)
            files += [val_path] if split else []
            for f in files:
                why = _bin_problem(f)
                if why:
                    raise ValueError(f"{f} {why}")
            n = total // 2
            n_train, unit = (n if split else n - _tail_val(n)), "uint16 tokens"
        else:
            if total == 0:
                raise ValueError(f"empty corpus: {path} is empty")
            with open(path, "rb") as f:
                if b"\0" in f.read(_MB):
                    raise ValueError(f"{path}: NUL bytes in its first MB, not text (token ids "
                                     "belong in a uint16 .bin)")
            n_train, unit = total - _tail_val(total), "bytes"
        for f in files:
            size = os.path.getsize(f)
            h.update(f"{size}\n".encode())  # contents only: a moved corpus is the same one
            _digest(h, f, size)
        what = path
    sequences = max(n_train - 1, 0) // seq
    if sequences < batch:
        raise ValueError(f"{what}: its {n_train:,} training {unit} at --seq {seq} make "
                         f"{sequences} sequences, fewer than one global batch of --batch {batch}")
    return {"train": n_train, "unit": unit, "blake2b": h.hexdigest()}


def _epoch_seed(seed: int, epoch: int) -> int:
    # a hash, not seed + epoch: (seed 1, epoch 0) must not replay (seed 0, epoch 1)
    return int.from_bytes(hashlib.blake2b(f"{seed}/{epoch}".encode(), digest_size=8).digest(),
                          "little")


class Batches:
    """Global batch k of epoch e = k // (sequences // batch) is rows perm_e[i*batch:(i+1)*batch],
    i = k % (sequences // batch); dp rank r takes its contiguous batch // dp_size of them, or
    with split (n_0, ..., n_{dp_size-1}, summing to batch: pyfast train --batch-split) the
    contiguous rows [n_0 + ... + n_{r-1}, + n_r): the same global batches in the same order."""

    def __init__(self, tokens: np.ndarray, batch: int, seq: int, seed: int, dp_rank: int = 0,
                 dp_size: int = 1, shuffle: bool = True, split=None):
        if batch < 1 or seq < 1:
            raise ValueError(f"batch ({batch}) and seq ({seq}) must be at least 1")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_size {dp_size})")
        if split is None and batch % dp_size:
            raise ValueError(f"global batch {batch} does not divide over dp_size {dp_size}")
        self.sequences = max(len(tokens) - 1, 0) // seq
        if self.sequences < batch:
            raise ValueError(f"{len(tokens):,} tokens at seq {seq} make {self.sequences} "
                             f"sequences, fewer than one global batch of {batch}")
        self.tokens, self.batch, self.seq, self.seed = tokens, batch, seq, seed
        self.shuffle = shuffle
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.resplit(split)
        self.per_epoch = self.sequences // batch  # the last sequences % batch wait for next epoch
        self.position = 0
        self._epoch, self._perm = -1, np.arange(0)
        self._offsets = np.arange(seq + 1)

    def resplit(self, split=None) -> None:
        """This rank's rows of every later global batch: the even split (None) or `split`
        (one count per dp rank, each >= 1, summing to the global batch); ValueError otherwise.
        The global batches themselves do not change."""
        if split is not None and (len(split) != self.dp_size or sum(split) != self.batch
                                  or min(split) < 1):
            raise ValueError(f"split {list(split)} must give each of dp_size {self.dp_size} "
                             f"ranks >= 1 row and sum to the global batch {self.batch}")
        r = self.dp_rank
        self.local = self.batch // self.dp_size if split is None else split[r]
        # this rank's first row within a global batch
        self.first = r * self.local if split is None else sum(split[:r])

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
                self._perm = torch.randperm(self.sequences, generator=g).numpy()
            else:
                self._perm = np.arange(self.sequences)
            self._epoch = epoch
        return self._perm

    @ranged("pyfast.data.next")
    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, i = divmod(self.position, self.per_epoch)
        start = i * self.batch + self.first
        rows = self._order(epoch)[start:start + self.local]
        windows = np.asarray(self.tokens[rows[:, None] * self.seq + self._offsets], np.int64)
        self.position += 1
        w = torch.from_numpy(windows)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {"position": self.position, "batch": self.batch, "seq": self.seq,
                "seed": self.seed, "tokens": len(self.tokens), "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Position is in global batches, so a state saved at any dp_size resumes at any other."""
        mine = self.state_dict()
        for key in ("batch", "seq", "seed", "tokens", "shuffle"):
            if key in state and state[key] != mine[key]:
                raise ValueError(f"data state from a different run: {key} {state[key]} in the "
                                 f"checkpoint, {mine[key]} here")
        if int(state["position"]) < 0:
            raise ValueError(f"data state position {state['position']} is negative")
        self.position = int(state["position"])
