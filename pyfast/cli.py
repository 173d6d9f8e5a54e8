"""The `pyfast` command: train, info, bench."""
from __future__ import annotations

import argparse
import sys


def _info(args) -> int:
    from pyfast.info import report
    print("\n".join(report()))
    return 0


def _bench_compress(args) -> int:
    from rich.console import Console

    from pyfast.benchmarks import compress
    specs = args.specs.split(",") if args.specs else compress.SPECS
    result = compress.run(args.numel, specs, args.repeats)
    Console(width=160).print(compress.table(result))
    if args.out:
        compress.save(result, args.out)
        print(f"wrote {args.out}.json and {args.out}.txt")
    return 0


DELEGATED = {"allreduce": "compressed all-reduce vs plain gloo, on emulated links",
             "dp": "DataParallel training step vs torch DDP and its hooks",
             "pipeline": "pipeline schedules vs torch.distributed.pipelining",
             "tp": "tensor-parallel MLP block vs DTensor TP and one process",
             "train": "the training job's tokens/s per mesh vs one process and torch-native"}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "train":  # its own parser: pyfast.train.config
        from pyfast.train import main as train
        return train(argv[1:])
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in DELEGATED:
        import importlib
        return importlib.import_module(f"pyfast.benchmarks.{argv[1]}").main(argv[2:])
    p = argparse.ArgumentParser(prog="pyfast", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("train", help="train a model on a dp x tp x pp mesh (pyfast train -h)")
    sub.add_parser("info", help="versions, backends available here (and why not), GPUs"
                   ).set_defaults(fn=_info)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="what", required=True)
    bc = bench.add_parser("compress", help="every compressor: wire ratio, error, throughput")
    bc.add_argument("--numel", type=int, default=1 << 24, help="elements (default 16M)")
    bc.add_argument("--specs", default="", help="comma-separated specs (default: all)")
    bc.add_argument("--repeats", type=int, default=5)
    bc.add_argument("--out", default="", help="write OUT.json and OUT.txt")
    bc.set_defaults(fn=_bench_compress)
    for what, helptext in DELEGATED.items():  # parsed by the benchmark module's own main()
        bench.add_parser(what, help=helptext)
    args = p.parse_args(argv)
    if getattr(args, "numel", 1) < 1:
        p.error("--numel must be >= 1")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
