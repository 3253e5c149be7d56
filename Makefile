# The two commands a new user needs are `make demo` and `make test`; each creates the virtual
# environment on first use and reinstalls when pyproject.toml or constraints.txt changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo demo-dist demo-trainer test test-fast stress lint bench bench-full bench-scale bench-dist bench-checkpoint \
	bench-compile bench-infer bench-activations bench-plan bench-budget bench-trainer bench-finetune bench-masters gpu-check soak \
	venv clean docs

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned, so nothing later resolves it to a CUDA build; everything else at
	# this machine's tested versions (constraints.txt), which pyproject.toml only bounds below.
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m infinity.cli.demo

# The demo on 2 data-parallel ranks (torchrun, gloo), ZeRO stage 3: each rank swaps 1/2 of the state.
demo-dist: $(STAMP)
	$(PY) -m infinity.cli.demo_dist

# The README's Hugging Face Trainer recipe (InfinityTrainer) on 2 ranks, the same summary per rank.
demo-trainer: $(STAMP)
	$(PY) -m infinity.cli.demo_dist --trainer

# Lint, format, types and the import layers first (ruff, mypy and import-linter at
# constraints.txt's versions, configured in pyproject.toml), then the suite: .ci/run calls this on a clean clone. The suite runs on one
# pytest-xdist worker per core, each computing with one thread (tests/conftest.py); the
# slowest cases are listed at the end, to keep the suite's time in view.
test: lint docs
	$(PY) -m pytest -q -n auto --durations=25 tests

# The edit loop: the suite without the cases marked slow (ranks, whole trainers, fresh
# processes, long equivalence runs; see tests/conftest.py), in under a minute here.
test-fast: $(STAMP)
	$(PY) -m pytest -q -n auto -m "not slow" tests

# The store's random-operations stress test at full length (the suite runs a fifth of it).
stress: $(STAMP)
	INFINITY_STRESS_EXAMPLES=50 $(PY) -m pytest -q tests/test_store_stress.py

# The docs site (mkdocs.yml) into site/, strictly: a broken link or reference, or a config field,
# DeepSpeed key or stats() key without a description (docs/hooks/reference.py), fails it. Offline.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

lint: $(STAMP)
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports
	$(PY) -m ruff format --check .
	$(PY) -m mypy

# Speed and memory targets are checked here, against baselines measured in the same run (fio,
# plain PyTorch), never by timed assertions in the tests.
bench: $(STAMP)
	$(PY) -m infinity.cli.bench --quick
	$(PY) -m tools.benchmarks.bench_overlap --repeats 1
	$(PY) -m tools.benchmarks.bench_clip --repeats 2
	$(PY) -m tools.benchmarks.bench_step --layers 12 --host-budget 256MiB --buffer-size 16MiB

bench-full: $(STAMP)
	$(PY) -m infinity.cli.bench
	$(PY) -m tools.benchmarks.bench_overlap
	$(PY) -m tools.benchmarks.bench_clip
	$(PY) -m tools.benchmarks.bench_step

# The CUDA path on a GPU machine: no venv and no network there (the repository on PYTHONPATH,
# the machine's own torch); the CUDA tests, then a short benchmark. Figures go to
# gpu_check.json (--out).
# Here (no GPU) it says so and fails.
GPU_PY := $(shell test -x $(PY) && echo $(PY) || echo $(PYTHON))
gpu-check:
	PYTHONPATH=. $(GPU_PY) -m tools.benchmarks.gpu_check

# torch.compile's gain on the demo's GPT, plain and attached (each block compiled).
bench-compile: $(STAMP)
	$(PY) -m tools.benchmarks.bench_compile

# Inference: a 219.7M-param Llama streamed from NVMe (attached, no optimizer) against the model
# in RAM and accelerate's disk_offload (page cache dropped), each in its own process,
# interleaved; then generate throughput at batch 1, 8 and 32. Drops the page cache (as root).
# Then quant_quality: the demo GPT trained a few hundred steps, its held-out loss and top-1
# agreement with the weights stored fp32, bf16, int8 and int4, against the model in RAM.
bench-infer: $(STAMP)
	$(PY) -m tools.benchmarks.bench_infer
	$(PY) -m tools.benchmarks.quant_quality

# A GPT with a long sequence (activations most of the memory): activations kept, checkpointed,
# offloaded to host memory and to NVMe (offload_activations); step time and device-tier peak.
bench-activations: $(STAMP)
	$(PY) -m tools.benchmarks.bench_activations

# The planner's predictions for three budgets against runs with them (the 100.7M MLP), then its
# validation matrix: five model families x three host budgets x both update modes x params on
# cpu and on NVMe, each cell three times in interleaved passes (about an hour here).
bench-plan: $(STAMP)
	$(PY) -m tools.benchmarks.bench_plan
	$(PY) -m tools.benchmarks.plan_matrix

# Tight host budgets (1.0 and 0.7 GiB): each step against its floor, per phase, 20 steps each,
# with DeepSpeed measured next to it where the peer harness is installed.
bench-budget: $(STAMP)
	$(PY) -m tools.benchmarks.bench_budget

# Hugging Face Trainer on 2 ranks: plain (DDP), InfinityTrainer, and a raw loop on the same store.
bench-trainer: $(STAMP)
	$(PY) -m tools.benchmarks.bench_trainer

# Long: save and load of the scale model's checkpoint (tens of GB through the disk).
bench-checkpoint: $(STAMP)
	$(PY) -m tools.benchmarks.bench_checkpoint

# Long: moves tens of GB through the disk (a 2.56 B-parameter GPT under a 4 GiB host budget; it
# checks the free disk first).
bench-scale: $(STAMP)
	$(PY) -m tools.benchmarks.bench_scale

# Long: what people fine-tune, through InfinityTrainer under a 4 GiB host budget, 3 steps each:
# the Llama-3-8B shape fully (bf16, int8 Adam state) and a 13 B Llama shape with LoRA r=16 on
# q/k/v/o, each step against max(compute floor, I/O floor) measured in the same run. It checks
# the free disk first and says what it needs (tens of GB). A small copy of each, in minutes:
# FINETUNE_ARGS="--layers 2 --vocab 8192 --narrow 2 --host-budget 512MiB".
bench-finetune: $(STAMP)
	$(PY) -m tools.benchmarks.bench_finetune $(FINETUNE_ARGS)

# bf16 masters (precision.master_dtype='bf16', rounded stochastically) against fp32 masters over
# 200 steps of a small Llama on the project's own text: the loss each ends at, the bytes each
# stores per parameter, and bf16 trained as it is (round to nearest) for reference.
bench-masters: $(STAMP)
	$(PY) -m tools.benchmarks.bench_masters

# 2 ranks (torchrun, gloo): ZeRO-3 with NVMe offload against FSDP2 (and DeepSpeed, where the peer
# harness's venv is installed; else its quoted figures), step time and peak RSS per rank.
bench-dist: $(STAMP)
	$(PY) -m tools.benchmarks.bench_dist

soak: $(STAMP)
	$(PY) -m tools.benchmarks.soak --minutes 10

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache site
