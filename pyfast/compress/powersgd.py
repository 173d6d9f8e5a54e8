"""powersgd:RANK: rank-RANK approximation by one power iteration (Vogels et al., NeurIPS 2019).

For a matrix M (a tensor of ndim >= 2 viewed as shape[0] x rest): P = M Q, orthonormalize P,
Q = M^T P; the wire carries P and Q, and M ~ P Q^T. With warm start, Q is kept per name and
the iteration continues across steps. Vectors, and matrices where r(m + n) >= mn, pass
uncompressed. The state (the Q per name) is checkpointable with state_dict().

Bound: y = P P^T M projects M's columns onto span(P), so ||y - x||_F <= ||x||_F (1 + 1e-4)
(fp32 arithmetic, + 2^-120 sqrt(n)) for finite x with ||x||_F below half its dtype's max and
2^100 (beyond, entries can overflow to Inf); tensors sent uncompressed are exact. NaN/Inf in
x are never finite in y at their positions (tests/test_compress_props.py).
"""
from __future__ import annotations

import torch

from pyfast.compress.base import Compressor, Payload, check_float, check_out, derive_seed, fill, flat


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    # Householder QR: stable and defined for rank-deficient P (Gram-Schmidt divides by 0)
    return torch.linalg.qr(p, mode="reduced").Q


class PowerSGD(Compressor):
    algorithm, per_tensor = "powersgd", True
    def __init__(self, rank: int, warm_start: bool = True, seed: int = 0):
        self.rank, self.warm_start, self.seed = rank, warm_start, seed
        self.spec = f"powersgd:{rank}"
        self.q: dict[str, torch.Tensor] = {}

    def _initial_q(self, name: str, n: int, r: int, device) -> torch.Tensor:
        q = self.q.get(name)
        if q is not None and q.shape == (n, r):
            return q.to(device)
        # a CPU generator whatever the device: the same start on every rank and device type
        g = torch.Generator(device="cpu").manual_seed(derive_seed(self.seed, name, 0))
        return torch.randn(n, r, generator=g, device="cpu").to(device)

    def p_step(self, m: torch.Tensor, name: str) -> torch.Tensor:
        """P = M Q: the first half, whose sum across ranks is all-reduced before q_step."""
        r = min(self.rank, *m.shape)
        return m @ self._initial_q(name, m.shape[1], r, m.device)

    def q_step(self, m: torch.Tensor, p: torch.Tensor, name: str) -> torch.Tensor:
        """Q = M^T orthonormalize(P); p is orthonormalized in place."""
        p.copy_(orthonormalize(p))
        q = (p.t() @ m).t()  # 6 ms vs 95 ms for m.t() @ p (4096 x 4096, one thread)
        if self.warm_start:
            self.q[name] = q.detach().clone()
        return q

    def compressible(self, x: torch.Tensor) -> bool:
        if x.dim() < 2:
            return False
        m, n = x.shape[0], x.numel() // max(1, x.shape[0])
        return min(self.rank, m, n) * (m + n) < m * n

    def compress(self, x, name=""):
        check_float(x, self.spec)
        if not self.compressible(x):
            return Payload({"data": x.reshape(-1)}, x.shape, x.dtype)
        m = x.reshape(x.shape[0], -1).to(torch.float32)
        p = self.p_step(m, name)
        q = self.q_step(m, p, name)
        return Payload({"p": p, "q": q}, x.shape, x.dtype)

    def decompress(self, p, out=None):
        if out is not None:
            check_out(p, out)
        if "data" in p.tensors:
            return fill(out, p.tensors["data"].view(p.shape))
        pm, qm = p.tensors["p"], p.tensors["q"]
        into = flat(out) if out is not None else None
        if into is not None and p.dtype == torch.float32:  # the product straight into out
            torch.mm(pm, qm.t(), out=into.view(pm.shape[0], qm.shape[0]))
            return out
        return fill(out, (pm @ qm.t()).to(p.dtype).view(p.shape))

    def state_dict(self):
        return {"q": {k: v.clone() for k, v in self.q.items()}}

    def load_state_dict(self, state):
        self.q = {str(k): v.clone() for k, v in state.get("q", {}).items()}
