# Every target uses the virtual environment .venv in the checkout; `make install` creates it.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONFIG ?= configs/vit.py
WORKDIR ?= workdirs/$(notdir $(basename $(firstword $(subst :, ,$(CONFIG)))))

.PHONY: install test lint fmt bench

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[data,dev]"
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check tfjax tests benchmarks && $(BIN)/ruff format --check tfjax tests benchmarks

fmt: install
	$(BIN)/ruff format tfjax tests benchmarks && $(BIN)/ruff check --fix tfjax tests benchmarks

bench: install
	$(BIN)/python benchmarks/attention_memory.py
