# The two commands (README): `make demo` runs the daemon demo, `make test` runs the tests.
# Both bootstrap .venv on first use: torch 2.13.0 (CPU) first, so no multi-GB CUDA build is pulled in.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU wheels (as in the Dockerfile); PyPI's torch is the CUDA build. pip's own find-links and extra indexes
# (pip.conf) still apply: a host with a local wheel of torch 2.13.0+cpu takes it from there.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: demo test lint proto config-docs bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0 --index-url $(TORCH_INDEX)
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/engram demo

test: $(STAMP)
	$(BIN)/pytest -q  # not `python -m pytest`: that puts the repo root (and its kernels/) on sys.path

lint: $(STAMP)
	$(BIN)/ruff check engram kernels cli tests benchmarks scripts
	$(BIN)/mypy engram kernels cli

proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

config-docs: $(STAMP)  # docs/CONFIG.md and engram.example.toml, from engram/config.py
	$(BIN)/python scripts/gen_config_docs.py

clean:
	rm -rf $(VENV) .pytest_cache
