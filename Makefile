# The two commands (see README): `make demo` and `make test`.
# Both create .venv in the repo if missing and install kernforge with torch==2.13.0
# (the CPU build; any other torch spec would pull gigabytes of CUDA packages).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kernforge-installed

.PHONY: demo test bench

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0 -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) benchmarks/bench_ops.py
	$(PY) benchmarks/bench_sampling.py
