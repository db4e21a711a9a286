"""Pre-warming the cache and the ``python -m kernforge`` command line.

Builds use the test module ``AXPY`` (tests/kernels.py, template
``tests/templates/axpy.cpp.jinja``), named ``axpy`` in manifests. The CLI runs as a
real subprocess (``python -m kernforge``); a user module is named there as
``kernels:AXPY``, importable from the child through ``PYTHONPATH``, with
``--template-dir tests/templates``.
"""

from __future__ import annotations

import importlib
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernforge
from kernforge import cli, tune
from kernforge.cache import disk
from kernforge.jit import core, isa, render, tuning
from kernforge.model_spec import ModelSpec
from kernforge.ops.attention import prefill

from conftest import TEST_TEMPLATES, TESTS_DIR, clean_env
from kernels import AXPY

prewarm = importlib.import_module("kernforge.prewarm")  # the module (``kernforge.prewarm`` is the function)

LLAMA = {
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
}
GEMMA2 = {
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "hidden_activation": "gelu_pytorch_tanh",
    "torch_dtype": "bfloat16",
    "model_type": "gemma2",
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
}


pytestmark = pytest.mark.usefixtures("test_templates")


def axpy_manifest(*dtypes, **extra) -> dict:
    return {**extra, "kernels": [{"module": "axpy", "params": {"dtype": d}} for d in dtypes]}


def entry_keys(root: Path) -> list[str]:
    return [entry.key for entry, meta in disk.entries(root) if meta is not None]


# --------------------------------------------------------------------------- prewarm()


def _timing_compiler(tmp_path: Path, log: Path) -> Path:
    """g++ behind a wrapper that logs when each compile starts and ends (and takes >= 0.6 s)."""
    gxx = shutil.which("g++")
    script = tmp_path / "timed-g++"
    script.write_text(f"""#!/bin/sh
[ "$1" = "--version" ] && exec {shlex.quote(gxx)} "$@"
echo "start $$ $(date +%s.%N)" >> {shlex.quote(str(log))}
sleep 0.6
{shlex.quote(gxx)} "$@"; rc=$?
echo "end $$ $(date +%s.%N)" >> {shlex.quote(str(log))}
exit $rc
""")
    script.chmod(0o755)
    return script


def _intervals(log: Path) -> list[tuple[float, float]]:
    times: dict[str, dict[str, float]] = {}
    for line in log.read_text().splitlines() if log.exists() else []:
        what, pid, when = line.split()
        times.setdefault(pid, {})[what] = float(when)
    return [(t["start"], t["end"]) for t in times.values()]


def test_prewarm_builds_in_parallel_then_compiles_nothing(cache, tmp_path, monkeypatch, capsys):
    log = tmp_path / "compiles.log"
    monkeypatch.setenv("KERNFORGE_CXX", str(_timing_compiler(tmp_path, log)))
    manifest = axpy_manifest("fp32", "fp64", isa="generic")

    first = kernforge.prewarm(manifest, jobs=2, progress=False)
    assert sorted(r.spec.params for r in first) == [(("dtype", "fp32"),), (("dtype", "fp64"),)]
    assert all(r.compiled and r.spec.tier == "generic" for r in first)
    assert sorted(entry_keys(cache)) == sorted(r.key for r in first)
    spans = _intervals(log)
    assert len(spans) == 2
    assert max(s for s, _ in spans) < min(e for _, e in spans), f"the two compiles did not overlap: {spans}"

    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(manifest))
    capsys.readouterr()
    second = kernforge.prewarm(str(path), jobs=2, progress=True)  # a manifest file this time
    assert [r.compiled for r in second] == [False, False]
    assert [r.key for r in second] == [r.key for r in first]
    assert len(_intervals(log)) == 2, "the second prewarm ran the compiler"
    assert "prewarm done: 0 compiled, 2 already cached" in capsys.readouterr().err


def test_prewarm_results_load_and_run(cache):
    (result,) = kernforge.prewarm(axpy_manifest("i64"), isa_tier="generic", progress=False)
    assert result.compiled
    loaded, kernel = core.build(result.spec)
    assert not loaded.compiled
    import torch

    x, y = torch.arange(5, dtype=torch.int64), torch.ones(5, dtype=torch.int64)
    kernel.call("run", x=x.data_ptr(), y=y.data_ptr(), n=5, a=3.0)
    assert y.tolist() == [1, 4, 7, 10, 13]


def test_prewarm_default_tier_is_the_selected_tier(cache):
    (result,) = kernforge.prewarm(axpy_manifest("fp32"), progress=False)
    assert result.spec.tier == isa.selected_tier()


def test_prewarm_same_variant_from_two_threads_compiles_once(cache):
    spec = core.KernelSpec.make(AXPY, {"dtype": "fp32"}, "generic")
    results = kernforge.prewarm([spec, spec, spec], jobs=3, progress=False)
    assert sorted(r.compiled for r in results) == [False, False, True]
    assert len({r.key for r in results}) == 1


def test_prewarm_cross_builds_a_tier_this_cpu_lacks(cache, monkeypatch):
    if "amx" in isa.runnable_tiers():
        pytest.skip("this CPU runs amx; nothing to cross-build")
    (result,) = kernforge.prewarm(axpy_manifest("fp32"), isa_tier="amx", progress=False)
    assert result.compiled and result.spec.tier == "amx"
    meta = disk.Entry(cache, result.key).trusted_meta()
    assert meta is not None and "amx_tile" in meta["requires"]


def test_prewarm_op_form(cache):
    if not (render.PACKAGE_TEMPLATES / "norm.cpp.jinja").is_file():
        pytest.skip("the norm template is not there yet")
    (result,) = kernforge.prewarm(
        {"kernels": [{"op": "rmsnorm", "dtype": "bfloat16"}]}, isa_tier="generic", progress=False
    )
    assert result.compiled
    assert result.spec == core.KernelSpec.make("norm", {"dtype": "bf16", "fused_add": False, "gemma": False}, "generic")


def test_specs_from_manifest_expands_and_dedups():
    specs = prewarm.specs_from_manifest(
        {
            "kernels": [
                {"op": "rmsnorm", "dtype": ["bfloat16", "fp16", "bf16"]},
                {"op": "silu_and_mul", "dtype": "float32"},
                {"module": "axpy", "params": {"dtype": "fp32"}},
                {"module": "kernels:AXPY", "params": {"dtype": "fp32"}},  # the same module, by import path
            ]
        },
        tier="avx2",
    )
    assert [(s.template, dict(s.params).get("dtype"), s.tier) for s in specs] == [
        ("norm.cpp.jinja", "bf16", "avx2"),
        ("norm.cpp.jinja", "fp16", "avx2"),
        ("activation.cpp.jinja", "fp32", "avx2"),
        (AXPY.template, "fp32", "avx2"),
    ]


@pytest.mark.parametrize(
    "item, match",
    [
        ({"dtype": "bf16"}, "needs an 'op' or a 'module'"),
        ({"op": "layernorm", "dtype": "bf16"}, "unknown op 'layernorm'"),
        ({"module": "layernorm", "params": {}}, "unknown kernel module 'layernorm'"),
        ({"module": "axpy", "params": {"dtype": "fp16"}}, "axpy: parameter dtype must be one of fp32, fp64, i64"),
        ({"module": "axpy", "params": {}}, "axpy: parameter 'dtype' is missing"),
        ({"module": "kernels:NO_SUCH", "params": {}}, "kernels:NO_SUCH is not a kernforge Module"),
        ({"module": "no_such_package.kernels:AXPY", "params": {}}, "cannot import 'no_such_package.kernels'"),
    ],
    ids=[
        "no-op-or-module",
        "unknown-op",
        "unknown-module",
        "bad-param",
        "missing-param",
        "not-a-module",
        "not-importable",
    ],
)
def test_bad_manifest_entries_are_rejected(item, match):
    with pytest.raises(ValueError, match=match):
        prewarm.specs_from_manifest({"kernels": [item]}, tier="generic")


def test_prewarm_of_a_broken_template_raises(cache):
    with pytest.raises(kernforge.KernelCompileError, match="kf_undeclared_identifier_generic"):
        kernforge.prewarm({"kernels": [{"module": "broken"}]}, isa_tier="generic", progress=False)


# --------------------------------------------------------------------------- model configs

# Every model samples: the manifest adds the fp32-probs sampler whatever the model's dtype.
SAMPLER = {"op": "top_k_top_p_sampling_from_probs", "dtype": "fp32"}


ATTENTION_OPS = [
    {"op": op, "dtype": "bfloat16"}
    for op in ("apply_rope_with_cos_sin_cache_inplace", "apply_rope_pos_ids_inplace", "append_paged_kv_cache")
]


def decode_entry(kv_dtype: str, head_dim: int, group: int) -> dict:
    return {
        "module": "decode",
        "params": {"q_dtype": "bf16", "kv_dtype": kv_dtype, "out_dtype": "bf16", "head_dim": head_dim, "group": group},
    }


def prefill_entry(kv_dtype: str, head_dim: int) -> dict:
    return {
        "module": "prefill",
        "params": {
            "q_dtype": "bf16",
            "kv_dtype": kv_dtype,
            "out_dtype": "bf16",
            "head_dim_qk": head_dim,
            "head_dim_vo": head_dim,
            "tile": list(prefill.TILES[0]),
        },
    }


def test_tune_prefill_records_the_winner_where_plan_finds_it(cache):
    """A fake measure makes the (32, 64) tile fastest by far: tune_prefill records it and plan()
    then builds that variant; a 1% win does not displace the default."""
    fast = prefill.TILES[1]
    results = tune.tune_prefill(
        [(64, 64)], [2], length=40, measure=lambda tile, run: (run(), 1.0 if tile == fast else 2.0)[1]
    )
    assert results[0]["tile"] == fast and results[0]["default"] == prefill.TILES[0]
    params = prefill.prefill_variant_params(torch.bfloat16, torch.bfloat16, torch.bfloat16, 64, 64, 2)
    assert params["tile"] == fast
    results = tune.tune_prefill([(64, 64)], [2], length=40, measure=lambda tile, run: 0.99 if tile == fast else 1.0)
    assert results[0]["tile"] == prefill.TILES[0]


def _unordered(kernels) -> list[str]:
    """A manifest's kernels as a sorted list (the families add theirs in import order)."""
    return sorted(json.dumps(k, sort_keys=True) for k in kernels)


def test_manifest_from_llama_config():
    manifest = prewarm.manifest_from_model_config(LLAMA)
    gemms = [k for k in manifest["kernels"] if k.get("module") == "gemm"]
    assert _unordered(manifest["kernels"]) == _unordered(
        [
            {"op": "rmsnorm", "dtype": "bfloat16"},
            {"op": "fused_add_rmsnorm", "dtype": "bfloat16"},
            {"op": "silu_and_mul", "dtype": "bfloat16"},
            *ATTENTION_OPS,
            decode_entry("bf16", head_dim=128, group=4),  # hidden / heads, heads / KV heads
            prefill_entry("bf16", head_dim=128),
            SAMPLER,
            {"op": "top_k_top_p_sampling_from_logits", "dtype": "bfloat16"},
            *gemms,
        ]
    )
    assert len(gemms) >= 1
    assert manifest["model"]["hidden_size"] == 4096 and manifest["model"]["intermediate_size"] == 11008


def test_manifest_builds_decode_for_each_kv_cache_dtype_and_mqa():
    mqa = {**LLAMA, "num_key_value_heads": 1}
    decodes = [
        k for k in prewarm.manifest_from_model_config(mqa, ("float8_e4m3fn",))["kernels"] if k.get("module") == "decode"
    ]
    assert decodes == [decode_entry("bf16", 128, group=0), decode_entry("fp8_e4m3", 128, group=0)]  # group 32: runtime
    specs = prewarm.specs_from_manifest({"kernels": decodes}, tier="generic")
    assert [dict(s.params)["kv_dtype"] for s in specs] == ["bf16", "fp8_e4m3"]
    assert decodes == [
        k for k in prewarm.manifest_from_model_config(mqa, ("fp8_e4m3",))["kernels"] if k.get("module") == "decode"
    ]
    for head_dim in (0, 513, 7.5):
        with pytest.raises(ValueError, match=r"head_dim must be an int in \[1, 512\]"):
            prewarm.manifest_from_model_config({**LLAMA, "head_dim": head_dim})
    for head_dim in (1, 13, 72):  # any head_dim decode has a kernel for
        decodes = [
            k
            for k in prewarm.manifest_from_model_config({**LLAMA, "head_dim": head_dim})["kernels"]
            if k.get("module") == "decode"
        ]
        assert decodes == [decode_entry("bf16", head_dim, group=4)]
        assert [
            dict(s.params)["head_dim"] for s in prewarm.specs_from_manifest({"kernels": decodes}, tier="generic")
        ] == [head_dim]


def test_manifest_from_gemma2_config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GEMMA2))
    manifest = prewarm.manifest_from_model_config(path)
    model_kernels = [
        k
        for k in manifest["kernels"]
        if k != SAMPLER and k not in ATTENTION_OPS and "op" in k and k["op"] != "top_k_top_p_sampling_from_logits"
    ]
    assert {k["op"] for k in model_kernels} == {"gemma_rmsnorm", "gemma_fused_add_rmsnorm", "gelu_tanh_and_mul"}
    assert {k["dtype"] for k in model_kernels} == {"bfloat16"}
    assert decode_entry("bf16", head_dim=256, group=2) in manifest["kernels"]  # config's head_dim wins
    specs = prewarm.specs_from_manifest(manifest, tier="generic")
    assert {(s.template, dict(s.params).get("gemma")) for s in specs} >= {("norm.cpp.jinja", True)}
    assert {
        dict(s.params).get("dtype", dict(s.params).get("q_dtype")) for s in specs if s.template != "sampling.cpp.jinja"
    } == {"bf16"}


def test_manifest_from_multimodal_config_reads_the_text_config():
    config = {"model_type": "gemma3", "text_config": {**GEMMA2, "model_type": "gemma3_text"}}
    ops = [k["op"] for k in prewarm.manifest_from_model_config(config)["kernels"] if "op" in k]
    assert sorted(ops) == sorted(
        [
            "gemma_rmsnorm",
            "gemma_fused_add_rmsnorm",
            "gelu_tanh_and_mul",
            *(k["op"] for k in ATTENTION_OPS),
            SAMPLER["op"],
            "top_k_top_p_sampling_from_logits",
        ]
    )


@pytest.mark.parametrize(
    "change, match",
    [
        ({"hidden_act": "relu2"}, "activation 'relu2'"),
        ({"hidden_size": None}, "hidden_size"),
        ({"hidden_size": "4096"}, "hidden_size"),
        ({"intermediate_size": 0}, "intermediate_size"),
        ({"num_attention_heads": None}, "num_attention_heads"),
        ({"num_key_value_heads": 5}, "num_key_value_heads"),
    ],
    ids=[
        "unknown-activation",
        "no-hidden-size",
        "string-hidden-size",
        "zero-intermediate",
        "no-heads",
        "kv-heads-not-dividing",
    ],
)
def test_bad_model_config_raises_value_error(change, match):
    config = {k: v for k, v in {**LLAMA, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        prewarm.manifest_from_model_config(config)


def test_manifest_records_the_linear_shapes():
    assert prewarm.manifest_from_model_config({**LLAMA, "vocab_size": 32000})["model"]["linear_shapes"] == {
        "qkv_proj": [6144, 4096],
        "o_proj": [4096, 4096],
        "gate_up_proj": [22016, 4096],
        "down_proj": [4096, 11008],
        "lm_head": [32000, 4096],
    }
    shapes = prewarm.manifest_from_model_config(GEMMA2)["model"]["linear_shapes"]  # 8 heads x 256 != 2304
    assert shapes["qkv_proj"] == [4096, 2304] and shapes["o_proj"] == [2304, 2048] and "lm_head" not in shapes


def test_manifest_builds_the_gemm_variants_dispatch_picks(fresh_gemm_choices):
    """For every linear shape and row bucket, the GEMM variant weight_packed_linear would run is in
    the manifest (the default here; a tuned record changes it), and int8 adds the w8a8 module."""
    gemm = fresh_gemm_choices
    manifest = prewarm.manifest_from_model_config(TINY)
    built = {s for s in prewarm.specs_from_manifest(manifest) if s.template == "gemm.cpp.jinja"}
    for n, k in TINY_NK:
        for m in (1, 2, 3, 16, 100, 1024, 5000):
            assert gemm._chosen_variant(torch.bfloat16, m, n, k).spec(isa.selected_tier()) in built
    modules = [k.get("module") for k in prewarm.manifest_from_model_config(TINY, quant="int8")["kernels"]]
    assert "gemm_int8" in modules and "gemm_int8" not in [k.get("module") for k in manifest["kernels"]]


# --------------------------------------------------------------------------- tuning a model's linear layers

TINY = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
TINY_NK = [(128, 64), (64, 64), (192, 64), (64, 96)]  # q|k|v, o, gate+up, down: each tuned once


@pytest.fixture
def fresh_gemm_choices(cache):
    """A fresh tuning store; dispatch forgets its choices before and after."""
    from kernforge.ops.gemm import bf16

    bf16.reset_tile_choices()
    yield bf16
    bf16.reset_tile_choices()


def test_tune_model_linears_records_winners_that_dispatch_finds(fresh_gemm_choices):
    gemm, timed = fresh_gemm_choices, []

    def fake_timer(config, run):  # no timing in tests: the one-row reference "wins"
        timed.append(config)
        return 0.5 if config["tile"] == (1, 16) else 1.0

    results = prewarm.tune_model_linears(TINY, [1, 3], measure=fake_timer)
    assert [(r["n"], r["k"], r["m"]) for r in results] == [(n, k, m) for n, k in TINY_NK for m in (1, 3)]
    assert {r["dtype"] for r in results} == {"bf16"} and len(timed) > len(results)
    import torch

    for n, k in TINY_NK:
        for m in (1, 3):
            assert gemm._chosen_variant(torch.bfloat16, m, n, k).params["tile"] == (1, 16)
        assert gemm._chosen_variant(torch.bfloat16, 5, n, k).params["tile"] != (1, 16)  # bucket 8: not tuned


def test_cli_prewarm_tune_builds_then_tunes_the_model(fresh_gemm_choices, tmp_path, monkeypatch, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    built = []
    monkeypatch.setattr(prewarm, "prewarm", lambda manifest, **kw: built.append(manifest))  # no compiles here
    monkeypatch.setattr(tuning, "time_call", lambda run: 1.0)  # nor timing (GEMM and prefill): the defaults win
    assert cli.main(["prewarm", "--model-config", str(path), "--tune", "--tune-m", "1", "16"]) == 0
    assert built == [prewarm.manifest_from_model_config(TINY)]
    out = capsys.readouterr().out
    assert "bf16 m=16 (bucket 16) n=192 k=64" in out and "recorded in" in out
    records = json.loads((disk.cache_root() / "tuning" / "weight_packed_linear.json").read_text())
    assert sorted(r["bucket"] for r in records.values()) == sorted(
        f"bf16_m{m}_n{n}_k{k}" for n, k in TINY_NK for m in (1, 16)
    )


def test_cli_tune_flag_needs_a_model_config(capsys):
    assert cli.main(["prewarm", "--op", "rmsnorm", "--tune"]) == 1
    assert "--tune times a model's linear and attention shapes: it needs --model-config" in capsys.readouterr().err


# --------------------------------------------------------------------------- the CLI in-process


def test_cli_print_manifest_from_model_config(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    assert cli.main(["prewarm", "--model-config", str(path), "--print-manifest"]) == 0
    assert json.loads(capsys.readouterr().out) == prewarm.manifest_from_model_config(LLAMA)


def test_cli_print_manifest_for_ops(capsys):
    assert cli.main(["prewarm", "--op", "rmsnorm", "--op", "silu_and_mul", "--dtype", "bf16", "--print-manifest"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "kernels": [{"op": "rmsnorm", "dtype": ["bf16"]}, {"op": "silu_and_mul", "dtype": ["bf16"]}]
    }


def test_cli_param_needs_name_value(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["prewarm", "--module", "axpy", "--param", "dtype"])
    assert info.value.code == 2
    assert "NAME=VALUE" in capsys.readouterr().err


@pytest.mark.parametrize(
    "module, message",
    [
        ("no_such", "unknown kernel module 'no_such'"),
        ("no_such_package.kernels:AXPY", "cannot import 'no_such_package.kernels'"),
        ("kernels:NO_SUCH", "kernels:NO_SUCH is not a kernforge Module"),
    ],
    ids=["unknown-name", "not-importable", "not-a-module"],
)
def test_cli_unknown_module_is_an_error(cache, capsys, module, message):
    assert cli.main(["prewarm", "--module", module, "--isa", "generic"]) == 1
    assert re.search(rf"kernforge: error: .*{re.escape(message)}", capsys.readouterr().err)


def test_cli_module_with_a_missing_template_is_an_error(cache, capsys, monkeypatch):
    monkeypatch.setattr(render, "_user_dirs", [])  # tests/templates off the search path
    assert cli.main(["prewarm", "--module", "axpy", "--param", "dtype=fp32", "--isa", "generic"]) == 1
    assert re.search(r"kernforge: error: .*axpy.cpp.jinja.*not found", capsys.readouterr().err)


def test_cli_bad_model_config_is_an_error(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, "hidden_act": "relu2"}))
    assert cli.main(["prewarm", "--model-config", str(path)]) == 1
    assert "kernforge: error:" in capsys.readouterr().err


def test_not_cached_hint_is_a_working_command(cache, monkeypatch):
    """The command KernelNotCachedError suggests builds exactly the missing variant."""
    spec = core.KernelSpec.make(AXPY, {"dtype": "fp64"}, "generic")
    monkeypatch.setenv("KERNFORGE_JIT", "0")
    with pytest.raises(kernforge.KernelNotCachedError) as info:
        core.build(spec)
    hint = str(info.value).split("build it first with: ", 1)[1]
    argv = shlex.split(hint)
    assert argv[:3] == ["python", "-m", "kernforge"]
    monkeypatch.delenv("KERNFORGE_JIT")
    assert cli.main(argv[3:]) == 0
    monkeypatch.setenv("KERNFORGE_JIT", "0")
    result, fn = core.build(spec)
    assert not result.compiled and fn is not None


def test_prewarm_compiles_even_when_jit_is_disabled(cache, monkeypatch):
    monkeypatch.setenv("KERNFORGE_JIT", "0")
    (result,) = kernforge.prewarm(axpy_manifest("fp32"), isa_tier="generic", progress=False)
    assert result.compiled


# --------------------------------------------------------------------------- the CLI in a subprocess


def run_cli(cache_root: Path, *args: str, **env) -> subprocess.CompletedProcess:
    """``python -m kernforge ARGS`` in a new process (each imports torch: these tests are slow)."""
    env = clean_env(KERNFORGE_CACHE_DIR=cache_root, **env)
    return subprocess.run(
        [sys.executable, "-m", "kernforge", *args], env=env, capture_output=True, text=True, timeout=180
    )


def assert_rc0(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"rc {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


@pytest.mark.slow
def test_cli_prewarm_module_with_params(cache):
    spec = core.KernelSpec.make(AXPY, {"dtype": "fp32"}, "generic")
    key = core._plan(spec).key
    proc = run_cli(
        cache,
        "prewarm",
        "--module",
        "kernels:AXPY",
        "--template-dir",
        str(TEST_TEMPLATES),
        "--param",
        "dtype=fp32",
        "--isa",
        "generic",
        "--jobs",
        "2",
        PYTHONPATH=TESTS_DIR,
    )
    assert_rc0(proc)
    assert f"kernforge: compiling {key} ..." in proc.stderr
    assert "prewarm done: 1 compiled, 0 already cached" in proc.stderr
    assert entry_keys(cache) == [key]
    result, fn = core.build(spec)  # usable here, without compiling
    assert not result.compiled and fn is not None


@pytest.mark.slow
def test_cli_list(cache):
    (result,) = kernforge.prewarm(axpy_manifest("fp32"), isa_tier="generic", progress=False)
    incomplete = cache / "axpy_dtype-fp64_generic-00000000000000000000"
    incomplete.mkdir(mode=0o700)
    (incomplete / "kernel.so").write_bytes(b"\x7fELF half")
    proc = run_cli(cache, "list")
    assert_rc0(proc)
    lines = proc.stdout.splitlines()
    assert len(lines) == 2, proc.stdout
    assert re.match(rf"{re.escape(result.key)}\s+[\d.]+ KiB\s+compiled in [\d.]+ s$", lines[0]), lines[0]
    assert lines[1] == f"{incomplete.name}  (incomplete: will be rebuilt)"


@pytest.mark.slow
def test_cli_info(cache):
    kernforge.prewarm(axpy_manifest("fp32", "fp64"), isa_tier="generic", progress=False)
    core.build(core.KernelSpec.make(core.CPU_PROBE, {}, "generic"), load=False)  # info probes the CPU
    (cache / "axpy_dtype-i64_generic-00000000000000000000").mkdir(mode=0o700)
    proc = run_cli(cache, "info")
    assert_rc0(proc)
    fields = dict(re.findall(r"^([a-z ]+):\s+(.*)$", proc.stdout, re.MULTILINE))
    assert fields["cache dir"] == str(cache)
    assert fields["cache entries"] == "3 ready, 1 incomplete"
    assert fields["selected tier"] == isa.selected_tier()
    assert fields["runnable tiers"] == ", ".join(isa.runnable_tiers())
    assert fields["jit enabled"] == "True"
    assert fields["cffi mode"] == "api"
    assert fields["compiler"].split()[0] == shutil.which("g++")
    assert set(fields["features"].split()) == {f for f in isa.FEATURES if f in isa.cpu_features()}
    assert fields["threads"].startswith("not bound (") and "torch threads on CPUs" in fields["threads"]
    assert "compiling" not in proc.stderr, "info compiled something although the probe was cached"


@pytest.mark.slow
def test_cli_clear(cache):
    results = kernforge.prewarm(axpy_manifest("fp32", "fp64"), isa_tier="generic", progress=False)
    proc = run_cli(cache, "clear")
    assert_rc0(proc)
    assert proc.stdout.strip() == f"removed 2 entries from {cache}"
    assert disk.entries(cache) == []
    assert (cache / ".locks").is_dir(), "the lock files must survive a clear"
    again, _ = core.build(results[0].spec, load=False)
    assert again.compiled


def test_cli_without_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2 and "usage:" in capsys.readouterr().err


def test_every_kernel_with_candidates_has_a_tuner_on_the_cli(cache, monkeypatch, capsys):
    """python -m kernforge tune offers a tuner per registered Candidates, each runnable from the CLI."""
    library = {
        id(value)
        for name, module in list(sys.modules.items())
        if name.startswith("kernforge.")
        for value in vars(module).values()
        if isinstance(value, tuning.Candidates)
    }
    assert library and {id(t.candidates) for t in tune.TUNERS.values()} == library
    monkeypatch.setattr(tuning, "time_call", lambda run: 1.0)  # no timing here: the defaults win
    assert cli.main(["tune", "gemm", "--m", "1", "--nk", "64x32"]) == 0
    assert "bf16 m=1 (bucket 1) n=64 k=32" in capsys.readouterr().out
    assert cli.main(["tune", "prefill", "--head-dim", "16", "--group", "1", "--length", "8"]) == 0
    assert "prefill bf16/bf16 head_dim 16/16 group 1" in capsys.readouterr().out


QWEN3_MOE = {  # Qwen3-30B-A3B's shape: dense intermediate_size besides the experts' own
    **LLAMA,
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "head_dim": 128,
}


def test_manifest_from_moe_configs_builds_routing_and_the_experts():
    kernels = prewarm.manifest_from_model_config(QWEN3_MOE)["kernels"]
    assert {"op": "topk_softmax", "dtype": "bfloat16"} in kernels
    assert {"module": "moe_experts", "params": {"dtype": "bf16", "weights": "bf16"}} in kernels
    int8 = prewarm.manifest_from_model_config(QWEN3_MOE, quant="int8")["kernels"]
    assert {"module": "moe_experts", "params": {"dtype": "bf16", "weights": "int8"}} in int8
    fp8 = prewarm.manifest_from_model_config(QWEN3_MOE, quant="fp8_block")["kernels"]
    assert {"module": "moe_experts", "params": {"dtype": "bf16", "weights": "fp8"}} in fp8
    assert {"module": "gemm_fp8", "params": {"dtype": "bf16"}} in fp8
    assert not [k for k in prewarm.manifest_from_model_config(LLAMA)["kernels"] if "moe" in json.dumps(k)]
    spec = ModelSpec.from_config(QWEN3_MOE)
    assert (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size) == (128, 8, 768)
    assert spec.linear_shapes()["router"] == [128, 2048]
    # Mixtral counts num_local_experts and sizes its experts with intermediate_size
    mixtral = ModelSpec.from_config({**LLAMA, "num_local_experts": 8, "num_experts_per_tok": 2})
    assert (mixtral.num_experts, mixtral.moe_intermediate_size) == (8, LLAMA["intermediate_size"])
    with pytest.raises(ValueError, match="num_experts_per_tok 9 exceeds the 8 experts"):
        ModelSpec.from_config({**LLAMA, "num_local_experts": 8, "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelSpec.from_config({**LLAMA, "num_local_experts": 8})


DEEPSEEK_V2_LITE = {  # DeepSeek-V2-Lite's config.json (the fields that shape the model)
    "model_type": "deepseek_v2",
    "torch_dtype": "bfloat16",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "n_shared_experts": 2,
    "moe_intermediate_size": 1408,
    "first_k_dense_replace": 1,
    "topk_method": "greedy",
    "scoring_func": "softmax",
    "n_group": 1,
    "topk_group": 1,
    "vocab_size": 102400,
}


def test_manifest_from_a_deepseek_config_builds_mla_and_its_moe():
    """An MLA model's manifest: the latent attention (576 / 512, every head on one KV head) per KV cache
    dtype and its append, the prompt path's ragged prefill (192 / 128), no per-head decode or K/V append;
    the MLA linears (fp32 router); routing in fp32 and the experts."""
    from kernforge.ops.attention.prefill import prefill_variant_params

    manifest = prewarm.manifest_from_model_config(DEEPSEEK_V2_LITE, kv_cache_dtypes=("float8_e4m3fn",))
    kernels, model = manifest["kernels"], manifest["model"]
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn

    def prefill(*args):
        params = prefill_variant_params(*args)
        return {"module": "prefill", "params": {**params, "tile": list(params["tile"])}}

    attention = [k for k in kernels if k.get("module") in ("prefill", "decode", "page") or "append" in k.get("op", "")]
    assert attention == [
        prefill(bf16, bf16, bf16, 192, 128, 1),
        prefill(bf16, bf16, bf16, 576, 512, 16),
        prefill(bf16, fp8, bf16, 576, 512, 16),
        {"module": "page", "params": {"dtype": "bf16"}},
        {"module": "page", "params": {"dtype": "fp8_e4m3"}},
    ]
    assert {"op": "topk_softmax", "dtype": "float32"} in kernels
    assert {"module": "moe_experts", "params": {"dtype": "bf16", "weights": "bf16"}} in kernels
    assert {k["params"]["dtype"] for k in kernels if k.get("module") == "gemm"} == {"bf16", "fp32"}  # the router
    assert model["linear_shapes"] == {
        "qkv_a_proj": [16 * 192 + 512 + 64, 2048],
        "kv_b_proj": [16 * 256, 512],
        "w_kc": [512, 128],
        "w_vc": [128, 512],
        "o_proj": [2048, 16 * 128],
        "gate_up_proj": [2 * 10944, 2048],
        "down_proj": [2048, 10944],
        "router": [64, 2048],
        "lm_head": [102400, 2048],
    }
    assert (model["kv_lora_rank"], model["q_lora_rank"]) == (512, None)
    spec = ModelSpec.from_config(DEEPSEEK_V2_LITE)
    assert (spec.num_experts, spec.n_shared_experts, spec.first_k_dense_replace) == (64, 2, 1)
    assert (spec.topk_method, spec.group) == ("greedy", 16)  # every head on the one latent
    # V3: q_a / q_b, its router's rule named by the model type; a rule without its groups is refused
    v3 = ModelSpec.from_config(
        {**DEEPSEEK_V2_LITE, "model_type": "deepseek_v3", "q_lora_rank": 1536, "topk_method": None,
         "scoring_func": None, "n_group": 8, "topk_group": 4}
    )  # fmt: skip
    assert (v3.topk_method, v3.scoring_func) == ("noaux_tc", "sigmoid")
    assert v3.linear_shapes()["q_b_proj"] == [16 * 192, 1536]
    with pytest.raises(ValueError, match="needs n_group and topk_group"):
        ModelSpec.from_config({**DEEPSEEK_V2_LITE, "topk_method": "group_limited_greedy", "n_group": None})


def test_model_spec_knows_which_layers_have_experts():
    """transformers' rules: the Qwen MoEs' mlp_only_layers and decoder_sparse_step, DeepSeek's
    first_k_dense_replace. The dense MLP's GEMMs are built only where some layer runs one."""
    layers = {"num_hidden_layers": 4}
    all_sparse = ModelSpec.from_config({**QWEN3_MOE, **layers})
    assert not all_sparse.has_dense_mlp and not {"gate_up_proj", "down_proj"} & set(all_sparse.linear_shapes())
    listed = ModelSpec.from_config({**QWEN3_MOE, **layers, "mlp_only_layers": [0]})
    assert [listed.is_sparse_layer(i) for i in range(4)] == [False, True, True, True]
    assert listed.linear_shapes()["gate_up_proj"] == [2 * 6144, 2048]
    stepped = ModelSpec.from_config({**QWEN3_MOE, **layers, "decoder_sparse_step": 2})
    assert [stepped.is_sparse_layer(i) for i in range(4)] == [False, True, False, True] and stepped.has_dense_mlp
    deepseek = ModelSpec.from_config({**DEEPSEEK_V2_LITE, **layers})
    assert [deepseek.is_sparse_layer(i) for i in range(4)] == [False, True, True, True]
    assert not ModelSpec.from_config({**LLAMA, **layers}).is_sparse_layer(0)


def test_model_spec_reads_the_attention_as_transformers_does():
    """head_dim absent: the split of hidden_size; sliding windows per layer_types where a config has
    them (the Qwens; none with use_sliding_window false), else on every layer (Mistral); the
    router's renormalization (always for Mixtral, never for DeepSeek-V2)."""
    spec = ModelSpec.from_config({**LLAMA, "num_hidden_layers": 2})
    assert (spec.head_dim, spec.sm_scale, spec.sliding_windows) == (128, 128**-0.5, (None, None))
    assert spec.window_left(0) == -1 and spec.rope_type == "default"
    qwen2 = {**LLAMA, "model_type": "qwen2", "num_hidden_layers": 2, "sliding_window": 8}
    types = {"layer_types": ["sliding_attention", "full_attention"]}
    assert [ModelSpec.from_config({**qwen2, **types}).window_left(i) for i in range(2)] == [7, -1]
    assert ModelSpec.from_config({**qwen2, **types, "use_sliding_window": False}).sliding_windows == (None, None)
    mistral = ModelSpec.from_config({**qwen2, "model_type": "mistral"})
    assert [mistral.window_left(i) for i in range(2)] == [7, 7]
    assert ModelSpec.from_config({**LLAMA, "rope_parameters": {"rope_type": "llama3"}}).rope_type == "llama3"
    experts = {"num_local_experts": 8, "num_experts_per_tok": 2}
    mixtral = ModelSpec.from_config({**LLAMA, "model_type": "mixtral", **experts})
    assert mixtral.renormalize and not ModelSpec.from_config({**QWEN3_MOE, "norm_topk_prob": False}).renormalize
    assert ModelSpec.from_config({**QWEN3_MOE, "norm_topk_prob": True}).renormalize
    assert not ModelSpec.from_config({**DEEPSEEK_V2_LITE, "norm_topk_prob": True}).renormalize
    with pytest.raises(ValueError, match="activation 'relu'"):
        ModelSpec.from_config({**LLAMA, "hidden_act": "relu"})
    relu = ModelSpec.from_config({**LLAMA, "hidden_act": "relu"}, any_activation=True)  # the integration's
    with pytest.raises(ValueError, match="activation 'relu'"):
        prewarm.manifest_from_spec(relu)
