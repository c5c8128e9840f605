# Every target uses the virtual environment .venv in the checkout; `make install` creates it.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_INDEX ?= --extra-index-url https://download.pytorch.org/whl/cpu
CONFIG ?= configs/vit.py
# configs/translate.py:demo -> workdirs/translate_demo
WORKDIR ?= workdirs/$(subst .py,,$(subst :,_,$(notdir $(CONFIG))))

.PHONY: install train plot test lint fmt bench

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: the CPU wheel (on this machine's disk, else the CPU index), never a
	# multi-GB CUDA build pulled in by transformers.
	$(BIN)/python -m pip install -q "torch==2.13.0" $(TORCH_INDEX)
	$(BIN)/python -m pip install -q -e ".[data,dev,interop]"
	touch $(STAMP)

train: install
	$(BIN)/python experiments/run.py --config=$(CONFIG) --workdir=$(WORKDIR) $(ARGS)

plot: install
	$(BIN)/python -m tfjax.plots $(WORKDIR)

test: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check tfjax tests benchmarks configs experiments && $(BIN)/ruff format --check tfjax tests benchmarks configs experiments

fmt: install
	$(BIN)/ruff format tfjax tests benchmarks configs experiments && $(BIN)/ruff check --fix tfjax tests benchmarks configs experiments

bench: install
	for b in benchmarks/*.py; do $(BIN)/python $$b || exit 1; done
