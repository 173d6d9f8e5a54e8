"""The `pyfast` command: plan, train, ablate, export, info, bench."""
from __future__ import annotations

import argparse
import importlib
import sys

# `pyfast bench NAME ARGS` runs pyfast.benchmarks.NAME.main(ARGS): each parses its own options
# and ends in pyfast.perf.finish (the table, OUT.json and OUT.txt).
BENCHMARKS = {
    "compress": "every compressor: wire ratio, error, throughput",
    "block_size": "the quantizers' block size: error, scale overhead, throughput",
    "allreduce": "compressed all-reduce vs plain gloo, on emulated links",
    "dp": "DataParallel training step vs torch DDP and its hooks",
    "dp_semantics": "what DataParallel's DDP semantics and check_finite cost a step",
    "tp": "tensor-parallel MLP block vs DTensor TP and one process",
    "overlap_tp": "overlapped vs sequential all-gather/reduce-scatter + matmul",
    "epilogue": "a fused C++ bias+GELU epilogue vs torch's GEMM + GELU on CPU",
    "pipeline": "pipeline schedules vs torch.distributed.pipelining",
    "train": "the training job's tokens/s per mesh vs one process and torch-native",
    "zero": "ZeRO stages 1/2/3 vs torch DDP, ZeroRedundancyOptimizer and FSDP2: step, memory",
    "cp": "context parallelism (ring, Ulysses) vs one process: causal attention, memory",
    "plan": "pyfast plan: search speed, the folklore checked (and --part memory/time: the "
            "models against the dry run and measured runs)",
    "plan_memory": "the planner's memory model vs the dry run and vs measured CPU allocations",
    "plan_time": "the planner's step-time model vs measured pyfast train runs on 3 links",
    "diloco": "DiLoCo / Streaming DiLoCo vs data parallelism on 100 Mbit/s and 1 Gbit/s links: "
              "time to loss, bytes, peak bandwidth, compute utilization",
    "report": "write docs/benchmarks.md from bench/results/ (no benchmark is run)",
}


def _info(args) -> int:
    from pyfast.info import report
    print("\n".join(report()))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "train":  # its own parser: pyfast.train.config
        from pyfast.train import main as train
        return train(argv[1:])
    if argv and argv[0] == "plan":  # its own parser: pyfast.plan.cli
        from pyfast.plan import main as plan
        return plan(argv[1:])
    if argv and argv[0] == "ablate":  # its own parser: pyfast.ablate.config
        from pyfast.ablate import main as ablate
        return ablate(argv[1:])
    if argv and argv[0] == "export":  # its own parser: pyfast.export
        from pyfast.export import main as export
        return export(argv[1:])
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCHMARKS:
        return importlib.import_module(f"pyfast.benchmarks.{argv[1]}").main(argv[2:])
    p = argparse.ArgumentParser(prog="pyfast", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("plan", help="which dp x cp x tp x pp, ZeRO, compressor, micro-batching for "
                   "a model on a cluster: predicted memory and step time, the best's `pyfast "
                   "train` command (pyfast plan -h)")
    sub.add_parser("train", help="train a model on a dp x cp x tp x pp mesh (pyfast train -h)")
    sub.add_parser("ablate", help="compression ablations: time to a target loss per compressor "
                   "and link, vs bf16 (pyfast ablate -h)")
    sub.add_parser("export", help="a run's checkpoint (any mesh, any ZeRO stage) as a Hugging "
                   "Face save_pretrained directory (pyfast export -h)")
    sub.add_parser("info", help="versions, backends available here (and why not), GPUs"
                   ).set_defaults(fn=_info)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="what", required=True)
    for what, helptext in BENCHMARKS.items():  # parsed by the benchmark module's own main()
        bench.add_parser(what, help=helptext)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
