# make tour       run every lesson's launch line and print one table (the course's main job)
# make test       the test suite: every parallel implementation against a single process, on gloo
# make test DAY=19  one day's tests, its launch lines and its bad-input checks (minutes, not 20)
# make prove      every graded exercise: its stub fails each grader, its solution passes (CI)
# make cluster    two hosts for real (root): the failure drills, a killed host, Slurm (CI)
# make gpu-check  the GPU check: the most valuable GPU lines first, inside BUDGET_S seconds
# make gpu-all    every GPU launch line on the GPUs present (SKIP, with the reason, where too few)
# make lint       ruff, and mypy (strict) on the kit dtl/
# make figures    redraw the notes' figures (dayNN/figures/*.png) from the course's code
# make wheelhouse every wheel the course needs but torch, for an offline box (tools/wheelhouse.py)
# Each target installs the project on first use (tools/install.sh); later calls reuse it.
#
# Which Python: by default a venv made here (.venv), torch pinned first. On a machine that
# already has its own torch (a cluster image, a container) use it as it is:
#   make test PY=python3                          that interpreter, its torch kept
#   make test VENV_FLAGS=--system-site-packages   a venv here that sees the system's torch
#   make test PY=python3 WHEELS=wheelhouse        no network: the rest from the wheel folder

VENV    ?= .venv
PY      ?= $(VENV)/bin/python
IN_VENV := $(filter $(VENV)/bin/python,$(PY))
STAMP   ?= $(if $(IN_VENV),$(VENV)/.installed,.dtl-installed/$(subst /,_,$(PY)))
# torch first, pinned, so that pip never resolves a newer multi-GB CUDA build behind your back.
# On a GPU machine this same pin gets the CUDA wheel. Without a GPU, and with internet, add
# TORCH_INDEX=https://download.pytorch.org/whl/cpu to get the small CPU wheel.
TORCH   ?= torch==2.13.0
TORCH_INDEX ?=
WHEELS  ?=
EXTRAS  ?= dev,deepspeed,megatron
VENV_FLAGS ?=
PYTEST_ARGS ?=
DAY ?=
DAY_TESTS = $(if $(DAY),$(wildcard tests/test_day$(DAY)_*.py) tests/test_lessons.py \
	tests/test_bad_input.py tests/test_notes_shape.py -k day$(DAY))
BUDGET_S ?= 480

export OMP_NUM_THREADS ?= 1
export HF_DATASETS_OFFLINE ?= 1
export HF_HUB_OFFLINE ?= 1
# DeepSpeed's C++ ops, built once at install (tools/warm_deepspeed_ops.py) and found here by every
# test and lesson; an absolute path, since the JIT cache is keyed on it. The interpreter's bin
# comes first on PATH for every target: its ninja (1.13) must be the one that built the ops, or a
# system ninja (1.11 here) finds a log it cannot read and rebuilds every op inside the first
# DeepSpeed test
export TORCH_EXTENSIONS_DIR ?= $(if $(IN_VENV),$(abspath $(VENV)),$(abspath .dtl-installed))/torch_extensions
export PATH := $(abspath $(dir $(shell command -v $(PY) 2>/dev/null || echo $(PY)))):$(PATH)

.PHONY: cluster tour test prove gpu-check gpu-all lint figures readme install wheelhouse clean

# a new day package needs the editable install redone (its finder maps the packages it knew)
$(STAMP): pyproject.toml Makefile tools/install.sh tools/warm_deepspeed_ops.py $(wildcard day*/__init__.py)
	PY="$(PY)" STAMP="$(STAMP)" TORCH="$(TORCH)" TORCH_INDEX="$(TORCH_INDEX)" WHEELS="$(WHEELS)" \
		VENV_FLAGS="$(VENV_FLAGS)" EXTRAS="$(EXTRAS)" bash tools/install.sh

install: $(STAMP)

tour: $(STAMP)
	$(PY) -m dtl.tour

# a missing Python extra (deepspeed, megatron) fails the suite here instead of skipping it
test: $(STAMP)
	DTL_REQUIRE_EXTRAS=1 $(PY) -m pytest $(DAY_TESTS) $(PYTEST_ARGS)

# network namespaces as hosts (dtl.cluster): the drills, a killed host, Slurm; root, own budget
cluster: $(STAMP)
	DTL_REQUIRE_EXTRAS=1 $(PY) -m pytest -m cluster tests/test_cluster_drills.py $(PYTEST_ARGS)

# the exercises' proof edits the course's files and puts them back; its own budget in CI
prove: $(STAMP)
	$(PY) -m dtl.exercise_proof

gpu-check: $(STAMP)
	$(PY) -m dtl.tour --gpu-check --budget_s=$(BUDGET_S)

gpu-all: $(STAMP)
	$(PY) -m dtl.tour --gpu-all

# on a connected machine: every wheel but torch for the Python and platform of the offline box
# (WHEEL_PYTHON=3.12 WHEEL_PLATFORM=manylinux_2_28_x86_64; HAVE=freeze.txt skips what it has;
# WHEEL_EXTRAS=deepspeed,megatron leaves out pytest, ruff and mypy)
wheelhouse: $(STAMP)
	$(PY) tools/wheelhouse.py --out wheelhouse $(if $(WHEEL_PYTHON),--python-version $(WHEEL_PYTHON)) \
		$(if $(WHEEL_PLATFORM),--platform $(WHEEL_PLATFORM)) $(if $(HAVE),--have $(HAVE)) \
		$(if $(WHEEL_EXTRAS),--extras $(WHEEL_EXTRAS))

lint: $(STAMP)
	$(PY) -m ruff check dtl day* tests tools
	$(PY) -m mypy dtl

figures: $(STAMP)
	$(PY) tools/figures.py

readme: $(STAMP)
	$(PY) -m dtl.course_map --write

clean:
	rm -rf outputs .pytest_cache
