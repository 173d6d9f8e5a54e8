"""The `pyfast` command: `python -m pyfast` itself (info, a bad subcommand) in a subprocess;
the benchmark's arguments through the same main() in this process (a subprocess cost ~3 s of
torch import each)."""
import json
import subprocess
import sys

import pytest

from pyfast.cli import main


def run(*args):
    return subprocess.run([sys.executable, "-m", "pyfast", *args], capture_output=True,
                          text=True, timeout=300)


def test_info_lists_versions_backends_and_gpus():
    r = run("info")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "pyfast 0.1.0, torch 2." in out and "triton" in out
    assert "  cpp    cpu" in out and "  triton cuda" in out
    assert "GPU" in out  # either the list or why there is none
    for line in out.splitlines():
        if line.strip().startswith(("cpp", "triton")) and " no " in line:
            assert ":" in line.split(" no ", 1)[1], f"an unavailable backend must say why: {line}"


def test_bench_compress_small(tmp_path, capsys):
    out = tmp_path / "c"
    code = main(["bench", "compress", "--numel", "20000", "--specs", "int8,topk:0.01",
                 "--repeats", "2", "--out", str(out)])
    r = capsys.readouterr()
    assert code == 0, r.err
    res = json.loads((tmp_path / "c.json").read_text())
    rows = [x for x in res["rows"] if "wire_ratio" in x]
    assert {x["spec"] for x in rows} == {"int8", "topk:0.01"}
    int8 = next(x for x in rows if x["spec"] == "int8")
    assert 3.9 < int8["wire_ratio"] < 4.0 and int8["rel_error"] < 0.02
    assert "int8" in r.out


def test_bad_cli_arguments(capsys):
    with pytest.raises(SystemExit) as e:  # argparse's error: exit 2, the problem on stderr
        main(["bench", "compress", "--numel", "0"])
    assert e.value.code == 2 and "--numel must be >= 1" in capsys.readouterr().err
    r = run("nonsense")
    assert r.returncode == 2 and "invalid choice: 'nonsense'" in r.stderr, r.stderr
