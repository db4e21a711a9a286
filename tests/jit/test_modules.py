"""The module layer: declarations, multi-entry modules, runtime-keyed variants,
template shadowing, header-exact invalidation, tile candidates and the tuning
store, stateful plan/run wrappers, and which tier's build serves each tier."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kernforge
from kernforge.jit import core, isa, render, tuning
from kernforge.jit.module import (
    ALL_TIERS,
    VECTOR_TIERS,
    Bool,
    DeclarationError,
    DType,
    Entry,
    Enum,
    Int,
    IntTuple,
    Module,
    Struct,
)

from conftest import EXAMPLES_DIR, clean_env

sys.path.insert(0, str(EXAMPLES_DIR))
import planned_op  # noqa: E402  (the README's plan/run example)

pytestmark = pytest.mark.usefixtures("test_templates")


def toy(**overrides) -> Module:
    fields = dict(
        name="toy",
        template="axpy.cpp.jinja",
        params={"dtype": Enum(("fp32", "fp64"))},
        entries=[Entry("run", "int64_t x, int64_t y, int64_t n, double a", returns="int64_t")],
        register=False,
    )
    return Module(**{**fields, **overrides})


# --------------------------------------------------------------------------- declarations


@pytest.mark.parametrize(
    "param, value, message",
    [
        (Enum(("silu", "gelu")), "relu", "one of silu, gelu"),
        (DType(("fp32", "bf16")), torch.float16, "one of fp32, bf16"),
        (DType(), "int8", "one of fp32, bf16, fp16"),
        (Bool(), "yes", "a bool"),
        (Int(choices=(64, 128)), 96, "one of 64, 128"),
        (Int(minimum=1), 0, "in [1, None]"),
        (Int(), 1.5, "an int"),
        (IntTuple(2), [4, 16], "(a tuple, not a list)"),
        (IntTuple(2), (4, 16, 1), "a tuple of 2 positive ints"),
        (IntTuple(2, choices=((4, 16),)), (8, 16), "one of 4x16"),
    ],
)
def test_bad_parameter_values_name_module_and_parameter(param, value, message):
    module = toy(params={"p": param})
    with pytest.raises(DeclarationError, match=r"toy: parameter p must be .*" + re.escape(message)):
        module.variant(p=value)


def test_unknown_and_missing_parameters_are_errors():
    module = toy()
    with pytest.raises(DeclarationError, match="unknown parameter 'dtpye'"):
        module.variant(dtpye="fp32")
    with pytest.raises(DeclarationError, match="parameter 'dtype' is missing"):
        module.variant()


@pytest.mark.parametrize(
    "args, message",
    [
        ("int64_t x, int64_t x", "declared twice"),
        ("char* x", "C type 'char\\*'"),
        ("x", "needs a C type and a name"),
        ("const undeclared* args", "C type 'const undeclared\\*'"),
        (None, "declares no entry point"),
    ],
)
def test_bad_entry_declarations(args, message):
    with pytest.raises(DeclarationError, match=message):
        toy(entries=[] if args is None else [Entry("run", args)])


def test_bad_names_and_tiers_are_rejected():
    with pytest.raises(DeclarationError, match="not a valid identifier"):
        Entry("class", "int64_t x")
    with pytest.raises(DeclarationError, match="identifiers"):
        Enum(("a-b",))
    with pytest.raises(DeclarationError, match="unknown tiers"):
        toy(tiers={"avx512": "sse4"})


def test_declaration_derives_cdef_prefix_and_schema():
    module = toy(
        params={"dtype": DType(), "tile": IntTuple(2), "causal": Bool()},
        structs=[Struct("toy_args", (("n", "int64_t"), ("scale", "double")))],
        entries=[Entry("run", "const toy_args* args", returns="int64_t"), Entry("size", "int64_t n")],
    )
    assert module.cdef.splitlines() == [
        "typedef struct toy_args { int64_t n; double scale; } toy_args;",
        "int64_t kf_toy_run(const toy_args* args);",
        "void kf_toy_size(int64_t n);",
    ]
    params = module.checked_params({"dtype": torch.bfloat16, "tile": (4, 16), "causal": True})
    assert module.prefix(params, "avx512") == "toy_dtype-bf16_tile-4x16_causal-1_avx512"
    assert module.schema()["params"]["tile"] == {"type": "int_tuple", "length": 2, "choices": None}


def test_kernel_binding_checks_argument_names(cache):
    kernel = core.load_kernel(toy(), {"dtype": "fp64"}, "generic")
    with pytest.raises(DeclarationError, match="no argument 'alpha'; it takes x, y, n, a"):
        kernel.bind("run", alpha=2.0)
    with pytest.raises(DeclarationError, match="argument 'a' is missing"):
        kernel.call("run", x=0, y=0, n=0)
    with pytest.raises(DeclarationError, match="no entry point 'axpby'"):
        kernel.bind("axpby")
    x, y = torch.arange(5, dtype=torch.float64), torch.ones(5, dtype=torch.float64)
    bound = kernel.bind("run", a=2.0, n=5)
    assert bound(x.data_ptr(), y.data_ptr()) == 5  # the free arguments, in declaration order
    assert kernel.call("run", y=y.data_ptr(), a=1.0, x=x.data_ptr(), n=5) == 5  # by name, any order
    assert y.tolist() == [1.0, 4.0, 7.0, 10.0, 13.0]


# --------------------------------------------------------------------------- variants


def test_variants_are_memoized_by_runtime_parameters():
    module = toy(params={"dtype": DType()})
    assert module.variant(dtype=torch.bfloat16) is module.variant(dtype="bf16") is module.select("bfloat16")
    assert module.variant(dtype="fp32") is not module.variant(dtype="bf16")


def test_ops_find_variants_lazily_by_input_dtype():
    kernels = kernforge.ops.OPS["rmsnorm"]
    assert kernels.variant(torch.float16) is kernels.module.variant(dtype="fp16", fused_add=False, gemma=False)
    with pytest.raises(ValueError, match="does not take torch.int32 inputs"):
        kernels.variant(torch.int32)


def test_every_op_is_exported_once_from_its_registration():
    registered = set(kernforge.ops._registry.PUBLIC)
    assert registered <= set(kernforge.__all__) and registered <= set(kernforge.ops.__all__)
    for name in registered:
        assert getattr(kernforge, name) is kernforge.ops._registry.PUBLIC[name]
    assert set(kernforge.ops.OPS) <= registered


def test_one_module_many_entry_points(cache):
    kernel = planned_op.SEGMENT_SUM.variant(dtype="fp32").kernel()
    assert callable(kernel.workspace_size) and callable(kernel.plan) and callable(kernel.run)
    assert kernel.workspace_size(4) == 5 * 8
    assert len([p for p in cache.iterdir() if p.name.startswith("segment_sum_")]) == 1


def test_tiers_are_declared_amx_runs_amx_builds_only_where_declared():
    vector_module, tile_module = toy(tiers=VECTOR_TIERS), toy(tiers=ALL_TIERS)
    assert vector_module.variant(dtype="fp32").spec("amx").tier == "avx512"
    assert tile_module.variant(dtype="fp32").spec("amx").tier == "amx"
    assert kernforge.ops.OPS["rmsnorm"].variant(torch.float32).spec("amx").tier == "avx512"
    with pytest.raises(isa.IsaError, match="no variant for tier 'avx2'"):
        toy(tiers={"generic": "generic"}).variant(dtype="fp32").spec("avx2")


def test_amx_variant_compiles_here_without_running(cache):
    result, kernel = core.build(toy(tiers=ALL_TIERS).variant(dtype="fp32").spec("amx"), load=None)
    assert result.key.startswith("toy_dtype-fp32_amx-") and (result.path / "kernel.so").is_file()
    assert (kernel is None) == ("amx" not in isa.runnable_tiers())


# --------------------------------------------------------------------------- template origin


def _constant_template(folder: Path, value: int, name: str = "answer.cpp.jinja") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(
        textwrap.dedent(f"""\
        #include <cstdint>
        extern "C" __attribute__((visibility("default"))) {{{{ decl.answer }}}} {{ return {value}; }}
    """)
    )
    return folder


ANSWER = Module(
    "answer",
    "answer.cpp.jinja",
    params={},
    entries=[Entry("answer", "", returns="int64_t")],
    tiers={t: "generic" for t in ALL_TIERS},
    register=False,
)


def test_template_registered_after_first_use_shadows_the_old_one(cache, tmp_path, user_template_dirs):
    kernforge.register_template_dir(_constant_template(tmp_path / "first", 1))
    variant = ANSWER.variant()
    assert variant.kernel().answer() == 1
    kernforge.register_template_dir(_constant_template(tmp_path / "second", 2))
    assert variant.kernel().answer() == 2, "a warm Variant kept the template it resolved first"
    assert core.load_kernel(ANSWER, {}, "generic").answer() == 2


# --------------------------------------------------------------------------- header-exact keys


def test_editing_a_header_rebuilds_only_its_dependants(cache, tmp_path, user_template_dirs):
    folder = tmp_path / "headers"
    (folder / "include" / "toy").mkdir(parents=True)
    for name, value in (("a", 10), ("b", 20)):
        (folder / "include" / "toy" / f"{name}.h").write_text(f"inline int64_t value_{name}() {{ return {value}; }}\n")
        (folder / f"uses_{name}.cpp.jinja").write_text(
            f'#include <cstdint>\n#include "toy/{name}.h"\n'
            f'extern "C" __attribute__((visibility("default"))) {{{{ decl.get }}}} {{ return value_{name}(); }}\n'
        )
    kernforge.register_template_dir(folder)
    modules = {
        name: Module(
            f"uses_{name}",
            f"uses_{name}.cpp.jinja",
            params={},
            entries=[Entry("get", "", returns="int64_t")],
            tiers={"generic": "generic"},
            register=False,
        )
        for name in "ab"
    }
    for name, value in (("a", 10), ("b", 20)):
        result, kernel = core.build(core.KernelSpec.make(modules[name], {}, "generic"))
        assert result.compiled and kernel.get() == value
    (folder / "include" / "toy" / "a.h").write_text("inline int64_t value_a() { return 11; }\n")
    rebuilt_a, kernel_a = core.build(core.KernelSpec.make(modules["a"], {}, "generic"))
    rebuilt_b, _ = core.build(core.KernelSpec.make(modules["b"], {}, "generic"))
    assert rebuilt_a.compiled and kernel_a.get() == 11
    assert not rebuilt_b.compiled, "a header uses_b does not include rebuilt it"


def test_included_headers_follow_the_include_graph():
    source = '#include "kernforge/norm.h"\n'
    names = [name for name, _ in render.included_headers(source)]
    assert "kernforge/norm.h" in names and "kernforge/core/vec.h" in names and "kernforge/core/types.h" in names
    assert not any("sampling" in name for name in names)


# --------------------------------------------------------------------------- tile candidates, tuning store


MATMUL = Module(
    "blocked_matmul",
    "blocked_matmul.cpp.jinja",
    params={"tile": IntTuple(2, choices=((1, 1), (4, 1), (2, 2), (6, 2)))},
    entries=[Entry("run", "int64_t c, int64_t a, int64_t b, int64_t m, int64_t n, int64_t k, int64_t num_threads")],
    register=False,
)
VECTOR = ("avx512", "avx2", "generic")
MATMUL_CANDIDATES = tuning.Candidates(
    "blocked_matmul",
    MATMUL,
    candidates=[
        tuning.Candidate({"tile": (4, 1)}, VECTOR, rank=1),
        tuning.Candidate({"tile": (2, 2)}, VECTOR, rank=2),
        tuning.Candidate({"tile": (6, 2)}, ("avx512",), rank=0, when=lambda s: s["m"] >= 6),
    ],
    reference=tuning.Candidate({"tile": (1, 1)}, VECTOR),
    bucket=lambda s: f"m{min(s['m'], 64)}_n{s['n']}_k{s['k']}",
)


def _run_matmul(candidate, a, b):
    c = torch.full((a.shape[0], b.shape[1]), float("nan"))
    MATMUL.variant(**candidate.params).kernel().run(
        c.data_ptr(), a.data_ptr(), b.data_ptr(), a.shape[0], b.shape[1], a.shape[1], 2
    )
    return c


@pytest.mark.parametrize("m, n, k", [(1, 1, 1), (7, 33, 5), (13, 50, 17)])
def test_every_candidate_computes_the_same_product(tier, m, n, k):
    a, b = torch.randn(m, k), torch.randn(k, n)
    built = MATMUL.built_tier(tier)
    for candidate in MATMUL_CANDIDATES.applicable({"m": m, "n": n, "k": k}, built):
        torch.testing.assert_close(
            _run_matmul(candidate, a, b), a @ b, atol=1e-5, rtol=1e-5, msg=lambda text: f"{candidate.label()}: {text}"
        )


def test_static_ranking_and_predicates():
    small, large = {"m": 2, "n": 8, "k": 8}, {"m": 64, "n": 8, "k": 8}
    assert MATMUL_CANDIDATES.default(large, "avx512").params == {"tile": (6, 2)}
    assert MATMUL_CANDIDATES.default(small, "avx512").params == {"tile": (4, 1)}
    assert MATMUL_CANDIDATES.applicable(large, "avx2")[-1].params == {"tile": (1, 1)}  # the reference, last


@pytest.mark.slow
def test_tuned_winner_is_remembered_and_reloaded_in_a_new_process(cache):
    shape = {"m": 8, "n": 48, "k": 32}
    fake_seconds = {(4, 1): 3.0, (2, 2): 1.0, (6, 2): 2.0, (1, 1): 9.0}
    winner = MATMUL_CANDIDATES.tune(shape, lambda c: fake_seconds[c.params["tile"]], tier="avx512")
    assert winner.params == {"tile": (2, 2)}
    assert MATMUL_CANDIDATES.choose(shape, tier="avx512").params == {"tile": (2, 2)}
    assert MATMUL_CANDIDATES.choose({**shape, "n": 64}, tier="avx512").params == {"tile": (6, 2)}  # other bucket
    record = json.loads((cache / "tuning" / "blocked_matmul.json").read_text())
    assert list(record.values())[0]["seconds"]["tile=[2, 2]"] == 1.0
    bucket = MATMUL_CANDIDATES.bucket(shape)
    child = (
        f"from kernforge.jit import tuning; print(tuning.TuningStore().lookup('blocked_matmul', {bucket!r}, 'avx512'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", child],
        env=clean_env(KERNFORGE_CACHE_DIR=cache),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "{'tile': [2, 2]}"


def test_tuning_with_real_timings_picks_an_applicable_candidate(cache, tier):
    a, b = torch.randn(16, 64), torch.randn(64, 64)
    built = MATMUL.built_tier(tier)

    def measure(candidate):
        _run_matmul(candidate, a, b)  # compile and warm up
        import time

        start = time.perf_counter()
        for _ in range(20):
            _run_matmul(candidate, a, b)
        return time.perf_counter() - start

    winner = MATMUL_CANDIDATES.tune({"m": 16, "n": 64, "k": 64}, measure, tier=built)
    assert winner in MATMUL_CANDIDATES.applicable({"m": 16, "n": 64, "k": 64}, built)
    torch.testing.assert_close(_run_matmul(winner, a, b), a @ b, atol=1e-4, rtol=1e-4)


def test_corrupt_stale_and_foreign_records_are_ignored(cache, monkeypatch, caplog):
    shape = {"m": 8, "n": 16, "k": 16}
    MATMUL_CANDIDATES.tune(shape, lambda c: {(2, 2): 0.5}.get(c.params["tile"], 1.0), tier="avx512")
    assert MATMUL_CANDIDATES.choose(shape, tier="avx512").params == {"tile": (2, 2)}
    path = cache / "tuning" / "blocked_matmul.json"
    good = json.loads(path.read_text())
    ((key, record),) = good.items()

    with monkeypatch.context() as patch:
        patch.setattr(isa, "cpu_model", lambda: "another CPU")  # records are per CPU model
        assert MATMUL_CANDIDATES.choose(shape, tier="avx512").params == {"tile": (6, 2)}

    logger = logging.getLogger("kernforge")
    logger.addHandler(caplog.handler)  # kernforge's logger does not propagate to the root
    try:
        for damaged, warning in [
            ("{not json", "corrupt tuning file"),
            ("[1, 2]", "corrupt tuning file"),
            (json.dumps({key: {**record, "kernforge_version": "0.0.0"}}), "stale tuning record"),
            (json.dumps({key: {**record, "winner": {"tile": [3, 3]}}}), "not a candidate"),
        ]:
            path.write_text(damaged)
            caplog.clear()
            assert MATMUL_CANDIDATES.choose(shape, tier="avx512").params == {"tile": (6, 2)}, damaged
            assert warning in caplog.text, damaged
    finally:
        logger.removeHandler(caplog.handler)
    MATMUL_CANDIDATES.tune(shape, lambda c: {(4, 1): 0.5}.get(c.params["tile"], 1.0), tier="avx512")
    assert MATMUL_CANDIDATES.choose(shape, tier="avx512").params == {"tile": (4, 1)}  # a corrupt file is replaced


# --------------------------------------------------------------------------- stateful plan/run


def _ragged(lengths, dim, dtype=torch.float32):
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(lengths).cumsum(0)])
    return indptr, torch.randn(int(indptr[-1]), dim).to(dtype)


def test_run_before_plan_is_an_error():
    wrapper = planned_op.SegmentSumWrapper(torch.empty(1024, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="before plan"):
        wrapper.run(torch.zeros(1, 4))


def test_one_plan_serves_many_runs_and_a_new_plan_replaces_it(tier):
    wrapper = planned_op.SegmentSumWrapper(torch.empty(1024, dtype=torch.uint8))
    indptr, _ = _ragged([3, 0, 1000, 1, 17], 33)
    wrapper.plan(indptr, dim=33)
    indptr_copy = indptr.clone()
    indptr.zero_()  # the plan keeps its own copy
    out = torch.empty(5, 33)
    for _ in range(3):  # different inputs, one plan
        x = torch.randn(1021, 33)
        assert wrapper.run(x, out=out) is out
        torch.testing.assert_close(out, planned_op.reference(x, indptr_copy), atol=1e-4, rtol=1e-4)
    indptr2, x2 = _ragged([1], 33, torch.bfloat16)
    wrapper.plan(indptr2, dim=33, dtype=torch.bfloat16)
    torch.testing.assert_close(wrapper.run(x2).float(), planned_op.reference(x2, indptr2), atol=1e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="shape"):
        wrapper.run(torch.randn(1021, 33))  # the old plan's geometry


def test_plan_checks_its_inputs_and_workspace():
    wrapper = planned_op.SegmentSumWrapper(torch.empty(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="this plan needs"):
        wrapper.plan(torch.tensor([0, 4]), dim=4)
    wrapper = planned_op.SegmentSumWrapper(torch.empty(1024, dtype=torch.uint8))
    with pytest.raises(ValueError, match="non-decreasing"):
        wrapper.plan(torch.tensor([0, 4, 2]), dim=4)
    with pytest.raises(TypeError, match="int64"):
        wrapper.plan(torch.tensor([0, 4], dtype=torch.int32), dim=4)


def test_struct_arguments_are_filled_by_field_name():
    kernel = kernforge.ops.sampling.SAMPLING.variant(dtype="fp32").kernel()
    args = kernel.new("kf_sampling_args", {"vocab": 7, "top_p": 0.5})
    assert (args.vocab, args.top_p, args.top_k) == (7, 0.5, 0)  # the rest is zero
    with pytest.raises(DeclarationError, match="has no field 'vocabulary'"):
        kernel.new("kf_sampling_args", {"vocabulary": 7})
    with pytest.raises(TypeError, match=r"field top_p \(double\) cannot take 'x'"):
        kernel.new("kf_sampling_args", {"top_p": "x"})
    with pytest.raises(DeclarationError, match="declares no struct 'args'"):
        kernel.new("args", {})


# --------------------------------------------------------------------------- codes shared with C++


def test_codes_are_declared_once_and_emitted_as_an_enum():
    from kernforge.jit import Codes

    codes = Codes("kf::demo::Status", (("kOk", 0), ("kBadInput", 3)))
    assert codes.kBadInput == 3 and codes.name_of(3) == "kBadInput"
    assert (
        codes.c_definition() == "namespace kf { namespace demo { enum Status : int64_t { kOk = 0, kBadInput = 3 }; } }"
    )
    with pytest.raises(AttributeError, match="kMissing"):
        _ = codes.kMissing
    for values in ((("kA", 1), ("kA", 2)), (("kA", 1), ("kB", 1))):
        with pytest.raises(DeclarationError, match="distinct"):
            Codes("Status", values)
    with pytest.raises(DeclarationError):
        Codes("kf::bad name", (("kA", 1),))


def test_every_reported_code_has_its_message():
    """The errors a kernel reports to a user are the codes declared with its module, each with a message."""
    from kernforge.ops import sampling
    from kernforge.ops.attention import decode, prefill

    internal = {"kPlanOk", "kCapacity", "kPrefillTooManyItems"}  # success, and the callers' own sizing bugs
    for codes, messages in (
        (decode.PLAN_ERROR, decode._PLAN_MESSAGES),
        (prefill.PLAN_ERROR, prefill._PLAN_MESSAGES),
        (sampling.PARAM_ERROR, sampling._PARAM_RULES),
    ):
        assert {name for name, _ in codes.values} - internal == set(messages)
    for module, codes in (
        (decode.DECODE, decode.PLAN_ERROR),
        (prefill.PREFILL, prefill.PLAN_ERROR),
        (sampling.SAMPLING, sampling.ACTION),
    ):
        assert codes.c_definition() in module.render_variables({}, "generic")["abi_structs"]
