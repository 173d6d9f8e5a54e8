"""`pyfast train`: the main job. With --nproc it starts the ranks through torchrun's own code
(torch.distributed.run); under torchrun (RANK set) it runs this rank's part directly.

    pyfast train --nproc 2 --dp 2 --compress int8 --model gpt-small --steps 100 --out runs/demo
    torchrun --nproc-per-node 4 -m pyfast train --dp 2 --tp 2 --model gpt-tiny ...
    pyfast train --dry-run --nproc 16 --dp 2 --cp 2 --tp 2 --pp 2 --gpu h100   (memory, no GPU)
"""
from __future__ import annotations

import os
import sys

from .config import ConfigError, TrainConfig, from_args, parser

__all__ = ["ConfigError", "TrainConfig", "main"]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ns = parser().parse_args(argv)
    cfg = from_args(ns)
    if ns.dry_run:  # no process is started
        from .dryrun import main as dry_main
        return dry_main(cfg, ns)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # a rank started by torchrun
        if ns.nproc or ns.print_launch:
            print("pyfast train: error: --nproc / --print-launch are for the launching command, "
                  "not for a rank already started by torchrun", file=sys.stderr)
            return 2
        from .run import main as run_rank
        return run_rank(cfg)
    from .launch import launch
    return launch(cfg, ns)


if __name__ == "__main__":
    sys.exit(main())
