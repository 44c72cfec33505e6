# The README's two commands: `make demo` and `make test`. Both create .venv and install into it.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# One stable place for DeepSpeed's JIT-built CPU comm op, so it is built once at install time
# (about 1-2 min) instead of again inside tests (../shared/HOSTS.md).
export TORCH_EXTENSIONS_DIR := $(CURDIR)/$(VENV)/torch_extensions
export DS_ACCELERATOR := cpu

.PHONY: install demo test bench clean

install: $(STAMP)

$(STAMP): requirements/cpu.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements/cpu.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -e .
	$(PY) -m robust_plugins.cli.main prebuild
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/robust demo

test: $(STAMP)
	@set +e; $(PY) -m pytest -ra $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests: failing on purpose"; exit 1; fi; \
	exit $$rc

bench: $(STAMP)
	$(VENV)/bin/robust bench compression --write BENCHMARKS.md

clean:
	rm -rf $(VENV) build *.egg-info runs
