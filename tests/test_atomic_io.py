"""Files the package writes appear whole or not at all; temporary directories are removed."""
import os
from pathlib import Path

import pytest

from pyfast import _io


class Boom(Exception):
    pass


def _only(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


@pytest.mark.parametrize("interrupt", [Boom, KeyboardInterrupt])
def test_interrupted_write_keeps_old_file_and_no_temp(tmp_path, interrupt):
    f = tmp_path / "result.json"
    f.write_text("old")
    with pytest.raises(interrupt):
        with _io.atomic_open(f) as out:
            out.write("new, half of it")
            out.flush()
            raise interrupt()
    assert f.read_text() == "old" and _only(tmp_path) == ["result.json"]
    _io.atomic_write_text(f, "new")
    assert f.read_text() == "new" and _only(tmp_path) == ["result.json"]
    _io.atomic_write_bytes(tmp_path / "b.bin", b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"


def test_atomic_path_keeps_extension_and_cleans_up(tmp_path):
    target = tmp_path / "plot.png"
    target.write_bytes(b"old png")
    with pytest.raises(Boom):
        with _io.atomic_path(target) as tmp:
            assert tmp.endswith(".png") and os.path.dirname(tmp) == str(tmp_path)
            Path(tmp).write_bytes(b"half")
            raise Boom()
    assert target.read_bytes() == b"old png" and _only(tmp_path) == ["plot.png"]
    with _io.atomic_path(target) as tmp:
        Path(tmp).write_bytes(b"new png")
    assert target.read_bytes() == b"new png" and _only(tmp_path) == ["plot.png"]


def test_atomic_file_gets_normal_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        _io.atomic_write_text(tmp_path / "r.txt", "x")
    finally:
        os.umask(old)
    assert (tmp_path / "r.txt").stat().st_mode & 0o777 == 0o644  # not mkstemp's 0600


def test_metrics_plot_interrupted(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from pyfast.train import metrics
    recs = [{"step": s, "loss": 3.0 - s / 10, "tokens_per_s": 1000.0} for s in range(1, 5)]
    png = tmp_path / "curves.png"
    png.write_bytes(b"previous plot")

    def half_then_fail(self, fname, **kw):
        Path(fname).write_bytes(b"\x89PNG half")
        raise Boom()

    monkeypatch.setattr(Figure, "savefig", half_then_fail)
    with pytest.raises(Boom):
        metrics.plot(recs, png)
    assert png.read_bytes() == b"previous plot" and _only(tmp_path) == ["curves.png"]
    monkeypatch.undo()
    metrics.plot(recs, png)
    assert png.read_bytes()[:4] == b"\x89PNG" and _only(tmp_path) == ["curves.png"]


def test_metrics_log_rewrite_interrupted(tmp_path, monkeypatch):
    from pyfast.train import metrics
    log = metrics.MetricsLog(tmp_path, None)
    for s in (1, 2, 3):
        log.write({"step": s, "loss": 1.0})
    log.close()
    before = (tmp_path / "metrics.jsonl").read_text()

    def dies(src, dst):  # killed between writing the new version and committing it
        raise Boom()

    monkeypatch.setattr(os, "replace", dies)
    with pytest.raises(Boom):
        metrics.MetricsLog(tmp_path, resume_step=2)
    monkeypatch.undo()
    assert (tmp_path / "metrics.jsonl").read_text() == before
    assert _only(tmp_path) == ["metrics.jsonl"]


def test_pipeline_bench_save_interrupted(tmp_path, monkeypatch):
    from pyfast.benchmarks import pipeline
    out = str(tmp_path / "pipeline")
    Path(out + ".json").write_text("{}")
    Path(out + ".txt").write_text("old table")

    def bad_table(result):
        raise Boom()

    monkeypatch.setattr(pipeline, "table", bad_table)
    with pytest.raises(Boom):
        pipeline.save({"runs": []}, out)
    assert Path(out + ".txt").read_text() == "old table"
    assert _only(tmp_path) == ["pipeline.json", "pipeline.txt"]


def test_compress_bench_save(tmp_path):
    from pyfast.benchmarks import compress
    res = compress.run(4096, ["int8"], repeats=1)
    out = str(tmp_path / "sub" / "compress")
    compress.save(res, out)
    assert _only(tmp_path / "sub") == ["compress.json", "compress.txt"]


def test_epilogue_build_directory_is_removed(monkeypatch):
    from pyfast.benchmarks import epilogue
    seen = []

    def fake_load_inline(name, src, build_directory, **kw):
        seen.append(build_directory)
        assert os.path.isdir(build_directory)
        (Path(build_directory) / "built.so").write_bytes(b"")
        return "ext"

    monkeypatch.setattr(epilogue, "load_inline", fake_load_inline)
    assert epilogue.build() == "ext"
    assert seen and not os.path.exists(seen[0])
