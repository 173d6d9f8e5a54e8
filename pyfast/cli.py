"""The `pyfast` command: plan, data, train, ablate, export, info, bench."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn

# `pyfast bench NAME ARGS` runs pyfast.benchmarks.NAME.main(ARGS): each parses its own options
# and ends in pyfast.perf.finish (the table, OUT.json and OUT.txt).
BENCHMARKS = {
    "compress": "every compressor: wire ratio, error, throughput",
    "block_size": "the quantizers' block size: error, scale overhead, throughput",
    "nf4_ops": "nf4 quantize / dequantize (a frozen LoRA base): torch vs C++, bytes vs bf16",
    "allreduce": "compressed all-reduce vs plain gloo, on emulated links",
    "dp": "DataParallel training step vs torch DDP and its hooks",
    "dp_semantics": "what DataParallel's DDP semantics and check_finite cost a step",
    "tp": "tensor-parallel MLP block vs DTensor TP and one process",
    "overlap_tp": "overlapped vs sequential all-gather/reduce-scatter + matmul",
    "adamw": "the C++ AdamW vs torch.optim.AdamW foreach and fused on 10M-500M parameters, "
             "against the memory roof",
    "epilogue": "a fused C++ bias+GELU epilogue vs torch's GEMM + GELU on CPU",
    "pipeline": "pipeline schedules vs torch.distributed.pipelining",
    "hetero_pp": "speed-weighted pipeline stages (--pp-balance) vs the even cut, one rank "
                 "capped at half a CPU: throughput and each stage's bubble",
    "train": "the training job's tokens/s per mesh vs one process and torch-native",
    "zero": "ZeRO stages 1/2/3 vs torch DDP, ZeroRedundancyOptimizer and FSDP2: step, memory",
    "cp": "context parallelism (ring, Ulysses) vs one process: causal attention, memory",
    "plan": "pyfast plan: search speed, the folklore checked (and --part memory/time: the "
            "models against the dry run and measured runs)",
    "plan_memory": "the planner's memory model vs the dry run and vs measured CPU allocations",
    "plan_finetune": "the planner's LoRA/QLoRA memory: 8B-shaped table, torchtune's figures, "
                     "the dry run",
    "plan_offload": "the planner's host offload: the 70B QLoRA on 2 x 24 GB and an 8B full "
                    "fine-tune (device and host bytes), and device vs host against the dry run",
    "plan_time": "the planner's step-time model vs measured pyfast train runs on 3 links",
    "plan_mixed": "the planner on a mixed pair (one rank throttled to half a CPU): predicted vs "
                  "measured step, even and split by speed (--batch-split)",
    "scaling": "measured scaling efficiency of pyfast train at 1, 2, 4 ranks (loopback, 1 Gbit/s) "
               "beside the planner's prediction calibrated here",
    "plan_large": "the planner's 70B / 405B plans on 64 / 512 H100: tokens/s, MFU, memory, "
                  "commands (ZeRO on any mesh, hybrid sharding)",
    "gpu": "issue 37 on a lent GPU: the copy roof, quantizers, top-k, fused linear and attention vs "
           "cuBLAS / flash, the engine's overlap; each part under its own time limit",
    "plan_published": "the planner's GPU tokens/s and memory vs published runs (torchtitan "
                      "8B-405B on 8-512 H100, 64 A100): fitted constants, held-out errors",
    "data": "pyfast data prepare's MB/s (1 vs 2 workers, bytes and BPE), data vs compute per "
            "step, RSS vs corpus size",
    "ft": "pyfast train --ft (torchft): recovery from a killed replica group vs torchrun's "
          "restart from a checkpoint, and the per-step cost when nothing fails",
    "diloco": "DiLoCo / Streaming DiLoCo vs data parallelism on 100 Mbit/s and 1 Gbit/s links: "
              "time to loss, bytes, peak bandwidth, compute utilization",
    "lora": "LoRA vs a full fine-tune of a ~100M Llama on dp2: tokens/s, peak RSS, bytes, "
            "checkpoint size",
    "zero_offload": "ZeRO-2 with the optimizer offloaded to host memory vs without: step "
                    "time (target: <= 15% more), memory",
    "zero_frozen": "ZeRO-3 with a frozen LoRA base sharded as bf16 / int8 / nf4: gathered bytes "
                   "and step time at 1 Gbit/s",
    "qlora_loss": "QLoRA (nf4 / int8 base) vs LoRA: validation loss after N fine-tuning steps "
                  "on a pretrained small Llama",
    "hsdp": "hybrid sharding on 2 emulated nodes (1 Gbit/s between): HSDP + int8 vs full ZeRO-2 "
            "vs DataParallel-bf16, step time and cross-node bytes",
    "ckpt": "a checkpoint every K steps, blocking vs --ckpt-async (DCP async_save) vs none: "
            "the step time each adds (target: async <= 10% of blocking's)",
    "hetero": "two ranks at a 2:1 speed (one capped at half a CPU): --batch-split auto vs the "
              "even split, the best fixed split and the fast rank alone, samples/s",
    "profile_overhead": "what pyfast's named profiler ranges cost a gpt-small dp2 step when "
                        "no profiler runs: with vs without them, side by side",
    "report": "write docs/benchmarks.md from bench/results/ (no benchmark is run)",
}


def _info(args) -> int:
    from pyfast.info import report
    print("\n".join(report()))
    return 0


def _data_prepare(a) -> int:
    import json
    import time

    from pyfast.prepare import prepare
    t0 = time.perf_counter()
    try:
        m = prepare(a.input, a.out, a.tokenizer, a.train_bpe, a.text_field, a.val_fraction,
                    a.workers, a.eos, show=sys.stderr.isatty())
    except (OSError, ValueError) as e:
        print(f"pyfast data prepare: error: {e}", file=sys.stderr)
        return 2
    dt = time.perf_counter() - t0
    print(f"{a.out}: {m['tokenizer']} (vocab {m['vocab_size']:,}, EOS {m['eos_id']}, "
          f"{m['dtype']}); train {m['train']['tokens']:,} tokens in {m['train']['documents']:,} "
          f"documents, val {m['val']['tokens']:,} in {m['val']['documents']:,}; "
          f"{m['text_bytes'] / 2**20:.1f} MB of text in {dt:.1f} s")
    if m["invalid_utf8_documents"]:
        print(f"note: {m['invalid_utf8_documents']} documents were not valid UTF-8 (bad bytes "
              "became U+FFFD)")
    if not m["val"]["tokens"]:
        print("note: no document landed in val (raise --val-fraction): evaluation is skipped")
    if a.json:
        print(json.dumps(m, indent=1))
    return 0


def _data_parser(sub) -> None:
    data = sub.add_parser("data", help="datasets: pyfast data prepare -h").add_subparsers(
        dest="what", required=True)
    p = data.add_parser("prepare", help="tokenize text files or JSONL into memory-mapped token "
                        "shards for pyfast train --data OUT (docs/training.md, Data)")
    p.add_argument("--input", action="append", required=True, metavar="GLOB|FILE|DIR",
                   help="text files (one document each) or .jsonl (one per line); repeatable")
    p.add_argument("--text-field", default="text", help="JSONL: the field holding the text")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", default="bytes", help="bytes (default; EOS 256), a "
                     "tokenizer.json, or a Hugging Face tokenizer folder holding one")
    tok.add_argument("--train-bpe", type=int, default=0, metavar="N",
                     help="train a byte-level BPE of N tokens on the input itself")
    p.add_argument("--eos", default=None, help="the EOS token (default: the folder's "
                   "tokenizer_config.json eos_token, else <|endoftext|>, </s>, ...)")
    p.add_argument("--val-fraction", type=float, default=0.01,
                   help="share of documents to val, by a hash of their ids (default 0.01)")
    p.add_argument("--out", required=True, help="the dataset folder (resumed if unfinished)")
    # default 1: on 2 shared cores, 16 MB of JSONL, one process with the tokenizer's own
    # threads vs 2 processes: BPE 8192 2.57 vs 2.22 and 3.44 vs 3.72 MB/s (two runs: a tie),
    # bytes 45 vs 19 and 109 vs 40 MB/s (spawning the workers costs ~0.3 s); bench data
    p.add_argument("--workers", type=int, default=1, help="processes tokenizing 4 MB units "
                   "(files, JSONL line ranges) in parallel, one thread each; 1 (default): this "
                   "process, with the tokenizer's own threads")
    p.add_argument("--json", action="store_true", help="print the manifest")
    p.set_defaults(fn=_data_prepare)


def leave(code: int) -> NoReturn:
    """Exit now, without the interpreter's teardown: torch's (its modules', its C++ libraries'
    destructors) took 1.9-2.7 s of every `pyfast train` launch on this 2-core VM, after the job
    had ended (a launch of gpt-tiny for 2 steps: 8.6 s, the job done at 6.0). What an exit must
    do is done first: atexit's handlers (multiprocessing's finalizers unlink the launch's
    semaphores; its resource tracker's) and the flush of stdout and stderr. The ranks leave
    the same way (pyfast.train.run.main)."""
    import atexit
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv=None) -> int:
    program = argv is None  # the `pyfast` command itself, not a call from Python
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "train":  # its own parser: pyfast.train.config
        from pyfast.train import main as train
        code = train(argv[1:])
        if program:  # the launcher holds no thread by now (threading.enumerate: main only)
            leave(code)
        return code
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
    _data_parser(sub)
    sub.add_parser("info", help="versions, backends available here (and why not), GPUs"
                   ).set_defaults(fn=_info)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="what", required=True)
    for what, helptext in BENCHMARKS.items():  # parsed by the benchmark module's own main()
        bench.add_parser(what, help=helptext)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
