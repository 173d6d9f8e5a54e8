#!/usr/bin/env bash
# Why the native engine's CPU jobs die on the lent GPU machine (tests/test_engine.py: every
# rank SIGSEGV at 2 and 4 gloo ranks, 2026-11-26) while its CUDA jobs pass: which OpenMP and C++
# runtimes _C.so resolves, the smoke run plain, with one OpenMP thread, and rank 0 under cuda-gdb.
set -u
PY=${PY:-python3}
echo "== ldd"; ldd pyfast/_C*.so | grep -E "gomp|stdc|gcc_s|torch_cpu"
echo "== torch/lib"; ls "$($PY -c 'import torch, os; print(os.path.dirname(torch.__file__))')/lib" | grep -i -E "gomp|stdc"
echo "== plain"
PYTHONFAULTHANDLER=1 timeout 40 $PY tools/engine_cpu_smoke.py 1 2 29531 & PYTHONFAULTHANDLER=1 timeout 40 $PY tools/engine_cpu_smoke.py 0 2 29531; echo "rank 0 rc=$?"; wait
echo "== OMP_NUM_THREADS=1"
OMP_NUM_THREADS=1 timeout 40 $PY tools/engine_cpu_smoke.py 1 2 29533 & OMP_NUM_THREADS=1 timeout 40 $PY tools/engine_cpu_smoke.py 0 2 29533; echo "rank 0 rc=$?"; wait
echo "== cuda-gdb, rank 0"
timeout 90 $PY tools/engine_cpu_smoke.py 1 2 29532 > /tmp/r1.txt 2>&1 &
timeout 80 cuda-gdb -q -batch -ex "set pagination off" -ex run -ex bt -ex "info threads" -ex "info sharedlibrary" \
  --args $PY tools/engine_cpu_smoke.py 0 2 29532 > /tmp/gdb.txt 2>&1
grep -v -E "^\[(New )?Thread|^0x[0-9a-f]+ +0x[0-9a-f]+ +Yes" /tmp/gdb.txt | head -120
grep -E "gomp|stdc\+\+|_C\.cpython" /tmp/gdb.txt | head -10
wait; tail -3 /tmp/r1.txt
