"""`pyfast data prepare`: text files or JSONL -> token shards that `pyfast train --data DIR`
memory-maps (nanoGPT's prepare.py + Megatron's indexed dataset, with Hugging Face tokenizers).
The folder's format, and its reader, are pyfast.tokens.

A document is a text file or one JSONL line. It goes to val when blake2b(its id) falls in the
first val_fraction of the hash range; the id is the file's path below its --input root (+
"@BYTE_OFFSET" for a JSONL line), so a document's side depends on nothing else.

Resumable: the inputs are cut into units of about CHUNK bytes (whole text files, JSONL line
ranges), each tokenized into DIR/parts/NNNNNN.npz written atomically. A rerun of the same plan
(DIR/prepare.json: the inputs with sizes and mtimes, the tokenizer, the options) skips the units
done, concatenates the parts in unit order and writes the manifest last: the output is
byte-identical however often the run was interrupted, and with any --workers.
This module imports no torch: the command starts in 0.1 s.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil

import numpy as np

from pyfast._io import atomic_open, atomic_path, atomic_write_bytes, atomic_write_text
from pyfast.tokens import (BYTES_EOS, DTYPES, FORMAT, SPLITS, blake2b_hex, dtype_for,
                           read_manifest)

CHUNK = 4 << 20  # text bytes per unit: 8 units on a 32 MB corpus keep 2 workers busy
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")


def is_val_doc(doc_id: str, fraction: float) -> bool:
    """By document id alone: a document's split never depends on which others exist."""
    h = int.from_bytes(hashlib.blake2b(doc_id.encode(), digest_size=8).digest(), "little")
    return h < fraction * 2.0 ** 64


# ------------------------------------------------------------------ inputs and units
def _walk(root: str) -> list[str]:
    out = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        out += [os.path.join(d, n) for n in sorted(names) if not n.startswith(".")]
    return out


def expand(inputs: list[str]) -> list[tuple[str, str]]:
    """(path, id) of every file an --input names: a file, a folder (its non-hidden files) or a
    glob (`**` recursive); the id is the path below the input's root (its non-glob prefix)."""
    files, seen = [], set()
    for spec in inputs:
        if glob.has_magic(spec):
            parts = spec.replace(os.sep, "/").split("/")
            fixed = parts[:next(i for i, p in enumerate(parts) if glob.has_magic(p))]
            root = "/".join(fixed) or ("/" if spec.startswith("/") else ".")
            found = [p for p in sorted(glob.glob(spec, recursive=True)) if os.path.isfile(p)]
        elif os.path.isdir(spec):
            root, found = spec, _walk(spec)
        elif os.path.isfile(spec):
            root, found = os.path.dirname(spec) or ".", [spec]
        else:
            raise ValueError(f"--input {spec}: no such file or folder")
        if not found:
            raise ValueError(f"--input {spec}: no files match")
        for p in found:
            if os.path.realpath(p) not in seen:
                seen.add(os.path.realpath(p))
                files.append((p, os.path.relpath(p, root).replace(os.sep, "/")))
    return files


def is_jsonl(path: str) -> bool:
    return path.endswith((".jsonl", ".ndjson"))


def units(files: list[tuple[str, str]]) -> list[list[tuple]]:
    """Lists of pieces (path, id, start, end) of about CHUNK bytes: whole text files, JSONL files
    cut at line ends."""
    pieces = []
    for path, rel in files:
        size = os.path.getsize(path)
        if not is_jsonl(path):
            pieces.append((path, rel, 0, size))
            continue
        with open(path, "rb") as f:
            pos = 0
            while pos < size:
                f.seek(pos + CHUNK)
                f.readline()
                end = min(f.tell(), size)
                pieces.append((path, rel, pos, end))
                pos = end
    out, cur, n = [], [], 0
    for p in pieces:
        cur.append(p)
        n += p[3] - p[2]
        if n >= CHUNK:
            out.append(cur)
            cur, n = [], 0
    return out + ([cur] if cur else [])


def _line_no(path: str, offset: int) -> int:
    with open(path, "rb") as f:
        return f.read(offset).count(b"\n") + 1


def documents(piece: tuple, text_field: str):
    """(id, text as bytes) of a piece's documents; ValueError naming the file and line of a JSONL
    line that is not an object with a string `text_field`."""
    path, rel, start, end = piece
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    if not is_jsonl(path):
        yield rel, data
        return
    pos = start
    for line in data.split(b"\n"):
        at, pos = pos, pos + len(line) + 1
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path} line {_line_no(path, at)}: not JSON ({e})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
            has = (f"keys {sorted(obj)[:12]}" if isinstance(obj, dict)
                   else f"a JSON {type(obj).__name__}")
            what = "not a string" if isinstance(obj, dict) and text_field in obj else "missing"
            raise ValueError(f"{path} line {_line_no(path, at)}: --text-field {text_field!r} is "
                             f"{what} (the line holds {has}); pass --text-field NAME")
        yield f"{rel}@{at}", obj[text_field].encode()


# ------------------------------------------------------------------ tokenizers
def load_tokenizer(path: str):
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises its own Exception type for bad files
        raise ValueError(f"--tokenizer {path}: not a Hugging Face tokenizers file ({e})") from None


def tokenizer_file(spec: str) -> str:
    """The tokenizer.json a --tokenizer names: the file, or a Hugging Face tokenizer folder's."""
    path = os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise ValueError(f"--tokenizer {spec}: no such file" if path == spec else
                         f"--tokenizer {spec}: the folder has no tokenizer.json (a fast "
                         f"tokenizer's file; slow-only tokenizers are not read)")
    return path


def find_eos(tok, spec: str, eos: str | None) -> int:
    """--eos, else the folder's tokenizer_config.json eos_token, else a usual EOS name."""
    cfg = os.path.join(spec, "tokenizer_config.json") if os.path.isdir(spec) else ""
    if eos is None and cfg and os.path.isfile(cfg):
        with open(cfg) as f:
            e = json.load(f).get("eos_token")
        eos = e.get("content") if isinstance(e, dict) else e
    for name in ([eos] if eos else EOS_NAMES):
        i = tok.token_to_id(name)
        if i is not None:
            return i
    raise ValueError(f"--tokenizer {spec}: " + (f"--eos {eos!r} is not in its vocabulary" if eos
                     else f"none of {', '.join(EOS_NAMES)} is in its vocabulary: pass --eos"))


def train_bpe(texts, vocab_size: int):
    """A byte-level BPE trained on `texts`, EOS <|endoftext|> = id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_NAMES[0]],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


# ------------------------------------------------------------------ one unit -> one part
_TOK: dict = {}  # per process: the tokenizer a worker loaded once


def encode_unit(job: tuple) -> int:
    """Tokenize one unit into parts/NNNNNN.npz (atomically); returns its text bytes."""
    k, pieces, out, tok_path, eos, dtype, fraction, text_field = job
    if tok_path and tok_path not in _TOK:
        _TOK[tok_path] = load_tokenizer(tok_path)
    tok = _TOK.get(tok_path)
    docs = [d for p in pieces for d in documents(p, text_field) if d[1]]
    replaced = 0
    if tok is None:
        ids = [np.frombuffer(b, np.uint8) for _, b in docs]
    else:
        texts = []
        for _, b in docs:
            try:
                texts.append(b.decode())
            except UnicodeDecodeError:  # counted in the manifest, not hidden
                replaced += 1
                texts.append(b.decode(errors="replace"))
        ids = [np.array(e.ids, np.int64) for e in
               tok.encode_batch_fast(texts, add_special_tokens=False)]
    side = {s: ([], []) for s in SPLITS}
    for (doc_id, _), a in zip(docs, ids):
        toks, lens = side["val" if is_val_doc(doc_id, fraction) else "train"]
        toks += [a, [eos]]
        lens.append(len(a) + 1)
    arrays = {"replaced": np.array(replaced)}
    for s, (toks, lens) in side.items():
        arrays[f"{s}_tokens"] = np.concatenate(toks or [[]]).astype(DTYPES[dtype])
        arrays[f"{s}_lens"] = np.array(lens, "<u8")
    with atomic_path(os.path.join(out, "parts", f"{k:06d}.npz")) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
    return sum(p[3] - p[2] for p in pieces)


# ------------------------------------------------------------------ the whole run
def _plan(files, tokenizer, train_bpe_n, text_field, val_fraction, eos) -> dict:
    inputs = []
    for path, rel in files:
        st = os.stat(path)
        inputs.append([os.path.abspath(path), rel, st.st_size, st.st_mtime_ns])
    if train_bpe_n:
        tok = f"train-bpe:{train_bpe_n}"
    elif tokenizer == "bytes":
        tok = "bytes"
    else:
        with open(tokenizer_file(tokenizer), "rb") as f:
            tok = "tokenizer.json:" + blake2b_hex(f.read())
    return {"format": FORMAT, "inputs": inputs, "tokenizer": tok, "eos": eos,
            "text_field": text_field, "val_fraction": val_fraction, "chunk": CHUNK}


def _claim(out: str, plan: dict) -> dict | None:
    """The finished manifest when `out` already holds this plan's dataset; None to (re)start or
    resume; ValueError when `out` holds something else."""
    man, pre = os.path.join(out, "manifest.json"), os.path.join(out, "prepare.json")
    for path, what in ((man, "a dataset"), (pre, "an unfinished prepare")):
        if os.path.isfile(path):
            with open(path) as f:
                try:
                    theirs = json.load(f)
                except ValueError:
                    theirs = {}
            theirs = theirs.get("source", theirs) if path == man else theirs
            if theirs == plan:
                return read_manifest(out) if path == man else None
            diff = sorted(k for k in set(plan) | set(theirs) if plan.get(k) != theirs.get(k))
            raise ValueError(f"--out {out} holds {what} of other inputs or settings (they differ "
                             f"in: {', '.join(diff)}); remove it or choose another --out")
    if os.path.isdir(out) and os.listdir(out):
        raise ValueError(f"--out {out} is a non-empty folder that holds no pyfast dataset "
                         f"(no manifest.json): choose an empty or new folder")
    return None


def _progress(enabled: bool):
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                               TimeRemainingColumn, TransferSpeedColumn)
    return Progress(TextColumn("tokenizing"), BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), TimeRemainingColumn(), disable=not enabled)


def _run_units(jobs: list, done: int, total: int, workers: int, show: bool) -> None:
    with _progress(show) as bar:
        task = bar.add_task("tokenizing", total=total, completed=done)
        if workers == 1 or len(jobs) <= 1:  # the tokenizer's own threads (rayon), in process
            for job in jobs:
                bar.advance(task, encode_unit(job))
            return
        import multiprocessing as mp
        old = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: set for the
        try:  # spawned workers only, not for this process's later in-process runs
            pool = mp.get_context("spawn").Pool(min(workers, len(jobs)))
        finally:
            if old is None:
                del os.environ["TOKENIZERS_PARALLELISM"]
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = old
        with pool:
            for n in pool.imap_unordered(encode_unit, jobs):
                bar.advance(task, n)


def _concatenate(out: str, n_units: int, dtype: str) -> dict:
    """parts/*.npz -> SPLIT.bin + SPLIT.idx in unit order; each split's counts and hashes."""
    res, h = {}, hashlib.blake2b(dtype.encode(), digest_size=16)
    parts = [os.path.join(out, "parts", f"{k:06d}.npz") for k in range(n_units)]
    lens = {s: [np.zeros(1, "<u8")] for s in SPLITS}
    replaced = 0
    for s in SPLITS:
        with atomic_open(os.path.join(out, f"{s}.bin"), "wb") as f:
            for p in parts:
                with np.load(p) as z:
                    buf = z[f"{s}_tokens"].tobytes()
                    lens[s].append(z[f"{s}_lens"])
                    replaced += int(z["replaced"]) if s == "train" else 0
                f.write(buf)
                h.update(buf)
        offsets = np.cumsum(np.concatenate(lens[s])).astype("<u8")
        atomic_write_bytes(os.path.join(out, f"{s}.idx"), offsets.tobytes())
        res[s] = {"tokens": int(offsets[-1]), "documents": len(offsets) - 1,
                  "shards": [f"{s}.bin"], "index": f"{s}.idx"}
    res["content_hash"] = h.hexdigest()
    res["invalid_utf8_documents"] = replaced
    return res


def prepare(inputs: list[str], out: str, tokenizer: str = "bytes", train_bpe_n: int = 0,
            text_field: str = "text", val_fraction: float = 0.01, workers: int = 1,
            eos: str | None = None, show: bool = False) -> dict:
    """Tokenize `inputs` into the dataset folder `out`; returns its manifest."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"--val-fraction {val_fraction} is not in [0, 1)")
    if workers < 1:
        raise ValueError(f"--workers {workers} must be at least 1")
    if train_bpe_n and train_bpe_n < 257:
        raise ValueError(f"--train-bpe {train_bpe_n}: a byte-level BPE needs at least 257 "
                         "tokens (the 256 byte symbols and EOS)")
    files = expand(inputs)
    plan = _plan(files, tokenizer, train_bpe_n, text_field, val_fraction, eos)
    done = _claim(out, plan)
    if done is not None:  # finished (a kill after the manifest may have left the parts)
        shutil.rmtree(os.path.join(out, "parts"), ignore_errors=True)
        if os.path.isfile(os.path.join(out, "prepare.json")):
            os.remove(os.path.join(out, "prepare.json"))
        return done
    os.makedirs(out, exist_ok=True)
    if not os.path.isfile(os.path.join(out, "prepare.json")):  # first: it claims the folder
        atomic_write_text(os.path.join(out, "prepare.json"), json.dumps(plan, indent=1))
    os.makedirs(os.path.join(out, "parts"), exist_ok=True)
    work = units(files)
    tok_path = os.path.join(out, "tokenizer.json")
    if train_bpe_n:
        if not os.path.isfile(tok_path):  # trained once; a resumed run reuses it
            texts = (b.decode(errors="replace") for u in work for p in u
                     for _, b in documents(p, text_field))
            with atomic_path(tok_path) as tmp:
                train_bpe(texts, train_bpe_n).save(tmp)
        tok = load_tokenizer(tok_path)
        eos_id = find_eos(tok, tok_path, EOS_NAMES[0])
    elif tokenizer != "bytes":
        src = tokenizer_file(tokenizer)
        tok = load_tokenizer(src)
        eos_id = find_eos(tok, tokenizer, eos)
        with open(src, "rb") as f:
            atomic_write_bytes(tok_path, f.read())
    # max id + 1, not get_vocab_size(): that counts entries, and a vocabulary may have gaps
    vocab = max(tok.get_vocab(with_added_tokens=True).values()) + 1 \
        if train_bpe_n or tokenizer != "bytes" else BYTES_EOS + 1
    if tokenizer == "bytes" and not train_bpe_n:
        tok_path, eos_id = "", BYTES_EOS
    dtype = dtype_for(vocab)
    jobs, done_bytes = [], 0
    for k, u in enumerate(work):
        if os.path.isfile(os.path.join(out, "parts", f"{k:06d}.npz")):
            done_bytes += sum(p[3] - p[2] for p in u)
        else:
            jobs.append((k, u, out, tok_path, eos_id, dtype, val_fraction, text_field))
    total = sum(p[3] - p[2] for u in work for p in u)
    _run_units(jobs, done_bytes, total, workers, show)
    splits = _concatenate(out, len(work), dtype)
    if splits["train"]["tokens"] == 0:
        raise ValueError(f"--input {' '.join(inputs)}: no document landed in train (all "
                         f"{splits['val']['documents']} in val, or every document empty)")
    manifest = {"format": FORMAT, "tokenizer": "tokenizer.json" if tok_path else "bytes",
                "vocab_size": vocab, "eos_id": eos_id, "dtype": dtype, "text_bytes": total,
                **splits, "source": plan}
    atomic_write_text(os.path.join(out, "manifest.json"), json.dumps(manifest, indent=1))
    shutil.rmtree(os.path.join(out, "parts"))
    os.remove(os.path.join(out, "prepare.json"))
    return manifest
