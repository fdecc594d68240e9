# Two entry points for a fresh machine with Python 3.11: `make demo` (main job) and `make test`.
# Both create .venv at the repository root and install the lock into it once (again when the lock changes).
# uv compiles every installed module to bytecode up front: where PYTHONDONTWRITEBYTECODE is set (many container
# images) no process would ever cache it, and each new one (a job, a Ray worker) would recompile torch and
# transformers from source and start several times slower.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
UV := $(VENV)/bin/uv
# The lock `make install` installs: every package, direct and transitive, at an exact version with its hashes.
# CPU (default) or CUDA: `make install LOCK=requirements-cuda.txt` (docs/install.md).
LOCK ?= requirements.txt
# Where the CPU torch wheel is found: this machine's disk, else PyTorch's CPU wheel page.
TORCH_WHEELS ?= $(or $(wildcard /opt/wheels),https://download.pytorch.org/whl/cpu/torch/)
# Each lock's torch: PyTorch's CPU build, or PyPI's Linux build of the same release with its CUDA libraries.
TORCH_CPU := torch==2.13.0+cpu
TORCH_CUDA := torch==2.13.0
# The uv that bootstraps the install is the one the lock pins.
UV_VERSION = $(shell sed -n 's/^uv==\([^ ]*\).*/\1/p' requirements.txt)
STAMP := $(VENV)/.installed
# Resolves pyproject.toml's ranges for Linux x86_64 / Python 3.11 whatever machine runs it, so this CPU machine
# writes the CUDA lock too.
RESOLVE := pyproject.toml --extra test --extra install --generate-hashes --python-version 3.11 \
	--python-platform x86_64-manylinux_2_28 --custom-compile-command "make lock"
FAST_TESTS := -m "not slow and not ray" tests/models tests/pipelines/data
LATEST := .venv-latest

.PHONY: install lock test-latest demo generate lint test test-e2e test-fast test-slow bench bench-gpu gpu-check corpus
install: $(STAMP)

$(STAMP): $(LOCK) pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	test -x $(UV) || $(PY) -m pip install --quiet --disable-pip-version-check "uv==$(UV_VERSION)"
	$(UV) pip sync --quiet --python $(PY) --require-hashes --compile-bytecode --find-links $(TORCH_WHEELS) $(LOCK)
	$(UV) pip install --quiet --python $(PY) --no-deps --no-build-isolation -e .
	$(UV) pip check --quiet --python $(PY)
	$(PY) -m pipelines.train.prebuild
	touch $(STAMP)

# Regenerates both locks from pyproject.toml's ranges (the newest versions they allow, today). The CUDA lock takes
# the CPU lock's versions for everything but torch, what only a CUDA torch needs, and the `cuda` extra.
lock: install
	echo "$(TORCH_CPU)" > $(VENV)/torch-cpu.txt
	echo "$(TORCH_CUDA)" > $(VENV)/torch-cuda.txt
	$(UV) pip compile $(RESOLVE) --find-links $(TORCH_WHEELS) --override $(VENV)/torch-cpu.txt \
		--upgrade --quiet -o requirements.txt
	grep -v '^torch==' requirements.txt | grep -v '^ *--hash' > $(VENV)/cpu-pins.txt
	$(UV) pip compile $(RESOLVE) --extra cuda --override $(VENV)/torch-cuda.txt --constraint $(VENV)/cpu-pins.txt \
		--upgrade --quiet -o requirements-cuda.txt

# The next releases, before they reach the lock: a throwaway venv with the newest versions pyproject.toml's ranges
# allow (torch stays this machine's CPU wheel), which versions differ from the lock, then make test-fast's tests.
test-latest: install
	rm -rf $(LATEST) && $(PYTHON) -m venv $(LATEST)
	echo "$(TORCH_CPU)" > $(LATEST)/torch-cpu.txt
	$(UV) pip compile $(RESOLVE) --find-links $(TORCH_WHEELS) --override $(LATEST)/torch-cpu.txt \
		--upgrade --quiet -o $(LATEST)/resolved.txt
	$(UV) pip sync --quiet --python $(LATEST)/bin/python --require-hashes --compile-bytecode --find-links $(TORCH_WHEELS) \
		$(LATEST)/resolved.txt
	$(UV) pip install --quiet --python $(LATEST)/bin/python --no-deps --no-build-isolation -e .
	$(UV) pip check --python $(LATEST)/bin/python
	$(LATEST)/bin/python -m pipelines.tracking.lineage --against requirements.txt
	$(LATEST)/bin/python -m pytest $(FAST_TESTS)

demo: install
	$(PY) jobs/stage0.py

generate: install
	$(PY) jobs/generate.py

# Style first (ruff, pyproject.toml's [tool.ruff]: 120 columns, unused or misplaced imports), a quick check that
# fails before the slower one: the import layering contracts in [tool.importlinter].
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

# Test files run on TEST_WORKERS processes (pytest-xdist), each file whole in one (its Ray session and fixtures once).
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadfile

test: lint
	$(PY) -m pytest $(XDIST) -m "not slow and not e2e"

test-e2e: install   # the longer end-to-end runs; CI runs them after make test (.ci/run)
	$(PY) -m pytest $(XDIST) -m "e2e and not slow"

test-fast: install   # models and data without Ray: a quick check while editing
	$(PY) -m pytest $(FAST_TESTS)

test-slow: install
	$(PY) -m pytest -m slow

bench: install
	$(PY) benchmarks/gca_overhead.py
	$(PY) benchmarks/train_throughput.py
	$(PY) benchmarks/corpus_throughput.py

bench-gpu: install   # on a CUDA machine, installed from the CUDA lock: make bench-gpu LOCK=requirements-cuda.txt
	$(PY) benchmarks/gpu_mfu.py

# Here, on the CPU machine: the wheels a GPU box lacks, packed in .gpu-bundle/ (ignored), and the one command that runs
# every GPU check there (benchmarks/gpu_check.py); docs/testing.md, GPU checks. GPU_BUNDLE=--dry-run: the plan only.
gpu-check: install
	$(PY) benchmarks/gpu_bundle.py $(GPU_BUNDLE)

corpus: install   # a stage-0 corpus of this repository's own code and docs
	$(PY) jobs/build_corpus.py --stage 0 --sources . --out outputs/corpus0
