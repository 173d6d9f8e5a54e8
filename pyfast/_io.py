"""Files pyfast writes (benchmark results, plots, logs) appear whole or not at all.

Each is written to a hidden temporary file in the target's directory (same file system, so
the rename is atomic) and moved over the target with os.replace. An error or ^C midway
removes the temporary file and leaves the previous version of the target untouched; only a
SIGKILL can leave a `.NAME.XXXXXXXX.tmp.EXT` behind, never a truncated NAME.EXT.
"""
from __future__ import annotations

import contextlib
import os
import secrets
from typing import IO, Iterator


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # the data is on disk before the name points at it
    finally:
        os.close(fd)


def fsync_dir(path) -> None:
    """fsync a directory: the names created, renamed or removed in it are on disk (a rename
    is durable only once its directory is synced; POSIX, a no-op need on Windows)."""
    if os.name == "nt":
        return
    _fsync(os.fspath(path))


@contextlib.contextmanager
def atomic_path(path) -> Iterator[str]:
    """A temporary path beside `path` for writers that take a file name (savefig,
    torch.save); it replaces `path` when the block ends without an error. The temporary
    name keeps path's extension (savefig infers the format from it)."""
    path = os.fspath(path)
    head, tail = os.path.split(path)
    root, ext = os.path.splitext(tail)
    tmp = os.path.join(head, f".{root}.{secrets.token_hex(4)}.tmp{ext}")
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:  # KeyboardInterrupt too: no temporary file is left behind
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


@contextlib.contextmanager
def atomic_open(path, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """open(path, mode) for writing ("w" or "wb"), committed atomically when the block ends."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes a whole file: mode 'w' or 'wb', not {mode!r}")
    with atomic_path(path) as tmp:
        kw = {"encoding": encoding} if mode == "w" else {}
        with open(tmp, mode.replace("w", "x"), **kw) as f:  # x: never follow a stale name
            yield f


def atomic_write_bytes(path, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_text(path, text: str, encoding: str = "utf-8") -> None:
    with atomic_open(path, "w", encoding) as f:
        f.write(text)
