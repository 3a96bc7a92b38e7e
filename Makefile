# The two commands of the README: `make demo` (verify + quick benchmark) and `make test`.
# Both use the virtual environment in $(VENV) (default .venv; torch pinned to the CPU build). make demo installs
# only what the demo runs; make test installs the test tools and the peers on top (a superset of the demo's).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
# make test installs every package under the pins of one constraints file (the README's tested versions; a test holds
# the two equal). CONSTRAINTS= (empty) installs unpinned, e.g. with another TORCH_SPEC on a GPU machine.
CONSTRAINTS ?= constraints/test.txt
PIN := $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
# torch's CPU build (2.13.0+cpu) comes from the configured package index; TORCH_INDEX=<url> adds an extra index
# (e.g. PyTorch's CPU wheel index, where the default index serves the CUDA build). Empty by default.
TORCH_INDEX ?=
TORCH_FROM := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
# What make demo runs besides torch and the package: triton (verify checks the Triton backend, in the Triton
# interpreter on a CPU), matplotlib (bench's chart) and tqdm (bench's progress bar on a terminal).
DEMO_DEPS ?= triton matplotlib tqdm
# Some pip configurations (a find-links folder or a file:// index that lacks a package) print a "Location ... is
# ignored" warning for every package looked up: the demo's installs leave those lines out. pip's exit status
# passes through the filter (pipefail), so a failed install still fails make demo.
PIP_NOISE := is ignored: it is neither a file nor a directory
PEERS ?= trl==1.16.0 liger-kernel==0.8.5 cut-cross-entropy==25.1.1 megatron-core==0.16.1
# DeepSpeed for the ZeRO-3 tests (make test-deepspeed): its Python package only (DS_BUILD_OPS=0, nothing compiled at
# install); on the CPU its accelerator compiles one communication op at first use, cached in TORCH_EXTENSIONS_DIR.
DEEPSPEED_SPEC ?= deepspeed==0.19.8
DS_EXTENSIONS ?= $(HOME)/.cache/gspo_kernels/torch_extensions
DEEPSPEED_TESTS ?= tests/distributed tests/integrations/test_openrlhf_distributed.py
# make test's worker processes (pytest-xdist; a test file stays in one worker): the interpreted Triton kernels
# run on one core each, so two workers use both cores of the development machine.
TEST_WORKERS ?= 2
VERL_SPEC ?= verl==0.9.1
VERL_IMPORTS ?= ray omegaconf tensordict orjson codetiming hydra-core
OPENRLHF_SPEC ?= openrlhf==0.11.2
# What OpenRLHF's modules import besides DEEPSPEED_SPEC (tests/integrations/stubs stands in for flash_attn and vllm).
OPENRLHF_IMPORTS ?= peft pylatexenc torchdata aiohttp

# The tested floor (gspo_kernels/versions.py): torch 2.8 and the triton it pins (3.4), in their own virtual
# environment. numpy < 2.4 there: the Triton interpreter of triton 3.4 - 3.6 predates numpy 2.4 (with it, every
# interpreted kernel fails on a 1-element array converted to a Python scalar). make test-compat runs the
# kernel, conformance and trainer test files there.
FLOOR_VENV ?= .venv-floor
FLOOR_PY := $(FLOOR_VENV)/bin/python
FLOOR_STAMP := $(FLOOR_VENV)/.installed
FLOOR_SPEC ?= torch==2.8.0 numpy==2.2.6 transformers==5.24.0
COMPAT_TESTS ?= tests/repository/test_versions.py tests/backends/triton/test_triton_logits.py \
	tests/backends/triton/test_triton_logits_edges.py \
	tests/backends/triton/test_triton_linear.py tests/test_softcap.py tests/backends/triton/test_vocab_sliced_backward.py \
	tests/backends/cpu/test_cpu_backend.py tests/backends/torch/test_torch_backend.py tests/test_conformance.py \
	tests/objectives/test_objectives.py tests/train/test_hf_trainer.py tests/train/test_toy_trainer.py
# The peers (TRL, verl) and matplotlib (the arithmetic example's plot) are not installed on the floor: the tests
# that need them run in make test, and only those are left out here, by name.
COMPAT_DESELECT ?= not test_matches_trl and not matches_trl_compute_loss and not test_matches_verl \
	and not test_example_writes_its_plot

.PHONY: demo test test-deepspeed test-compat bench lint clean install doc-tables

$(DEMO_STAMP): SHELL := /bin/bash
$(DEMO_STAMP): .SHELLFLAGS := -o pipefail -c
$(DEMO_STAMP): pyproject.toml
	@echo "make demo: installing $(TORCH_SPEC), $(DEMO_DEPS) and gspo-kernels into $(VENV) (not the test peers)"
	$(PYTHON) -m venv $(VENV)
	@echo "pip install pip setuptools wheel; $(TORCH_SPEC) numpy; $(DEMO_DEPS); -e ."
	@$(PY) -m pip install -q --upgrade pip setuptools wheel 2>&1 | { grep -v "$(PIP_NOISE)" || true; }
	@$(PY) -m pip install -q "$(TORCH_SPEC)" numpy 2>&1 | { grep -v "$(PIP_NOISE)" || true; }
	@$(PY) -m pip install -q $(DEMO_DEPS) 2>&1 | { grep -v "$(PIP_NOISE)" || true; }
	@# setuptools' note on every editable install of a flat layout ("Editable installation. Please be careful with
	@# folders in your working directory ...", a dozen lines) is left out too; its errors are not.
	@PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q -e . 2>&1 | { grep -v "$(PIP_NOISE)" || true; }
	@touch $(DEMO_STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q --retries 1 $(PIN) $(TORCH_FROM) "$(TORCH_SPEC)" numpy
	$(PY) -m pip install -q $(PIN) triton transformers accelerate pytest pytest-benchmark pytest-xdist ruff matplotlib tqdm build
	# Test peers: a failed install fails the build (their parity tests must run, never skip).
	$(PY) -m pip install -q $(PIN) $(PEERS)
	DS_BUILD_OPS=0 $(PY) -m pip install -q $(PIN) $(DEEPSPEED_SPEC)
	# verl pins transformers/tensordict ranges it does not need on the CPU: installed without its
	# dependency list, plus the few packages its loss and model-patching modules import.
	$(PY) -m pip install -q $(PIN) --no-deps $(VERL_SPEC)
	$(PY) -m pip install -q $(PIN) $(VERL_IMPORTS)
	# OpenRLHF pins flash-attn (no build without CUDA) and older deepspeed / transformers / ray than the ones here:
	# installed without its dependency list, plus what its modules import.
	$(PY) -m pip install -q $(PIN) --no-deps $(OPENRLHF_SPEC)
	$(PY) -m pip install -q $(PIN) $(OPENRLHF_IMPORTS)
	# The package itself, as any user installs it (build isolation on: the build needs no torch).
	$(PY) -m pip install -q $(PIN) -e .
	touch $(STAMP) $(DEMO_STAMP)

install: $(STAMP)
	$(VENV)/bin/gspo-kernels build-ext

# The C++ CPU kernels are compiled at first use into a per-user cache keyed by their sources (editing
# csrc/ needs no reinstall); build-ext compiles them up front (a no-op when cached), so no
# timed step or test pays the compile.
demo: $(DEMO_STAMP)
	$(VENV)/bin/gspo-kernels build-ext
	$(VENV)/bin/gspo-kernels verify
	$(VENV)/bin/gspo-kernels bench --quick
	@echo "make demo: done. verify's checks are the table above; the benchmark: results/bench.json (every figure, the"
	@echo "device and versions) and results/bench.png (the chart). The peers (TRL, Liger, Cut Cross-Entropy) are"
	@echo "skipped rows unless installed (make test installs them)."

test: $(STAMP)
	$(VENV)/bin/gspo-kernels build-ext
	GSPO_KERNELS_REQUIRE_EXT=1 $(PY) -m pytest tests -m "not deepspeed" -q -ra -n $(TEST_WORKERS) --dist loadfile

# The multi-process DeepSpeed tests (marker deepspeed): two processes each (torchrun / accelerate launch), DeepSpeed's
# CPU accelerator over gloo, every launch under a time limit (a rank that hangs fails its test).
test-deepspeed: $(STAMP)
	$(VENV)/bin/gspo-kernels build-ext
	DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(DS_EXTENSIONS) GSPO_KERNELS_REQUIRE_EXT=1 \
		$(PY) -m pytest $(DEEPSPEED_TESTS) -m deepspeed -q -ra

$(FLOOR_STAMP): pyproject.toml
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_PY) -m pip install -q --upgrade pip setuptools wheel
	$(FLOOR_PY) -m pip install -q $(FLOOR_SPEC) pytest pytest-xdist ninja
	$(FLOOR_PY) -m pip install -q --no-deps -e .
	touch $(FLOOR_STAMP)

# The floor's own test run: first that the environment holds the floor's versions (never a newer triton by
# accident), then the kernel, conformance and trainer files.
test-compat: $(FLOOR_STAMP)
	$(FLOOR_PY) -c "import torch, triton; from gspo_kernels import versions as v; \
	got = (v.parse(torch.__version__)[:2], v.parse(triton.__version__)[:2]); \
	assert got == (v.MIN_TORCH, v.MIN_TRITON), f'floor environment holds torch/triton {got}'; \
	print('floor: torch', torch.__version__, 'triton', triton.__version__)"
	$(FLOOR_VENV)/bin/gspo-kernels build-ext
	GSPO_KERNELS_REQUIRE_EXT=1 $(FLOOR_PY) -m pytest $(COMPAT_TESTS) -k "$(COMPAT_DESELECT)" -q -ra -n $(TEST_WORKERS) --dist loadfile

bench: $(STAMP)
	$(VENV)/bin/gspo-kernels build-ext
	$(VENV)/bin/gspo-kernels bench

# The measured tables of README.md and docs/*.md, rewritten from their records (docs/records/*.json and the
# records the bench commands write): benchmarks/doc_tables.py; tests/repository/test_doc_tables.py holds them equal.
doc-tables:
	$(PY) benchmarks/doc_tables.py

lint: $(STAMP)
	$(VENV)/bin/ruff check gspo_kernels tests benchmarks

# gspo_kernels/csrc: the sources' former place (an old tree's leftovers; the checkout's sources are in csrc/).
clean:
	rm -rf $(VENV) $(FLOOR_VENV) build dist *.egg-info gspo_kernels/backends/_C*.so gspo_kernels/csrc
