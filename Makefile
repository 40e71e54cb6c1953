# Set-up and everyday commands. `make run` and `make test` create the virtual environment on first use.
#   BACKEND=cpu|gpu|tf26   which TensorFlow requirements file to install (default cpu), each into its own
#                          environment: .venv, .venv-gpu, .venv-tf26 (two TensorFlow builds in one
#                          environment overwrite each other's files, and tf26 needs another Python)
#   make test-tf26         the same tests on Python 3.8 + TensorFlow 2.6.3 (the Poplar SDK's versions)
#   PYTHON=, REFERENCE_PYTHON=   the Pythons that create .venv and .venv-torch (default: found, below)
BACKEND ?= cpu
VENV_cpu := .venv
VENV ?= $(or $(VENV_$(BACKEND)),.venv-$(BACKEND))
PY := $(VENV)/bin/python
RUN_ARGS ?=
REFERENCE_VENV ?= .venv-torch
# pytest-xdist workers for make test / test-unit. Alone, the suite keeps about 1.1 of 2 cores busy
# (process start-up, TensorFlow imports and Python run on one core); two workers use both. Each
# worker holds its own TensorFlow (about 1 GB).
TEST_WORKERS ?= 2
# The Python versions with wheels of each requirements file's TensorFlow or PyTorch, newest first.
# TensorFlow 2.21 has none for 3.14 (Fedora 43's python3); 3.9 (RHEL 9's) gets 2.20, its last release.
PYTHON_VERSIONS_cpu := 3.13 3.12 3.11 3.10 3.9
PYTHON_VERSIONS_gpu := $(PYTHON_VERSIONS_cpu)
PYTHON_VERSIONS_tf26 := 3.8
PYTHON_VERSIONS_reference := 3.14 3.13 3.12 3.11 3.10
# Exit status 0 when the Python $(1) is one of the versions $(2).
is_one_of = $(1) -c "import sys; sys.exit('%d.%d' % sys.version_info[:2] not in '$(2)'.split())" 2>/dev/null
# python3 when it is one of the versions $(1), else the newest of them found as python3.X on PATH or
# under pyenv; empty when there is none.
find_python = $(shell for p in python3 $(foreach v,$(1),python$(v) $(wildcard $(HOME)/.pyenv/versions/$(v).*/bin/python)); do $(call is_one_of,$$p,$(1)) && { echo $$p; break; }; done)
# The Pythons that create the virtual environments (PYTHON=... and REFERENCE_PYTHON=... choose).
ifndef PYTHON
PYTHON := $(call find_python,$(PYTHON_VERSIONS_$(BACKEND)))
endif
ifndef REFERENCE_PYTHON
REFERENCE_PYTHON := $(call find_python,$(PYTHON_VERSIONS_reference))
endif
# Recipe lines that create the virtual environment $(1) for requirements-$(2).txt with the Python named
# by the variable $(3), or say in one line why they cannot. A venv that fails half-way (Debian's python3
# without its python3.X-venv package leaves one with a python and no pip) is removed: kept, the next
# make would take it for made and fail in pip. So is one that a stopped make left without pip (Ctrl-C
# during the seconds of `-m venv`, where the removal above does not run): found by the next make.
# `-m venv` runs in a temporary folder of its own (TMPDIR), removed after it: the ensurepip of Python 3.8
# and 3.9 leaves a copy of pip's CA bundle (275 KB) in the temporary folder at every environment made.
define make_venv
	@test -x $(1)/bin/python && ! $(1)/bin/python -m pip --version >/dev/null 2>&1 && { echo "$(1) has no pip: an earlier make stopped while making it; removing it to make it again"; rm -rf $(1); }; true
	@test -x $(1)/bin/python || $(call is_one_of,$($(3)),$(PYTHON_VERSIONS_$(2))) || { echo "error: requirements-$(2).txt needs Python $(PYTHON_VERSIONS_$(2)) (the versions its TensorFlow or PyTorch has wheels for), and $(if $($(3)),$(3)=$($(3)) is $$($($(3)) -V 2>&1),none of them was found: python3 is $$(python3 -V 2>&1 || echo missing)); install one (your system's python$(firstword $(PYTHON_VERSIONS_$(2))) package, or pyenv install $(firstword $(PYTHON_VERSIONS_$(2)))), or name it: make $(3)=/path/to/python3.X" >&2; exit 1; }
	@test -x $(1)/bin/python || { echo "$($(3)) -m venv $(1)"; ( tmp=$$(mktemp -d) && TMPDIR=$$tmp $($(3)) -m venv $(1); status=$$?; rm -rf "$$tmp"; exit $$status ); } || { rm -rf $(1); echo "error: $($(3)) -m venv $(1) failed (its reason above); the partial $(1) was removed, so that make can run again once that is fixed" >&2; exit 1; }
	@$(call is_one_of,$(1)/bin/python,$(PYTHON_VERSIONS_$(2))) || { echo "error: $(1) has $$($(1)/bin/python -V 2>&1), but requirements-$(2).txt needs Python $(PYTHON_VERSIONS_$(2)): remove it (rm -rf $(1)) and run make again" >&2; exit 1; }
endef

# bash with pipefail: a recipe that pipes pip's output still fails when pip does.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
# pip warns once per package about each index location of the machine's pip configuration that does not
# exist ("WARNING: Location 'file:///...' is ignored: it is neither a file nor a directory"): about 90
# lines on a first install here. They are counted into one line; everything else pip prints is kept.
PIP_INSTALL = @echo '$(1)/bin/python -m pip install --quiet --no-compile $(2)'; $(1)/bin/python -m pip install --quiet --no-compile $(2) 2>&1 | awk '/^WARNING: Location .* is ignored: it is neither a file nor a directory/ {n++; next} {print; fflush()} END {if (n) printf "pip: left out %d warning%s that an index location of the pip configuration does not exist (pip config list shows them)\n", n, (n == 1 ? "" : "s")}'
# pip byte-compiles what it installs one file at a time, about half the install time (figures in
# docs/performance.md). So it installs without (--no-compile above), and then compileall writes
# the same bytecode files on every core (-j 0), skipping files already compiled. Done at install, not
# left to Python's first imports: with PYTHONDONTWRITEBYTECODE set, each process would compile again.
# Files that are not Python of this version (PyTorch ships tests in 3.12 syntax) are skipped silently
# (-qq), as pip skips them; so compileall's status, 1 for those, is not make's. The compiler's warnings
# about the packages' code (TensorFlow 2.6's `'loss' is None`) are left out (-W ignore), as pip does.
COMPILE_VENV = @echo 'compiling the modules of $(1) on every core'; $(1)/bin/python -W ignore -m compileall -qq -j 0 "$$($(1)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true

.PHONY: help install installed-venv installed-reference-venv run test test-environments test-unit test-slurm test-tf26 bench bench-reference parity print-python clean
.DEFAULT_GOAL := help

help:
	@echo "make run          install into $(VENV) (first time), then train the main job on the built-in data"
	@echo "                  (RUN_ARGS=\"--epochs=6\" passes flags to main.py)"
	@echo "make test         install, then the test suite (about 4 to 9 minutes on 2 cores)"
	@echo "make install      only the environment: $(VENV) with TensorFlow ($(BACKEND) build) and requirements.txt"
	@echo "make test-unit    the in-process tests only (under a minute)"
	@echo "make test-slurm   the job scripts on a real one-node Slurm on this machine"
	@echo "make test-tf26    the tests on Python 3.8 with TensorFlow 2.6.3, the Poplar SDK's versions"
	@echo "make bench        training, inference and start-up figures beside the reference PyTorch model"
	@echo "make parity       learning parity with the reference PyTorch code (3 seeds)"
	@echo "make clean        remove the environments"
	@echo "Variables: BACKEND=cpu|gpu|tf26, PYTHON=/path/to/python3.X, TEST_WORKERS=N; README.md has the rest."

# One install into an environment at a time. `make run` and `make test` started together in a fresh clone
# would otherwise both create .venv and run pip in it: the second would fail at once ("No module named
# pip", the venv being half made). The other make waits, then finds the environment made. $(1) is the
# environment, $(2) the target that makes it. The lock is the file $(1).lock, held by the shell that runs
# the inner make (descriptor 9), so it goes when that ends however it ends. Without flock (util-linux),
# and in a dry run (make -n), no lock.
one_install_at_a_time = $(if $(findstring n,$(firstword -$(MAKEFLAGS))),,if command -v flock >/dev/null; then exec 9>"$(1).lock" && { flock -n 9 || { echo "waiting for the other make that is installing into $(1)"; flock 9; }; }; fi;) $(MAKE) --no-print-directory -f $(firstword $(MAKEFILE_LIST)) $(2)

# What the quiet pip install of each BACKEND takes on a fresh machine, said before it starts (cpu and tf26
# measured on 2-core VMs; gpu adds NVIDIA's CUDA wheels, a few GB, and was not measured here).
INSTALL_TIME_cpu := about 1-2 minutes
INSTALL_TIME_tf26 := about 1-2 minutes
INSTALL_TIME_gpu := several minutes (TensorFlow's CUDA libraries are a few GB)

install:
	+@$(call one_install_at_a_time,$(VENV),installed-venv)

installed-venv: $(VENV)/.installed-$(BACKEND)
	@:

$(VENV)/.installed-$(BACKEND): requirements.txt requirements-$(BACKEND).txt requirements-dev.txt
	$(call make_venv,$(VENV),$(BACKEND),PYTHON)
	@for marker in $(VENV)/.installed-*; do other=$${marker##*/.installed-}; [ -e "$$marker" ] && [ "$$other" != $(BACKEND) ] && { echo "error: $(VENV) holds the TensorFlow of BACKEND=$$other, which that of BACKEND=$(BACKEND) would overwrite: remove it (rm -rf $(VENV)) and run make again, or name another folder with VENV=" >&2; exit 1; }; done; true
	$(call PIP_INSTALL,$(VENV),--upgrade "pip<25")
	@echo "pip installs TensorFlow and the rest quietly: $(INSTALL_TIME_$(BACKEND)) on a fresh machine"
	$(call PIP_INSTALL,$(VENV),-r requirements-$(BACKEND).txt -r requirements.txt -r requirements-dev.txt)
	$(call COMPILE_VENV,$(VENV))
	touch $@

# `make -C <clone> run` leaves the user's shell in its own folder, which make receives as PWD, and bash
# (SHELL) resets PWD to the clone: given back, it has main.py print whole paths in the commands it
# suggests at its end (errors.shown_path), which relative ones would not work there. The folder is
# quoted for the shell (a ' in it becomes '\''), and compared whole, spaces included.
from_shell_folder = $(if $(subst $(CURDIR),,$(PWD)),PWD='$(subst ','\'',$(PWD))' )

run: install
	$(from_shell_folder)$(PY) main.py --model=neuron_inverter --replicas=4 $(RUN_ARGS)

# The tests need both environments. They are made side by side (-j2): each pip installs on one core.
test: test-environments
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

test-environments:
	+@$(MAKE) --no-print-directory -j2 install bench-reference

# The fast tier: everything but tests/e2e (which runs main.py and the tools as processes, as a user does).
test-unit: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --ignore=tests/e2e

# The job scripts on a real one-node Slurm on localhost (tools/slurm/local_cluster.sh), which it installs
# with apt-get when missing (root). Where it cannot, one line says the Slurm tests did not run.
test-slurm: install
	@reason=$$(tools/slurm/local_cluster.sh install 2>&1) || { echo "test-slurm: the Slurm tests did NOT run: $$(echo "$$reason" | tail -1)"; exit 0; }
	$(PY) -m pytest -q -m slurm tests/e2e/test_slurm.py

# The reference PyTorch model for side-by-side benchmarks, in an environment of its own.
bench-reference:
	+@$(call one_install_at_a_time,$(REFERENCE_VENV),installed-reference-venv)

installed-reference-venv: $(REFERENCE_VENV)/.installed
	@:

$(REFERENCE_VENV)/.installed: requirements-reference.txt
	$(call make_venv,$(REFERENCE_VENV),reference,REFERENCE_PYTHON)
	@echo "pip installs the reference model's PyTorch (CPU build) quietly: about a minute on a fresh machine"
	$(call PIP_INSTALL,$(REFERENCE_VENV),-r requirements-reference.txt)
	$(call COMPILE_VENV,$(REFERENCE_VENV))
	touch $@

# Training, inference, input and compile figures beside the reference (docs/performance.md, "Training
# speed against the reference").
bench: install bench-reference
	$(PY) tools/benchmark.py --reference_python=$(REFERENCE_VENV)/bin/python $(BENCH_ARGS)

# Learning parity with the reference PyTorch code: both trained on one slice of the data, 3 seeds
# (tools/parity.py; the report goes to parity/parity.md and parity/parity.png).
parity: install bench-reference
	$(PY) tools/parity.py --reference_python=$(REFERENCE_VENV)/bin/python $(PARITY_ARGS)

test-tf26:
	$(MAKE) test BACKEND=tf26

# The Python that `make install` would create the environment with for BACKEND (empty: none found).
print-python:
	@echo $(PYTHON)

clean:
	rm -rf .venv .venv-gpu .venv-tf26 $(REFERENCE_VENV) .venv*.lock .pytest_cache
