"""The pyfast-tokens/1 dataset folder that `pyfast data prepare` (pyfast.prepare) writes and
`pyfast train --data DIR` reads (docs/FORMATS.md).

DIR/manifest.json ("format": "pyfast-tokens/1") names the tokenizer ("bytes": a document's UTF-8
bytes, EOS 256, vocab 257; or "tokenizer.json": DIR/tokenizer.json, a `tokenizers` file), its
vocab_size (max id + 1) and eos_id, the dtype (uint16 when the vocab fits in 65,536 ids, else
uint32), and per split ("train", "val") its tokens, documents, shards (SPLIT.bin: every
document's tokens followed by EOS) and index (SPLIT.idx: little-endian uint64 offsets of the
documents' starts, then the end); content_hash is a blake2b of the dtype and both splits' tokens.
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np

FORMAT = "pyfast-tokens/1"
BYTES_EOS = 256
DTYPES = {"uint16": "<u2", "uint32": "<u4"}
SPLITS = ("train", "val")


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def blake2b_hex(data: bytes, n: int = 16) -> str:
    return hashlib.blake2b(data, digest_size=n).hexdigest()


REQUIRED = ("format", "tokenizer", "vocab_size", "eos_id", "dtype", "train", "val",
            "content_hash")


def read_manifest(path) -> dict:
    """The manifest of a prepared folder, checked against the files beside it (sizes only: no
    token pass); ValueError naming the file and the problem."""
    path = os.fspath(path)
    man = os.path.join(path, "manifest.json")
    if not os.path.isfile(man):
        if os.path.isfile(os.path.join(path, "prepare.json")):
            raise ValueError(f"{path}: an unfinished `pyfast data prepare` (prepare.json, no "
                             "manifest.json): rerun the same command to finish it")
        if os.path.isfile(os.path.join(path, "train.idx")):
            raise ValueError(f"{path}: shards (train.idx) without manifest.json: a damaged "
                             "dataset; prepare it again")
        raise ValueError(f"{path}: no manifest.json (not a prepared dataset)")
    try:
        with open(man) as f:
            m = json.load(f)
    except ValueError as e:
        raise ValueError(f"{man} is corrupt: not JSON ({e})") from None
    missing = [k for k in REQUIRED if not isinstance(m, dict) or k not in m]
    if missing:
        raise ValueError(f"{man} is corrupt: no {', '.join(missing)}")
    if m["format"] != FORMAT:
        raise ValueError(f"{man}: format {m['format']!r}, this pyfast reads {FORMAT!r}")
    if m["dtype"] not in DTYPES:
        raise ValueError(f"{man}: dtype {m['dtype']!r} is not one of {', '.join(DTYPES)}")
    if m["dtype"] != dtype_for(m["vocab_size"]) and m["dtype"] == "uint16":
        raise ValueError(f"{man}: dtype uint16 cannot hold vocab_size {m['vocab_size']:,}")
    if m["tokenizer"] != "bytes" and not os.path.isfile(os.path.join(path, m["tokenizer"])):
        raise ValueError(f"{path}: manifest names tokenizer {m['tokenizer']}, which is missing")
    item = np.dtype(DTYPES[m["dtype"]]).itemsize
    for s in SPLITS:
        sp = m[s]
        if len(sp.get("shards", [])) != 1:
            raise ValueError(f"{man}: {s} has shards {sp.get('shards')}; {FORMAT} has one per "
                             "split")
        for name, want in ((sp["shards"][0], sp["tokens"] * item),
                           (sp["index"], (sp["documents"] + 1) * 8)):
            f = os.path.join(path, name)
            have = os.path.getsize(f) if os.path.isfile(f) else None
            if have != want:
                raise ValueError(f"{f}: {'missing' if have is None else f'{have:,} bytes'}, the "
                                 f"manifest says {want:,} ({s}: {sp['tokens']:,} {m['dtype']} "
                                 f"tokens, {sp['documents']:,} documents)")
    return m


def tokenizer_file(path) -> tuple[str | None, int | None]:
    """A prepared folder's tokenizer from its manifest.json alone (read_manifest checks the
    rest): (the tokenizer.json path, or None for bytes; the EOS id or None). What sampling and
    `pyfast export` load; ValueError when the file the manifest names is missing."""
    path = os.fspath(path)
    with open(os.path.join(path, "manifest.json")) as f:
        m = json.load(f)
    kind = m.get("tokenizer", "bytes")
    if kind == "bytes":
        return None, m.get("eos_id")
    file = os.path.join(path, kind)
    if not os.path.isfile(file):
        raise ValueError(f"{path}: manifest.json names tokenizer {kind!r}, which is missing "
                         f"({file})")
    return file, m.get("eos_id")


def tokenizer_id(path, m: dict) -> str:
    """'bytes' or 'tokenizer.json:BLAKE2B' of the folder's tokenizer file."""
    if m["tokenizer"] == "bytes":
        return "bytes"
    with open(os.path.join(os.fspath(path), m["tokenizer"]), "rb") as f:
        return f"{m['tokenizer']}:{blake2b_hex(f.read())}"


def split_tokens(path, m: dict, split: str) -> np.ndarray:
    """The split's tokens, memory-mapped (nothing read until indexed)."""
    f = os.path.join(os.fspath(path), m[split]["shards"][0])
    if m[split]["tokens"] == 0:
        return np.zeros(0, DTYPES[m["dtype"]])  # np.memmap refuses an empty file
    return np.memmap(f, dtype=DTYPES[m["dtype"]], mode="r")
