# Quickstart: `make demo` and `make test` (each sets everything up first).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
# A machine without an NVIDIA driver gets the CPU build of torch (pip takes 2.13.0 from a
# local wheel here); with one, the default (CUDA) build.
TORCH   ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
DEPS    := rich numpy triton nvidia-ml-py pytest pytest-benchmark pytest-xdist expecttest \
           matplotlib transformers tokenizers safetensors tensorboard hypothesis peft torchft \
           setproctitle
NVCC    ?= $(shell command -v nvcc 2>/dev/null)
STAMP   := $(VENV)/.pyfast-installed
SRC     := setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*.h csrc/cuda/*.cu csrc/cuda/*.cuh)

.PHONY: setup install demo test bench ablate cuda-check clean
setup: $(STAMP)

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel ninja

$(VENV)/.deps: | $(BIN)/python
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q $(DEPS)
	touch $@

# --no-build-isolation: the extension builds against the torch already in the venv
# (isolation would fetch another, multi-GB CUDA torch).
$(STAMP): $(VENV)/.deps $(SRC)
	MAX_JOBS=2 $(BIN)/pip install -q --no-build-isolation -e .
	touch $@

install: $(STAMP)

# The main job: gpt-small (10.8M parameters) on 2 local ranks with int8-compressed gradients,
# ~2 minutes on 2 cores (90 steps of 8 x 256 bytes at ~1.2 s); then one short benchmark.
DEMO    := runs/demo
demo: $(STAMP)
	$(BIN)/pyfast info
	rm -rf $(DEMO)
	$(BIN)/pyfast train --nproc 2 --dp 2 --compress int8 --model gpt-small --steps 90 \
	    --batch 8 --seq 256 --eval-every 15 --ckpt-every 30 --out $(DEMO)
	$(BIN)/pyfast bench allreduce --world 2 --link 1gbit --repeats 3

# The benchmark suites run once, untimed and small, so they cannot rot.
# TEST_WORKERS pytest processes (pytest-xdist), each running whole files (a file's module
# RankPools stay in one worker; session-wide shared runs are made once per worker): one left
# 37% of the 2 cores idle (ranks waiting on each other, timeouts, launches); tests/ took
# 324-346 s with 2 against 453-475 s with 1, here.
TEST_WORKERS ?= 2
XDIST   = $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)
test: $(STAMP)
	$(BIN)/python -m pytest -q $(XDIST) tests --durations=20
	PYFAST_BENCH_NUMEL=65536 $(BIN)/python -m pytest -q $(XDIST) bench --benchmark-disable \
	    --durations=10

# The numbers docs/benchmarks.md quotes (each writes bench/results/NAME.json and .txt; the
# last step regenerates docs/benchmarks.md from them).
bench: $(STAMP)
	$(BIN)/pyfast bench compress --out bench/results/compress
	$(BIN)/pyfast bench adamw --out bench/results/adamw
	$(BIN)/pyfast bench allreduce --out bench/results/allreduce
	$(BIN)/pyfast bench dp --out bench/results/dp
	$(BIN)/pyfast bench dp_semantics --out bench/results/dp_semantics
	$(BIN)/pyfast bench pipeline --trace bench/results/pipeline_trace --out bench/results/pipeline
	$(BIN)/pyfast bench tp --out bench/results/tp
	$(BIN)/pyfast bench overlap_tp --out bench/results/overlap_tp
	$(BIN)/pyfast bench train --out bench/results/train
	$(BIN)/pyfast bench train --batch 2 --out bench/results/train_b2
	$(BIN)/pyfast bench epilogue --out bench/results/epilogue
	$(BIN)/pyfast bench block_size --out bench/results/block_size
	$(BIN)/pyfast bench zero --out bench/results/zero
	$(BIN)/pyfast bench cp --out bench/results/cp
	$(BIN)/pyfast bench hsdp --out bench/results/hsdp_a
	$(BIN)/pyfast bench plan --out bench/results/plan --docs docs/plan.md
	$(BIN)/pyfast bench report

# The compression ablation the README quotes: every spec x error feedback on/off on loopback,
# 1 Gbit/s and 100 Mbit/s, 2 ranks, gpt-tiny, 200 steps a cell (48 cells, about 10 minutes on 2
# cores; the rate-limited links need root). --resume: an interrupted run continues where it
# stopped; delete the directory to measure again.
ablate: $(STAMP)
	$(BIN)/pyfast ablate --out bench/results/ablate --resume

# Compile every CUDA source to an object file with this machine's nvcc against torch's
# headers: proves the GPU code builds where no GPU (or CUDA torch) exists to link it.
cuda-check: $(VENV)/.deps
	@test -n "$(NVCC)" || { echo "cuda-check: nvcc not found"; exit 1; }
	$(BIN)/python tools/cuda_check.py --nvcc "$(NVCC)" csrc/cuda/*.cu

clean:
	rm -rf build *.egg-info pyfast/_C*.so .pytest_cache runs
