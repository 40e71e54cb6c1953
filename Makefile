# Set-up and everyday commands. `make run` and `make test` create the virtual environment on first use.
#   BACKEND=cpu|gpu|tf26   which TensorFlow requirements file to install (default cpu)
#   make test-tf26         the same tests on Python 3.8 + TensorFlow 2.6.3 (the Poplar SDK's versions)
PYTHON ?= python3
BACKEND ?= cpu
VENV ?= .venv
PY := $(VENV)/bin/python
RUN_ARGS ?=
REFERENCE_VENV ?= .venv-torch
# pytest-xdist workers for make test / test-unit. Alone, the suite keeps about 1.1 of 2 cores busy
# (process start-up, TensorFlow imports and Python run on one core); two workers use both. Each
# worker holds its own TensorFlow (about 1 GB).
TEST_WORKERS ?= 2
PYTHON38 ?= $(shell for p in $$HOME/.pyenv/versions/3.8*/bin/python python3.8; do $$p -c "import sys; assert sys.version_info[:2] == (3, 8)" 2>/dev/null && { echo $$p; break; }; done)

# bash with pipefail: a recipe that pipes pip's output still fails when pip does.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
# pip warns once per package about each index location of the machine's pip configuration that does not
# exist ("WARNING: Location 'file:///...' is ignored: it is neither a file nor a directory"): about 90
# lines on a first install here. They are counted into one line; everything else pip prints is kept.
PIP_INSTALL = @echo '$(1)/bin/python -m pip install --quiet $(2)'; $(1)/bin/python -m pip install --quiet $(2) 2>&1 | awk '/^WARNING: Location .* is ignored: it is neither a file nor a directory/ {n++; next} {print; fflush()} END {if (n) printf "pip: left out %d warning%s that an index location of the pip configuration does not exist (pip config list shows them)\n", n, (n == 1 ? "" : "s")}'

.PHONY: install run test test-unit test-slurm test-tf26 bench bench-reference parity print-python38 clean

install: $(VENV)/.installed-$(BACKEND)

$(VENV)/.installed-$(BACKEND): requirements.txt requirements-$(BACKEND).txt requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(call PIP_INSTALL,$(VENV),--upgrade "pip<25")
	$(call PIP_INSTALL,$(VENV),-r requirements-$(BACKEND).txt -r requirements.txt -r requirements-dev.txt)
	touch $@

run: install
	$(PY) main.py --model=neuron_inverter --replicas=4 $(RUN_ARGS)

test: install $(REFERENCE_VENV)/.installed
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

# The fast tier: everything but tests/e2e (which runs main.py and the tools as processes, as a user does).
test-unit: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --ignore=tests/e2e

# The job scripts on a real one-node Slurm on localhost (tools/slurm/local_cluster.sh), which it installs
# with apt-get when missing (root). Where it cannot, one line says the Slurm tests did not run.
test-slurm: install
	@reason=$$(tools/slurm/local_cluster.sh install 2>&1) || { echo "test-slurm: the Slurm tests did NOT run: $$(echo "$$reason" | tail -1)"; exit 0; }
	$(PY) -m pytest -q -m slurm tests/e2e/test_slurm.py

# The reference PyTorch model for side-by-side benchmarks, always on the default python3 (its wheel).
bench-reference: $(REFERENCE_VENV)/.installed

$(REFERENCE_VENV)/.installed: requirements-reference.txt
	test -x $(REFERENCE_VENV)/bin/python || python3 -m venv $(REFERENCE_VENV)
	$(call PIP_INSTALL,$(REFERENCE_VENV),-r requirements-reference.txt)
	touch $@

# Training, inference, input and compile figures beside the reference (docs/PERFORMANCE.md).
bench: install bench-reference
	$(PY) tools/benchmark.py --reference_python=$(REFERENCE_VENV)/bin/python $(BENCH_ARGS)

# Learning parity with the reference PyTorch code: both trained on one slice of the data, 3 seeds
# (tools/parity.py; the report goes to parity/parity.md and parity/parity.png).
parity: install bench-reference
	$(PY) tools/parity.py --reference_python=$(REFERENCE_VENV)/bin/python $(PARITY_ARGS)

test-tf26:
	@test -n "$(PYTHON38)" || { echo "test-tf26 needs Python 3.8 (pyenv install 3.8)"; exit 1; }
	$(MAKE) test PYTHON=$(PYTHON38) VENV=.venv-tf26 BACKEND=tf26

print-python38:
	@echo $(PYTHON38)

clean:
	rm -rf .venv .venv-tf26 $(REFERENCE_VENV) .pytest_cache
