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

.PHONY: install demo test lint bench clean browser slurm compat

install: $(STAMP)

$(STAMP): requirements/cpu.txt pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements/cpu.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -e .
	$(PY) -m robust_plugins.cli.main prebuild
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/robust demo

# The report's browser test (tests/_browser.py) needs Debian's chromium: installed here when it is
# missing, from the package registry only, bounded; without root or apt the test fails and says so.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  timeout 900 sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium'; } || \
	  echo "make: chromium is not installed and could not be installed here (needs root + apt-get)."

# The SLURM tests (tests/_slurm.py) need Debian's slurm-wlm and munge: installed here when missing,
# from the package registry only, bounded; without root or apt-get the tests skip and say why.
slurm:
	@{ command -v slurmctld && command -v slurmd && command -v munged; } >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  timeout 900 sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge'; } || \
	  echo "make: slurm-wlm/munge are not installed and could not be installed here (needs root + apt-get)."

# The layer contracts in pyproject.toml ([tool.importlinter]), checked on the layout the wheel
# ships: setup.py maps patches/ and recipes/ into robust_plugins, which the source tree keeps at
# the top where the import graph cannot see them. A fresh build dir: setuptools would otherwise
# ship stale copies of deleted modules from build/lib.
LINT_TREE := $(VENV)/lint-tree
lint: $(STAMP)
	rm -rf build $(LINT_TREE)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation --no-compile \
	  --target $(LINT_TREE) .
	rm -rf build
	cd $(LINT_TREE) && $(CURDIR)/$(VENV)/bin/lint-imports $(CURDIR)/pyproject.toml

# lint first: a new crossing of the boundary fails the run before any test starts.
# Three workers on 2 cores: the fault tier on one of them, a test at a time; any other file's
# tests together on one worker (they share module fixtures). Fault tests mostly wait, the others
# compute (tests/conftest.py sets the groups and priorities).
# TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 3
test: $(STAMP) browser slurm lint
	@set +e; $(PY) -m pytest -ra --durations=40 $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile) \
	  $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests: failing on purpose"; exit 1; fi; \
	exit $$rc

bench: $(STAMP)
	$(VENV)/bin/robust bench compression --write BENCHMARKS.md

# The host-version matrix (tools/compat.py): one venv per host set under COMPAT_ROOT (outside the
# repository), a test subset in each. Not part of `make test` (tens of minutes; GBs of venvs).
COMPAT_ROOT ?= /work/compat-venvs
COMPAT_SETS ?=
compat:
	$(PYTHON) tools/compat.py --root $(COMPAT_ROOT) $(COMPAT_SETS)

clean:
	rm -rf $(VENV) build *.egg-info runs
