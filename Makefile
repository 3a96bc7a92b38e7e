# The two commands of the README: `make demo` (verify + quick benchmark) and `make test`.
# Each builds its own virtual environment in .venv (torch pinned to the CPU build on this machine's disk).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
PEERS ?= trl==1.16.0 liger-kernel==0.8.5 cut-cross-entropy==25.1.1
# make test's worker processes (pytest-xdist; a test file stays in one worker): the interpreted Triton kernels
# run on one core each, so two workers use both cores of the development machine.
TEST_WORKERS ?= 2
VERL_SPEC ?= verl==0.9.1
VERL_IMPORTS ?= ray omegaconf tensordict orjson codetiming hydra-core

.PHONY: demo test bench lint clean install

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q "$(TORCH_SPEC)" numpy
	$(PY) -m pip install -q triton transformers pytest pytest-benchmark pytest-xdist ruff matplotlib tqdm build
	# Test peers: a failed install fails the build (their parity tests must run, never skip).
	$(PY) -m pip install -q $(PEERS)
	# verl pins transformers/tensordict ranges it does not need on the CPU: installed without its
	# dependency list, plus the few packages its loss and model-patching modules import.
	$(PY) -m pip install -q --no-deps $(VERL_SPEC)
	$(PY) -m pip install -q $(VERL_IMPORTS)
	# The package itself, as any user installs it (build isolation on: the build needs no torch).
	$(PY) -m pip install -q -e .
	touch $(STAMP)

install: $(STAMP)
	$(VENV)/bin/gspo-kernels build-ext

# The C++ CPU kernels are compiled at first use into a per-user cache keyed by their sources (editing
# gspo_kernels/csrc needs no reinstall); build-ext compiles them up front (a no-op when cached), so no
# timed step or test pays the compile.
demo: $(STAMP)
	$(VENV)/bin/gspo-kernels build-ext
	$(VENV)/bin/gspo-kernels verify
	$(VENV)/bin/gspo-kernels bench --quick

test: $(STAMP)
	$(VENV)/bin/gspo-kernels build-ext
	GSPO_KERNELS_REQUIRE_EXT=1 $(PY) -m pytest tests -q -ra -n $(TEST_WORKERS) --dist loadfile

bench: $(STAMP)
	$(VENV)/bin/gspo-kernels build-ext
	$(VENV)/bin/gspo-kernels bench

lint: $(STAMP)
	$(VENV)/bin/ruff check gspo_kernels tests benchmarks

clean:
	rm -rf $(VENV) build dist *.egg-info gspo_kernels/backends/_C*.so
