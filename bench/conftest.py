import os

NUMEL = int(os.environ.get("PYFAST_BENCH_NUMEL", 1 << 24))  # 16M fp32 = 64 MB, past every cache
