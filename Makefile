# Two entry points for a fresh machine with Python 3.11: `make demo` (main job) and `make test`.
# Both create .venv at the repository root and install into it once (re-run when pyproject.toml changes).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
# CPU installs pin the local CPU wheel; a GPU machine overrides it: `make install TORCH="torch>=2.8"`.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install demo generate lint test test-fast test-slow bench bench-gpu corpus
install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[test]"
	$(PY) -m pipelines.train.prebuild
	touch $(STAMP)

demo: install
	$(PY) jobs/stage0.py

generate: install
	$(PY) jobs/generate.py

lint: install   # the import layering contracts in pyproject.toml's [tool.importlinter]
	$(VENV)/bin/lint-imports

test: lint
	$(PY) -m pytest -m "not slow"

test-fast: install   # models and data without Ray: a quick check while editing
	$(PY) -m pytest -m "not slow and not ray" tests/models tests/pipelines/data

test-slow: install
	$(PY) -m pytest -m slow

bench: install
	$(PY) benchmarks/gca_overhead.py
	$(PY) benchmarks/train_throughput.py
	$(PY) benchmarks/corpus_throughput.py

bench-gpu: install   # on a CUDA machine, with a CUDA torch: make bench-gpu TORCH="torch>=2.8"
	$(PY) benchmarks/gpu_mfu.py

corpus: install   # a stage-0 corpus of this repository's own code and docs
	$(PY) jobs/build_corpus.py --stage 0 --sources . --out outputs/corpus0
