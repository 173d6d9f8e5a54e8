"""TernGrad's ternary codes (Wen et al., NeurIPS 2017): 2 bits per element, one fp32 scale per
block. The kernel is csrc/ternary.cpp (CPU); `*_ref` here is the torch reference it equals bit
for bit (tests/test_ternary.py). No Triton kernel: CUDA tensors take the reference.

Format, per block of B elements (B a multiple of 4): s = max |x| in fp32, NaN if the block
holds a NaN or an Inf. Element i codes to sign(x_i) with probability |x_i| / s: it is sent when
u_i < |x_i| / s (fp32 division), u_i the stochastic quantizers' shared uniform
(ops/quantize.uniform_ref: the seed and the element's index in x, nothing else), so E[y] = x.
Codes 0 -> 0, 1 -> +1, 2 -> -1, four per byte (element 4j + k in bits 2k, 2k + 1 of byte j).
Decode: y = c * s in fp32 (a NaN scale decodes to NaN throughout), rounded once to the dtype.
"""
from __future__ import annotations


import torch

from pyfast.ops._backend import resolve_cpu_op
from pyfast.ops.quantize import absmax_scales, uniform_ref

DEFAULT_BLOCK = 512
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def codes_len(n: int) -> int:
    return -(-n // 4)


def check_block(block: int) -> None:
    if not (isinstance(block, int) and block >= 4 and block % 4 == 0):
        raise ValueError(f"ternary block must be a positive multiple of 4, got {block!r}")


def _per_element(scales: torch.Tensor, n: int, block: int) -> torch.Tensor:
    return scales.repeat_interleave(block)[:n]


def encode_ref(x: torch.Tensor, block: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8[ceil(n/4)], scales fp32[ceil(n/block)])."""
    r = x.reshape(-1).to(torch.float32)
    n, a = r.numel(), r.abs()
    scales, s = absmax_scales(a, block)
    take = uniform_ref(seed, 0, n, x.device) < a / s
    code = torch.where(take, torch.where(r < 0, 2, 1), 0).to(torch.int32)
    quads = code.new_zeros(codes_len(n) * 4)
    quads[:n] = code
    quads = quads.view(-1, 4)
    codes = quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)
    return codes.to(torch.uint8), scales


def decode_ref(codes: torch.Tensor, scales: torch.Tensor, n: int, block: int,
               dtype: torch.dtype) -> torch.Tensor:
    c = codes.to(torch.int32)
    quads = torch.stack([(c >> s) & 3 for s in (0, 2, 4, 6)], 1).reshape(-1)[:n]
    sign = torch.where(quads == 1, 1.0, torch.where(quads == 2, -1.0, 0.0)).to(torch.float32)
    return (sign * _per_element(scales, n, block)).to(dtype)


def _backend(device: torch.device, backend: str | None) -> str:
    """cpp on CPU; the reference elsewhere (no Triton kernel). A backend asked for by name
    (argument or PYFAST_BACKEND) that has no ternary kernel raises: no silent fallback."""
    return resolve_cpu_op(device, backend, "ternary", "ternary_encode", "ternary.cpp",
                          ("cpu", "meta", "cuda"))


def encode(x: torch.Tensor, block: int = DEFAULT_BLOCK, seed: int = 0,
           backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    check_block(block)
    if x.dtype not in FLOATS:
        raise TypeError(f"ternary takes float32, bfloat16 or float16 tensors, got {x.dtype}")
    if x.numel() >= 2 ** 32:
        raise ValueError(f"ternary: the shared uniform is indexed by uint32, {x.numel()} "
                         "elements is too many")
    if _backend(x.device, backend) == "cpp":
        return torch.ops.pyfast.ternary_encode(x.reshape(-1), block, seed)
    return encode_ref(x, block, seed)


def decode(codes: torch.Tensor, scales: torch.Tensor, n: int, block: int = DEFAULT_BLOCK,
           dtype: torch.dtype = torch.float32, backend: str | None = None) -> torch.Tensor:
    check_block(block)
    if _backend(codes.device, backend) == "cpp":
        return torch.ops.pyfast.ternary_decode(codes, scales, n, block, dtype)
    return decode_ref(codes, scales, n, block, dtype)
