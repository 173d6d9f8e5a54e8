"""`import pyfast` alone is enough, and cheap: the layers load on first touch (PEP 562)."""
import json
import subprocess
import sys

import pytest

PROBE = r"""
import json, sys
import pyfast
loaded = lambda: sorted(m for m in sys.modules if m == "torch" or m.startswith("pyfast."))
out = {"bare": loaded()}
out["int8"] = repr(pyfast.compress.get("int8"))
out["after_compress"] = loaded()
out["names"] = [hasattr(pyfast.comm, "all_reduce"), hasattr(pyfast.parallel, "DataParallel"),
                hasattr(pyfast.hooks, "compression_hook"), "parallel" in dir(pyfast)]
out["after_all"] = loaded()
try:
    pyfast.no_such_thing
except AttributeError as e:
    out["missing"] = str(e)
print(json.dumps(out))
"""


def _run(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_import_is_lazy_and_attributes_work():
    out = json.loads(_run(PROBE))
    assert out["bare"] == [], f"import pyfast loaded {out['bare']}"
    assert out["int8"] == "pyfast.compress.get('int8')"
    assert "pyfast.compress" in out["after_compress"] and "torch" in out["after_compress"]
    assert "pyfast.parallel" not in out["after_compress"], "compress must not pull in parallel"
    assert out["names"] == [True, True, True, True]
    assert {"pyfast.comm", "pyfast.parallel", "pyfast.hooks"} <= set(out["after_all"])
    assert "no_such_thing" in out["missing"]


def test_extension_loads_without_torch_imported_first():
    pytest.importorskip("pyfast._C")
    assert "ok" in _run("from pyfast import _C; import torch; "
                        "assert hasattr(torch.ops.pyfast, 'quantize'); print('ok')")
