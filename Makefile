# Set-up and everyday commands. `make run` and `make test` create the virtual environment on first use.
#   BACKEND=cpu|gpu|tf26   which TensorFlow requirements file to install (default cpu)
#   make test-tf26         the same tests on Python 3.8 + TensorFlow 2.6.3 (the Poplar SDK's versions)
PYTHON ?= python3
BACKEND ?= cpu
VENV ?= .venv
PY := $(VENV)/bin/python
RUN_ARGS ?=
PYTHON38 ?= $(shell for p in $$HOME/.pyenv/versions/3.8*/bin/python python3.8; do $$p -c "import sys; assert sys.version_info[:2] == (3, 8)" 2>/dev/null && { echo $$p; break; }; done)

.PHONY: install run test test-tf26 print-python38 clean

install: $(VENV)/.installed-$(BACKEND)

$(VENV)/.installed-$(BACKEND): requirements.txt requirements-$(BACKEND).txt requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip<25"
	$(PY) -m pip install --quiet -r requirements-$(BACKEND).txt -r requirements.txt -r requirements-dev.txt
	touch $@

run: install
	$(PY) main.py --model=neuron_inverter --replicas=4 $(RUN_ARGS)

test: install
	$(PY) -m pytest -q

test-tf26:
	@test -n "$(PYTHON38)" || { echo "test-tf26 needs Python 3.8 (pyenv install 3.8)"; exit 1; }
	$(MAKE) test PYTHON=$(PYTHON38) VENV=.venv-tf26 BACKEND=tf26

print-python38:
	@echo $(PYTHON38)

clean:
	rm -rf .venv .venv-tf26 .pytest_cache
