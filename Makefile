# Two commands on a fresh machine with Python 3.11: `make demo` and `make test`.
# `make unit` is the fast tier: tests/unit starts no torch worker and takes well under a minute.
PYTHON ?= python3.11
VENV ?= .venv
# Override to keep your own build, e.g. TORCH_SPEC='torch>=2.4' (CUDA users) or an already installed one.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
# pytest-xdist workers for `make test`: most tests wait on real processes and timeouts, so two
# workers halve the suite on a 2-core machine (tests that create users share one worker)
TEST_WORKERS ?= 2

.PHONY: setup demo test lint nftables unit conformance bench bench-short bench-pool clean soak-preempt

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)" numpy
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

demo: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" bash scripts/demo.sh

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

# the browser tier runs in it: DDPD_TEST_BROWSER=required makes a missing browser a failure, not a skip
test: lint nftables $(VENV)/.conformance $(VENV)/.browser
	DDPD_TEST_BROWSER=required $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

# the port fences' tests need nftables (tests/adversarial/test_trust_boundary.py, test_port_fences.py):
# installed where missing, as root
nftables:
	@command -v nft >/dev/null || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null || \
		(apt-get update -q && apt-get install -y -q nftables)

unit: setup
	$(BIN)/python -m pytest -q tests/unit

# the conformance tier (tests/conformance, part of `make test`): real framework scripts (Lightning, HF
# Trainer, accelerate, ignite, DCP, DataLoader workers, exit handlers, umask) under torchrun and under
# ddpd, compared. Its frameworks are the `conformance` extra, pinned; TORCH_SPEC keeps torch as it is.
conformance: $(VENV)/.conformance
	$(BIN)/python -m pytest -q tests/conformance

$(VENV)/.conformance: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[dev,conformance]' "$(TORCH_SPEC)"
	touch $@

# the browser tier (tests/browser, part of `make test`): headless Chromium from Debian (chromium,
# chromium-driver: installed with apt where missing, as root) driven by Selenium (the `browser` extra)
.PHONY: browser-test
browser-test: $(VENV)/.browser
	DDPD_TEST_BROWSER=required $(BIN)/python -m pytest -q -p no:cacheprovider tests/browser

$(VENV)/.browser: $(VENV)/.installed
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		{ apt-get update -q && apt-get install -y -q chromium chromium-driver; }
	$(BIN)/pip install -q -e '.[dev,browser]'
	touch $@

# the preemption loop at full length: 50 preemptions of one job, each checkpointed and resumed (issue: 100%)
soak-preempt: setup
	DDPD_PREEMPT_ROUNDS=50 $(BIN)/python -m pytest -q -p no:randomly \
		"tests/integration/test_preemption.py::test_a_higher_priority_job_preempts_and_the_preempted_one_resumes_from_its_checkpoint"

bench: setup
	$(BIN)/python -m benchmarks

bench-short: setup
	$(BIN)/python -m benchmarks --short

bench-pool: setup
	$(BIN)/python -m benchmarks.pool

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
