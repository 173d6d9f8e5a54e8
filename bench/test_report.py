"""docs/benchmarks.md is generated (`pyfast bench report`) and up to date with bench/results/."""
import json
import os

import pytest

from pyfast.benchmarks import report


def test_page_is_up_to_date_with_results():
    with open(report.OUT) as f:
        page = f.read()
    assert page == report.render(), "docs/benchmarks.md is stale: run `pyfast bench report`"


def test_generator_quotes_the_results(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "x.txt").write_text("a recorded table 1.23 ms   \n")
    (results / "x.json").write_text(json.dumps({"machine": "M1", "date": "2026-01-02T03:04:05.6"}))
    tpl = tmp_path / "page.md.in"
    tpl.write_text("# B\n\n{{machines}}\n\n## x\n\ntext\n\n{{recorded:x}}\n")
    page = report.render(str(results), str(tpl))
    assert "| x | M1 | 2026-01-02T03:04:05 |" in page
    assert "a recorded table 1.23 ms\n" in page and "../bench/results/x.json" in page
    (results / "x.txt").unlink()
    with pytest.raises(FileNotFoundError, match="x.txt"):
        report.render(str(results), str(tpl))


def test_command_writes_the_page(tmp_path):
    out = tmp_path / "docs" / "b.md"
    assert report.main(["--out", str(out)]) == 0
    assert out.read_text() == report.render()
    assert not [f for f in os.listdir(out.parent) if f.startswith(".")]  # written atomically


def test_tables_are_computed_from_the_json(tmp_path):
    row = {"world": 2, "spec": "int8", "algorithm": "allgather", "time_s": 0.2734, "link": "1gbit",
           "floor_s": 0.2711, "floor_fraction": 0.99, "vs_none": 3.941, "vs_fp16": 2.0}
    new = {**{k: v for k, v in row.items() if k != "time_s"}, "median_s": 0.5}  # today's key
    (tmp_path / "allreduce.json").write_text(json.dumps({"rows": [row, new, {**row, "link": "loopback"}]}))
    tpl = tmp_path / "t.md.in"
    tpl.write_text("{{table:allreduce_1gbit}}\n")
    lines = report.render(str(tmp_path), str(tpl)).splitlines()
    assert lines[2:] == ["| 2 | int8 | allgather | 273 | 271 | 99% | 3.94x | 2.00x |",
                         "| 2 | int8 | allgather | 500 | 271 | 99% | 3.94x | 2.00x |"]


def test_readme_headline_numbers_are_on_the_page():
    """Every number in the README's headline table is one docs/benchmarks.md states."""
    import re
    root = os.path.dirname(report.OUT)
    with open(os.path.join(root, "..", "README.md")) as f:
        readme = f.read()
    with open(report.OUT) as f:
        page = f.read()
    table = readme.split("## Headline numbers", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[2] for line in table.splitlines() if line.startswith("| ")][1:]
    assert len(rows) >= 5
    for result in rows:
        for number in re.findall(r"\d+\.\d+|\d+", result):
            assert number in page, (number, result)
