# The two commands of the README: `make demo` (verify + quick benchmark) and `make test`.
# Each builds its own virtual environment in .venv (torch pinned to the CPU build on this machine's disk).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test bench lint clean install

$(STAMP): setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*.h)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q "$(TORCH_SPEC)" numpy
	$(PY) -m pip install -q triton transformers pytest pytest-benchmark ruff matplotlib tqdm
	$(PY) -m pip install -q trl liger-kernel cut-cross-entropy || echo "peers not installed: their comparisons are skipped"
	$(PY) -m pip install -q --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/gspo-kernels verify
	$(VENV)/bin/gspo-kernels bench --quick

test: $(STAMP)
	GSPO_KERNELS_REQUIRE_EXT=1 $(PY) -m pytest tests -q -ra

bench: $(STAMP)
	$(VENV)/bin/gspo-kernels bench

lint: $(STAMP)
	$(VENV)/bin/ruff check gspo_kernels tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info gspo_kernels/backends/_C*.so
