# Optimus: `make reproduce` (the paper's experiments at laptop scale) and `make test`.
# Both bootstrap .venv from pyproject.toml; nothing else needs to be installed first.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch: a GPU machine or Aurora brings its own torch (any 2.10 - 2.14).
TORCH_SPEC ?= torch==2.13.0
CORES ?= 2
PROFILE ?= workflow/profiles/laptop
BIN := $(VENV)/bin

.PHONY: all venv reproduce dry-run test test-fast bench clean-results clean

all: test

# The eval extra (transformers + safetensors for export-hf, lm-eval for downstream tasks) adds
# ~1.7 min to a fresh install (41 s + 62 s measured here); without it those tests skip.
$(BIN)/optimus: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e '.[dev,eval]'
	@touch $@

venv: $(BIN)/optimus

# The whole laptop DAG; a second run finds everything up to date and says so.
reproduce: venv
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/snakemake --profile $(PROFILE) --cores $(CORES)

dry-run: venv
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/snakemake --profile $(PROFILE) -n

test: venv
	PATH=$(CURDIR)/$(BIN):$$PATH TRITON_INTERPRET=1 $(BIN)/python -m pytest -q

test-fast: venv
	PATH=$(CURDIR)/$(BIN):$$PATH TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m "not slow"

bench: venv
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python bench/kernels.py

# Everything the DAG wrote (results/ holds outputs only, README.md aside): a marker left beside a
# removed store would tell Snakemake its job is done
clean-results:
	find results -mindepth 1 -maxdepth 1 ! -name README.md -exec rm -rf {} +
	rm -rf .snakemake

clean: clean-results
	rm -rf $(VENV)
