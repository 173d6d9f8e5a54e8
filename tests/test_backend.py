"""Backend selection: forced backends fail loudly, never fall back silently."""
import subprocess
import sys

import pytest
import torch

from pyfast.ops import BackendUnavailable, resolve, status
from pyfast.ops import quantize


def test_forced_unknown_backend(monkeypatch):
    monkeypatch.setenv("PYFAST_BACKEND", "cuda-magic")
    with pytest.raises(ValueError, match="valid: auto, torch, cpp, triton"):
        quantize.quantize(torch.randn(10), "int8")


def test_forced_triton_without_interpreter_says_why(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendUnavailable, match="TRITON_INTERPRET=1"):
        resolve(torch.device("cpu"), "triton")


def test_triton_on_cuda_is_decided_by_the_device_and_says_why_not(monkeypatch):
    """Triton's status for a CUDA device depends on the device and on triton, never on a GPU
    being present (the layers' GEMM choice is tested without one); another device type, or
    triton missing, is refused with the reason, and forcing it then raises."""
    assert status("triton", torch.device("cuda")) == (True, "")
    assert resolve(torch.device("cuda"), "triton") == "triton"
    ok, why = status("triton", torch.device("meta"))
    assert not ok and "CUDA tensors, not meta" in why, why
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    ok, why = status("triton", torch.device("cuda"))
    assert not ok and why.startswith("triton is not installed"), why
    with pytest.raises(BackendUnavailable, match="backend 'triton' .* triton is not installed"):
        resolve(torch.device("cuda"), "triton")


def test_env_var_forces_reference(monkeypatch):
    monkeypatch.setenv("PYFAST_BACKEND", "torch")
    assert resolve(torch.device("cpu")) == "torch"


def test_auto_prefers_cpp_on_cpu():
    ok, why = status("cpp", torch.device("cpu"))
    if not ok:
        pytest.skip(why)
    assert resolve(torch.device("cpu")) == "cpp"


def test_cpp_missing_is_an_error_when_forced():
    # a fresh interpreter where pyfast._C cannot be imported: forcing cpp must raise, and the
    # automatic choice must warn (not silently use the reference)
    code = """
import sys, warnings, torch
sys.modules['pyfast._C'] = None   # import of pyfast._C now raises ImportError
from pyfast.ops import quantize, BackendUnavailable
try:
    quantize.quantize(torch.randn(8), 'int8', backend='cpp'); print('NO ERROR')
except BackendUnavailable as e:
    print('raised:', e)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter('always')
    quantize.quantize(torch.randn(8), 'int8')
    print('warned:', any('torch reference' in str(x.message) for x in w))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PATH": "", "PYFAST_BACKEND": ""}).stdout
    assert "raised: backend 'cpp' was asked for but cannot run: the C++ extension" in out
    assert "warned: True" in out
