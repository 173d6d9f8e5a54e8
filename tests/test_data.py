"""pyfast.data: corpora split by file or tail, and batches that do not depend on the mesh.

The oracle for Batches is the 1-process run: at any dp size, concatenating the ranks' rows in
rank order must give exactly its batch, and a resumed run must replay an uninterrupted one.
Token ids are positions (np.arange) so every row names the window it came from.
"""
import os
import sysconfig
import zlib

import numpy as np
import pytest
import torch

from pyfast.data import Batches, _files, _stdlib_name, is_val_file, load_corpus


def positions(n):
    return np.arange(n, dtype=np.uint16)


def take(b, steps):
    return [b.next() for _ in range(steps)]


def test_windows_are_contiguous_and_y_is_x_shifted():
    tokens, seq, batch = positions(1000), 7, 5
    b = Batches(tokens, batch, seq, seed=3)
    assert b.sequences == 999 // 7
    for x, y in take(b, 10):
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (batch, seq)
        assert torch.equal(y, x + 1)
        assert (x[:, 0] % seq == 0).all()  # stride seq: window j starts at j * seq
        assert torch.equal(x - x[:, :1], torch.arange(seq).expand(batch, seq))
    # shuffle=False walks the windows in order, the last token of window j starting window j+1
    v = Batches(tokens, batch, seq, seed=3, shuffle=False)
    x, y = v.next()
    assert torch.equal(x.flatten(), torch.arange(batch * seq))
    assert y[0, -1] == x[1, 0]


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("n,seq,batch", [(1000, 7, 8), (4099, 16, 12)])  # ragged: leftovers
def test_dp_shards_concatenate_to_the_one_process_batch(dp, n, seq, batch):
    tokens = positions(n)
    one = take(Batches(tokens, batch, seq, seed=11), 40)  # more than one epoch of both corpora
    ranks = [take(Batches(tokens, batch, seq, seed=11, dp_rank=r, dp_size=dp), 40)
             for r in range(dp)]
    for k, (x, y) in enumerate(one):
        xs = [ranks[r][k][0] for r in range(dp)]
        assert all(s.shape == (batch // dp, seq) for s in xs)
        assert torch.equal(torch.cat(xs), x)
        assert torch.equal(torch.cat([ranks[r][k][1] for r in range(dp)]), y)
        starts = torch.cat(xs)[:, 0].tolist()
        assert len(set(starts)) == batch  # disjoint shards


def test_epochs_reshuffle_deterministically_and_differently():
    tokens, seq, batch = positions(2003), 10, 6
    b = Batches(tokens, batch, seq, seed=5)
    per_epoch = b.sequences // batch
    assert (b.sequences, per_epoch) == (200, 33)
    epochs = [torch.cat([x[:, 0] // seq for x, _ in take(b, per_epoch)]) for _ in range(3)]
    for e in epochs:  # each epoch uses distinct windows; 200 % 6 = 2 are left out
        assert len(set(e.tolist())) == per_epoch * batch and e.max() < b.sequences
    assert not torch.equal(epochs[0], epochs[1]) and not torch.equal(epochs[1], epochs[2])
    again = Batches(tokens, batch, seq, seed=5)
    assert torch.equal(torch.cat([x[:, 0] // seq for x, _ in take(again, per_epoch)]), epochs[0])
    other = Batches(tokens, batch, seq, seed=6)
    assert not torch.equal(torch.cat([x[:, 0] // seq for x, _ in take(other, per_epoch)]),
                           epochs[0])


@pytest.mark.parametrize("save_dp,load_dp", [(1, 1), (2, 1), (1, 4), (4, 2)])
@pytest.mark.parametrize("at", [0, 13, 33, 50])  # 33 is an epoch boundary
def test_resume_replays_the_uninterrupted_run(save_dp, load_dp, at):
    tokens, seq, batch = positions(2003), 10, 16
    straight = take(Batches(tokens, batch, seq, seed=9), at + 20)
    saver = Batches(tokens, batch, seq, seed=9, dp_size=save_dp)
    take(saver, at)
    state = saver.state_dict()
    assert state["position"] == saver.position == at
    for r in range(load_dp):
        b = Batches(tokens, batch, seq, seed=9, dp_rank=r, dp_size=load_dp)
        b.load_state_dict(state)
        for k, (x, y) in enumerate(take(b, 20)):
            rows = slice(r * batch // load_dp, (r + 1) * batch // load_dp)
            assert torch.equal(x, straight[at + k][0][rows])
            assert torch.equal(y, straight[at + k][1][rows])
    fresh = Batches(tokens, batch, seq, seed=9)
    fresh.load_state_dict({"position": at})  # a bare position is enough
    assert torch.equal(fresh.next()[0], straight[at][0])


@pytest.mark.parametrize("key,value", [("seq", 11), ("seed", 8), ("tokens", 2004),
                                       ("batch", 8), ("shuffle", False)])
def test_state_from_another_run_is_refused(key, value):
    b = Batches(positions(2003), 16, 10, seed=9)
    state = {**b.state_dict(), key: value}
    with pytest.raises(ValueError, match=f"{key} {value} in the checkpoint, "
                                         f"{b.state_dict()[key]} here"):
        b.load_state_dict(state)


def test_stdlib_corpus_is_split_by_file_by_the_crc_rule():
    c = load_corpus()
    root = sysconfig.get_paths()["stdlib"]
    rels = _files(root, _stdlib_name)
    assert len(rels) > 1000 and rels == sorted(rels)
    assert not any(p in r.split("/") for r in rels for p in ("site-packages", "dist-packages"))
    val = [r for r in rels if zlib.crc32(r.encode()) % 100 < 2]
    assert 0 < len(val) < len(rels) // 20

    def concat(names):
        return b"".join(open(os.path.join(root, r), "rb").read() for r in names)
    # every file's bytes are in exactly one side, in sorted order
    assert c.val.tobytes() == concat(val)
    assert c.train.tobytes() == concat([r for r in rels if r not in set(val)])
    assert c.vocab_size == 256 and c.train.dtype == c.val.dtype == np.uint8
    assert f"{len(rels)} stdlib .py files" in c.source and root in c.source


def test_text_file_splits_its_tail(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 100_000, dtype=np.uint8)
    p = tmp_path / "input.txt"
    p.write_bytes(data.tobytes())
    c = load_corpus(str(p))
    assert c.vocab_size == 256 and len(c.val) == 2000 and str(p) in c.source
    assert np.array_equal(np.concatenate([c.train, c.val]), data)
    small = tmp_path / "small.txt"  # 2% would be 40 bytes: keep one 1024-token window instead
    small.write_bytes(data[:20_000].tobytes())
    assert len(load_corpus(str(small)).val) == 1025


def names(val, count, folder=""):
    """File names whose crc puts them (inside folder) on the given side."""
    return [n for n in (f"f{i}.txt" for i in range(1000)) if is_val_file(folder + n) == val][:count]


def test_folder_splits_by_file_and_skips_hidden(tmp_path):
    picked = names(True, 2, "d/") + names(False, 5, "d/")
    files = {f"d/{n}": os.urandom(300 + i) for i, n in enumerate(picked)}
    files.update({".hidden": b"x" * 50, "d/.git/HEAD": b"y" * 50, "d/.swp": b"z" * 50})
    for rel, data in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    c = load_corpus(str(tmp_path))
    kept = sorted(r for r in files if not any(p.startswith(".") for p in r.split("/")))
    assert c.val.tobytes() == b"".join(files[r] for r in kept if is_val_file(r))
    assert c.train.tobytes() == b"".join(files[r] for r in kept if not is_val_file(r))
    assert "7 files" in c.source and "2 files to val" in c.source


def test_folder_without_a_val_file_falls_back_to_the_tail(tmp_path):
    for n in names(False, 3):
        (tmp_path / n).write_bytes(os.urandom(1000))
    c = load_corpus(str(tmp_path))
    assert (len(c.train), len(c.val)) == (2700, 300) and "last 2%" in c.source


def test_bin_files(tmp_path):
    tokens = np.random.default_rng(1).integers(0, 50257, 10_000).astype(np.uint16)
    tokens[7] = 50256  # GPT-2's top id: vocab 50304, nanoGPT's padded size
    tokens.tofile(tmp_path / "train.bin")
    c = load_corpus(str(tmp_path / "train.bin"))  # no val.bin yet: tail
    assert isinstance(c.train, np.memmap) and c.train.dtype == np.uint16
    assert c.vocab_size == 50304 and len(c.val) == 1000
    assert np.array_equal(np.concatenate([c.train, c.val]), tokens)
    val = np.arange(0, 130, dtype=np.uint16)
    val.tofile(tmp_path / "val.bin")
    c = load_corpus(str(tmp_path / "train.bin"))
    assert np.array_equal(c.train, tokens) and np.array_equal(c.val, val)
    assert "val.bin" in c.source
    x, y = Batches(c.train, 4, 8, seed=0).next()
    assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
    for top, vocab in [(126, 128), (127, 128), (128, 256)]:
        np.array([0, top] * 10, dtype=np.uint16).tofile(tmp_path / "small.bin")
        assert load_corpus(str(tmp_path / "small.bin")).vocab_size == vocab


def test_corpus_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_corpus(str(missing))
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty.*empty.txt"):
        load_corpus(str(tmp_path / "empty.txt"))
    (tmp_path / "none").mkdir()
    with pytest.raises(ValueError, match="empty corpus: no files under .*none"):
        load_corpus(str(tmp_path / "none"))
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a").write_bytes(b"")
    with pytest.raises(ValueError, match="all empty"):
        load_corpus(str(tmp_path / "blank"))
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(ValueError, match="odd.bin has 3 bytes, an odd number"):
        load_corpus(str(tmp_path / "odd.bin"))
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="empty corpus: .*empty.bin"):
        load_corpus(str(tmp_path / "empty.bin"))


def test_batch_errors_name_the_numbers():
    tokens = positions(100)
    with pytest.raises(ValueError, match="global batch 6 does not divide over dp_size 4"):
        Batches(tokens, 6, 4, seed=0, dp_size=4)
    with pytest.raises(ValueError, match=r"batch \(0\) and seq \(4\)"):
        Batches(tokens, 0, 4, seed=0)
    with pytest.raises(ValueError, match=r"batch \(2\) and seq \(0\)"):
        Batches(tokens, 2, 0, seed=0)
    with pytest.raises(ValueError, match="100 tokens at seq 10 make 9 sequences, fewer than "
                                         "one global batch of 10"):
        Batches(tokens, 10, 10, seed=0)
    with pytest.raises(ValueError, match="dp_rank 2"):
        Batches(tokens, 4, 4, seed=0, dp_rank=2, dp_size=2)
