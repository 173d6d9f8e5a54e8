#!/usr/bin/env bash
# What only a GPU shows, in one pass on a lent GPU machine (the device tool's `run`; results
# under $OUT, default ./gpu_check): pyfast._C built with its CUDA kernels and engine, the
# CUDA kernels (C++ and compiled Triton) against the torch reference, NCCL on a world of one,
# compressor throughput on the GPU, and `pyfast train` on CUDA. Each step has its own time
# limit and the script goes on after a failure: one lease, everything it can show.
set -u
OUT=${OUT:-gpu_check}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYFAST_TEST_GPU=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
PY=${PY:-python3}
# setup.py maps kernels/ to pyfast.kernels (an install does that); run from the tree instead
[ -e pyfast/kernels ] || ln -s ../kernels pyfast/kernels
log() { echo "== $(date +%T) $*" | tee -a "$OUT/steps.log"; }
# STEPS="build nccl dpddp" runs only those steps (a second lease need not redo what the first showed)
want() { [ -z "${STEPS:-}" ] || [[ " $STEPS " == *" $1 "* ]]; }
step() { local name=$1 limit=$2; shift 2; want "$name" || return 0; log "$name (limit ${limit}s)"; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; local rc=$?
  log "$name: rc=$rc in $((SECONDS - t0))s"; tail -n 25 "$OUT/$name.txt"; }

log "machine"; { nvidia-smi -L; nproc; $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"; } 2>&1 | tee -a "$OUT/steps.log"
step build 180 env MAX_JOBS=16 $PY setup.py build_ext --inplace
$PY -c "import torch, pyfast._C as C; print('cuda kernels', torch._C._dispatch_has_kernel_for_dispatch_key('pyfast::quantize', 'CUDA'), 'cuda engine', bool(C.Engine.cuda_enabled))" 2>&1 | tee -a "$OUT/steps.log"
step kernels 120 $PY -m pytest -q -p no:cacheprovider -n 8 -rs tests/test_gpu_kernels.py tests/test_gpu_nccl.py -k "not linear"
step nccl 90 $PY -m pytest -q -p no:cacheprovider -rs tests/test_gpu_nccl.py
step engine 90 $PY -m pytest -q -p no:cacheprovider -rs tests/test_engine.py tests/test_engine_sharded.py
step dpddp 150 $PY tools/gpu_dp_vs_ddp.py --device cuda --batches 2,8 --rounds 7 --steps 20 --json "$OUT/dp_vs_ddp.json"
step dpddp2 150 $PY tools/gpu_dp_vs_ddp.py --device cuda --batches 2,8 --rounds 7 --steps 20 --json "$OUT/dp_vs_ddp_b.json"
step enginediag 150 bash tools/gpu_engine_diag.sh
step compress 60 $PY -m pyfast bench compress --device cuda --numel 67108864 --repeats 7 --out "$OUT/compress_cuda"
# issue 37, at the roof (pyfast/benchmarks/gpu.py: each part under its own limit, 435 s at most;
# STEPS="build kernels benchgpu" is the <= 9-minute run: the build took 28 s and the kernel
# tests 38 s on the H200 lent 2026-11-25)
step benchgpu 450 $PY -m pyfast bench gpu --out "$OUT/bench_gpu"
step train 90 bash -c "for p in fp32 bf16; do $PY -m pyfast train --nproc 1 --model gpt-small --steps 40 --batch 16 --seq 256 --precision \$p --eval-every 0 --out /tmp/run_\$p || exit; grep -h tokens_per_s /tmp/run_\$p/metrics.jsonl | tail -3; done"
step triton 170 $PY -m pytest -q -p no:cacheprovider -n 8 -rs tests/test_gpu_kernels.py::test_triton_linear_on_cuda tests/test_attention_triton.py
log "done"
