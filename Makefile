# Every target uses the virtual environment .venv in the checkout (VENV=... for another one);
# `make install` creates it with $(PY). CI (.ci/run) runs `make test` twice, at both ends of the
# tested range: with python3 (3.11 there: jax 0.10.2, flax 0.12.8, libtpu 0.0.42), and with
# `PY=/path/to/python3.12 VENV=.venv-newest` (jax 0.12.0.1, flax 0.12.12, libtpu 0.0.50.1).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
TORCH_INDEX ?= --extra-index-url https://download.pytorch.org/whl/cpu
CONFIG ?= configs/vit.py
# configs/translate.py:demo -> workdirs/translate_demo
WORKDIR ?= workdirs/$(subst .py,,$(subst :,_,$(notdir $(CONFIG))))

.PHONY: install install-dev train plot test lint fmt bench

# What training needs: tfjax and its input pipeline.
install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[data]"
	touch $(STAMP)

# What the tests, benchmarks and experiments/compile.py add: pytest and ruff, the interop
# references, libtpu and JAX's CUDA plugin with ptxas (the TPU and GPU compilers, for
# compiling ahead of time on this host).
install-dev: $(DEV_STAMP)

$(DEV_STAMP): $(STAMP)
	# torch first and pinned, so that transformers pulls in no other build: a CPU wheel pip
	# already finds without an index (find-links, a wheel cache) is taken as it is; otherwise
	# PyTorch's CPU index is asked (where it is unreachable, ~8 s of retries for torch alone)
	# and else PyPI's build of the same release, whose CUDA libraries (2.6 GB to download, not
	# loaded without a GPU) come with the next line, as the CPU wheel's dependencies do.
	$(BIN)/python -m pip install -q --no-index --no-deps "torch==2.13.0+cpu" 2>/dev/null || \
	  $(BIN)/python -m pip install -q --no-deps "torch==2.13.0" $(TORCH_INDEX)
	$(BIN)/python -m pip install -q -e ".[data,dev,interop]"
	# timm, the reference of tests/interop/test_interop_timm.py, imports torchvision, and PyPI's
	# torchvision imports only beside PyPI's torch: beside the CPU build (+cpu) it would break
	# transformers' vision models too, so there it is not installed and those tests skip.
	case "$$($(BIN)/python -c 'import torch; print(torch.__version__)')" in *+cpu) ;; \
	  *) $(BIN)/python -m pip install -q -e ".[timm]" && $(BIN)/python -c "import timm" ;; esac
	# cuDNN's library (1.1 GB) without the cuBLAS and NVRTC it lists (1 GB more, not needed to
	# compile): JAX checks cuDNN's version when it traces cuDNN attention, so with it a GPU
	# compile from this host takes the attention path a GPU run takes.
	$(BIN)/python -m pip install -q --no-deps "nvidia-cudnn-cu12>=9.8,<10"
	touch $(DEV_STAMP)

train: install
	$(BIN)/python experiments/run.py --config=$(CONFIG) --workdir=$(WORKDIR) $(ARGS)

plot: install
	$(BIN)/python -m tfjax.runner.plots $(WORKDIR)

# Parallel workers (pytest-xdist), a test file per worker at a time: its module fixtures are
# built once. TEST_JOBS=0 runs in this process (for a debugger). The slowest tests are listed
# at the end, so that each CI run shows where the suite's time goes.
TEST_JOBS ?= auto
test: install-dev
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile --durations=25 $(PYTEST_ARGS)

lint: install-dev
	$(BIN)/ruff check tfjax tests benchmarks configs experiments && $(BIN)/ruff format --check tfjax tests benchmarks configs experiments

fmt: install-dev
	$(BIN)/ruff format tfjax tests benchmarks configs experiments && $(BIN)/ruff check --fix tfjax tests benchmarks configs experiments

bench: install-dev
	for b in benchmarks/*.py; do $(BIN)/python $$b || exit 1; done
