"""Relative L2 error of the 4- and 8-bit outer-gradient formats on a real DiLoCo pseudo-gradient
(global - local): gpt-tiny (256-byte vocabulary, sequence 64) trained from its initialization
with AdamW (lr 1e-3, batches of 8 x 64 bytes of pyfast's own source) for H steps. What
docs/diloco.md quotes (bench/results/pseudo_grad_error.txt).

    PYTHONPATH=$PWD .venv/bin/python tools/pseudo_grad_error.py
"""
import pathlib

import torch
import torch.nn.functional as F

import pyfast.compress as C
from pyfast import models

SPECS = ("int8", "fp8", "int4", "e3m0")


def main(checkpoints=(10, 50)):
    torch.manual_seed(0)
    m = models.build("gpt-tiny", 256, 64)
    src = pathlib.Path(__file__).resolve().parents[1] / "pyfast" / "parallel" / "diloco.py"
    text = torch.tensor(list(src.read_bytes()[:20000]))
    init = torch.cat([p.detach().reshape(-1).clone() for p in m.parameters()])
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    for step in range(1, max(checkpoints) + 1):
        starts = torch.randint(0, text.numel() - 65, (8,), generator=g).tolist()
        x = torch.stack([text[j:j + 65] for j in starts])
        loss = F.cross_entropy(m(x[:, :-1]).reshape(-1, 256), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step in checkpoints:
            d = init - torch.cat([p.detach().reshape(-1) for p in m.parameters()])
            errs = []
            for spec in SPECS:
                c = C.get(spec)
                p = c.compress(d)
                y = c.decompress(p)
                errs.append(f"{spec} {((y - d).norm() / d.norm()).item():.3f} "
                            f"({8 * p.nbytes / d.numel():.2f} bits)")
            print(f"H={step}, {d.numel()} elements: " + ", ".join(errs))


if __name__ == "__main__":
    main()
