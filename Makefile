# The two commands (see README): `make demo` and `make test`.
# Both create .venv in the repo if missing and install kernforge with torch==2.13.0
# (the CPU build; any other torch spec would pull gigabytes of CUDA packages), every
# dependency at the version constraints.txt pins (the versions the suite passed with).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kernforge-installed
CONSTRAINTS := constraints.txt
# `make test-latest` / `make pins`: the newest releases, in an environment of their own.
LATEST := .venv-latest
LATEST_TESTS ?= tests

.PHONY: demo test test-fast bench lint format test-latest pins test-transformers
PY_SOURCES := kernforge tests benchmarks examples
CXX_HEADERS = $(shell find kernforge/templates/include tests/templates/include -name '*.h')

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) torch==2.13.0 -e '.[test,transformers,lint]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q tests

# Style: ruff (lint and format) over the Python, clang-format over the C++ headers. CI runs it.
lint: $(STAMP)
	$(VENV)/bin/ruff check $(PY_SOURCES)
	$(VENV)/bin/ruff format --check $(PY_SOURCES)
	$(VENV)/bin/clang-format --dry-run --Werror $(CXX_HEADERS)

format: $(STAMP)
	$(VENV)/bin/ruff check --fix $(PY_SOURCES)
	$(VENV)/bin/ruff format $(PY_SOURCES)
	$(VENV)/bin/clang-format -i $(CXX_HEADERS)

# Local iteration: no multi-process or long tests (-m "not slow"), kernels kept between runs in a
# private cache (--reuse-cache). CI runs `make test`, which runs everything.
test-fast: $(STAMP)
	$(PY) -m pytest -q tests -m "not slow" --reuse-cache

bench: $(STAMP)
	$(PY) benchmarks/bench_ops.py
	$(PY) benchmarks/bench_sampling.py

# The newest release of every dependency (transformers past pyproject's tested bound too), in
# .venv-latest, then the suite (LATEST_TESTS=tests/integrations/test_transformers_integration.py for a quick
# look). It writes what it installed to .venv-latest/constraints.txt.
test-latest:
	test -x $(LATEST)/bin/python || python3 -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager torch==2.13.0 -e '.[test,transformers,lint]'
	$(LATEST)/bin/python -m pip install --quiet --upgrade transformers
	$(LATEST)/bin/python -m pip freeze --exclude-editable | grep -v '^kernforge' | sed 's/^torch==2.13.0+cpu$$/torch==2.13.0/' > $(LATEST)/pins.txt
	$(LATEST)/bin/python -m pytest -q $(LATEST_TESTS)
	head -3 $(CONSTRAINTS) | cat - $(LATEST)/pins.txt > $(LATEST)/constraints.txt

# Moving the pins: the newest releases pass the whole suite, then constraints.txt takes them in
# one diff. If transformers moved past pyproject.toml's bound, raise the bound in the same diff.
pins: LATEST_TESTS = tests
pins: test-latest
	cp $(LATEST)/constraints.txt $(CONSTRAINTS)
	@grep '^transformers==' $(CONSTRAINTS) | sed 's/^/pinned /; s/$$/: check the transformers bound in pyproject.toml covers it/'

# One transformers release (TRANSFORMERS=5.0.0), in .venv-transformers-<version>: the
# integration's tests, e.g. for the lowest release pyproject.toml declares.
test-transformers:
	test -n "$(TRANSFORMERS)" || { echo "usage: make test-transformers TRANSFORMERS=<version>"; exit 2; }
	test -x .venv-transformers-$(TRANSFORMERS)/bin/python || python3 -m venv .venv-transformers-$(TRANSFORMERS)
	.venv-transformers-$(TRANSFORMERS)/bin/python -m pip install --quiet torch==2.13.0 transformers==$(TRANSFORMERS) -e '.[test]'
	.venv-transformers-$(TRANSFORMERS)/bin/python -m pytest -q tests/integrations/test_transformers_integration.py
