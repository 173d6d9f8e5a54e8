"""`pyfast ablate`: compression ablations. Which compressor (with or without error feedback, at
which bucket size) reaches a target loss soonest on which link and world size, judged against
the 16-bit (bf16) reduction, with the cost model's prediction beside every measurement.

    pyfast ablate --task gpt-tiny --links loopback,1gbit,100mbit --out runs/ablate
    pyfast ablate --config ablate.toml --resume

DIR/results.csv (one row per cell, pyfast.ablate.schema), DIR/cells/<cell>.jsonl (each step),
DIR/report.md and the PNGs beside it (pyfast.ablate.report).
"""
from __future__ import annotations

import sys

from .config import AblateConfig, AblateError, cells, from_args

__all__ = ["AblateConfig", "AblateError", "cells", "main", "run"]


def run(cfg: AblateConfig) -> str:
    from .runner import run as _run
    return _run(cfg)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        cfg = from_args(argv)
        out = run(cfg)
    except AblateError as e:
        print(f"pyfast ablate: error: {e}", file=sys.stderr)
        return 2
    print(f"results: {out}/results.csv\nreport: {out}/report.md")
    return 0
