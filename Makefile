# The two commands (see README): `make demo` and `make test`.
# Both create .venv in the repo if missing and install kernforge with torch==2.13.0
# (the CPU build; any other torch spec would pull gigabytes of CUDA packages).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kernforge-installed

.PHONY: demo test test-fast bench

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0 -e '.[test,transformers]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q tests

# Local iteration: no multi-process or long tests (-m "not slow"), kernels kept between runs in a
# private cache (--reuse-cache). CI runs `make test`, which runs everything.
test-fast: $(STAMP)
	$(PY) -m pytest -q tests -m "not slow" --reuse-cache

bench: $(STAMP)
	$(PY) benchmarks/bench_ops.py
	$(PY) benchmarks/bench_sampling.py
