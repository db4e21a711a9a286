"""The AMX tier of the GEMM (kernforge/gemm/amx_kernel.h): bf16 (tdpbf16ps) and int8 (tdpbusd) tiles
reading the packed weights in place.

Most CPUs, this one included, have no AMX, so the kernels are checked three ways:

* emulated: the real gemm / gemm_int8 templates, built on the avx512 tier with the tile instructions
  replaced by a scalar emulation of their Intel SDM semantics (tests/templates/include/kernforge/
  amx_emulation.h, itself checked against the SDM's pseudocode here). The bf16 result is compared bit
  for bit with a model of the exact fp32 operation order the tiles take, and within tolerance with
  fp32 torch; the int8 int32 sums bit for bit with torch and with the vpdpbusd path;
* compiled: the real amx builds of both modules compile here and contain the tile instructions;
* run: on a CPU and OS with AMX, the ops under the amx tier match torch (skipped elsewhere).
"""

import shutil
import subprocess

import pytest
import torch

import kernforge
from kernforge.cache import disk
from kernforge.jit import core, isa
from kernforge.jit.module import Entry, Module
from kernforge.ops.gemm.bf16 import GEMM, TILE_CANDIDATES, convert_weight_packed, tile_shape, weight_packed_linear
from kernforge.ops.gemm.int4 import GEMM_INT4
from kernforge.ops.gemm.int8 import (
    GEMM_INT8,
    convert_weight_packed_int8,
    int8_accumulate,
    int8_scaled_mm,
    per_token_quant_int8,
)

from op_helpers import seeded
from references import int8_accumulate_reference, int8_linear_reference, linear_reference

pytestmark = pytest.mark.usefixtures("test_templates")

# kf::gemm::amx: 16 x 16 tiles, 2 x 2 of them per 32 x 32 block, one tile step = 64 bytes of K.
TILE_ROWS, BLOCK, MIN_ROWS = 16, 32, 5
STEP_K = {"bf16": 32, "int8": 64}
# Columns per task: 32 for bf16; for int8 the driver's NR, kf::gemm::int8::DefaultTile::kNR on avx512 with VNNI.
TASK_COLUMNS = {"bf16": 32, "int8": 64}
FAULTS = {"bad_config": 1, "not_configured": 2, "bad_row_bytes": 3, "same_tile": 4, "shape_mismatch": 5}

_LINEAR_ARGS = GEMM.entries["linear"].args
_COUNTERS = Entry("take_counters", "int64_t counters")
# The real modules' parameters and entries, plus the test entries of the emulated templates.
GEMM_EMULATED = Module(
    "gemm_amx_emulated",
    "gemm_amx_emulated.cpp.jinja",
    params=GEMM.params,
    entries=[
        *GEMM.entries.values(),
        Entry("linear_tiles", _LINEAR_ARGS),
        _COUNTERS,
        Entry("tile_product", "int64_t c, int64_t a, int64_t b, int64_t op"),
        Entry("misuse", "int64_t which"),
    ],
    tiers={"avx512": "avx512"},
    register=False,
)
GEMM_INT8_EMULATED = Module(
    "gemm_int8_amx_emulated",
    "gemm_int8_amx_emulated.cpp.jinja",
    params=GEMM_INT8.params,
    entries=[*GEMM_INT8.entries.values(), Entry("accumulate_tiles", GEMM_INT8.entries["accumulate"].args), _COUNTERS],
    tiers={"avx512": "avx512"},
    register=False,
)


def _gemm_params() -> dict:
    """The bf16 GEMM's parameters as dispatch picks them untuned on avx512 (tile and blocking)."""
    return {"dtype": "bf16", **TILE_CANDIDATES.default(tile_shape(torch.bfloat16, 64, 64, 64), "avx512").params}


def _emulated(module, params):
    if not isa.runnable("avx512"):
        pytest.skip("the emulated AMX kernels are built on the avx512 tier, which this CPU cannot run")
    kernel = core.load_kernel(module, params, "avx512")
    _take_counters(kernel)  # start from zero
    return kernel


@pytest.fixture(scope="module")
def gemm_emulated(test_templates):
    return _emulated(GEMM_EMULATED, _gemm_params())


@pytest.fixture(scope="module")
def int8_emulated(test_templates):
    return _emulated(GEMM_INT8_EMULATED, {"dtype": "bf16"})


def _take_counters(kernel) -> dict:
    counters = torch.zeros(3, dtype=torch.int64)
    kernel.take_counters(counters.data_ptr())
    faults, last, dots = counters.tolist()
    return {"faults": faults, "last_fault": last, "dot_products": dots}


def _no_faults(kernel) -> int:
    """Dot-product instructions since the last call; asserts that none of the tile instructions faulted."""
    counters = _take_counters(kernel)
    assert counters["faults"] == 0, f"the AMX kernel misused the tile unit: {counters}"
    return counters["dot_products"]


def _expected_dot_products(m: int, n: int, k: int, step_k: int, task_columns: int) -> int:
    """What the tiles do: per 32-row block, per 32-column block inside N (chunks are whole task_columns
    groups), one instruction per C tile (2 for a block of up to 16 rows, else 4) per 64-byte K step."""
    steps = -(-k // step_k)
    per_task_row = sum(2 if min(BLOCK, m - r) <= TILE_ROWS else 4 for r in range(0, m, BLOCK))
    column_blocks = sum(-(-min(task_columns, n - n0) // BLOCK) for n0 in range(0, n, task_columns))
    return steps * per_task_row * column_blocks


# --------------------------------------------------------------------------- the emulation itself


def _daz(x: torch.Tensor) -> torch.Tensor:
    """Denormals as zeros (of their sign), as TDPBF16PS reads its inputs."""
    tiny = torch.finfo(torch.float32).tiny
    return torch.where(x.abs() < tiny, x * 0, x)


def _sdm_tdpbf16ps(c, a, b_pairs):
    """The SDM's TDPBF16PS on fp32 C [16, 16], bf16 A [16, 32] and B [16, 32] (pair rows): per (m, n),
    even and odd products summed separately over K, each step an fp32 FMA (a bf16 product is exact in
    fp32, so multiply-then-add is that FMA), then C + (even + odd); denormal inputs read as zero."""
    a, b = _daz(a.float()), _daz(b_pairs.float())
    even = torch.zeros(16, 16)
    odd = torch.zeros(16, 16)
    for k in range(16):
        even = even + a[:, 2 * k, None] * b[None, k, 0::2]
        odd = odd + a[:, 2 * k + 1, None] * b[None, k, 1::2]
    return _daz(c) + (even + odd)


def test_emulated_tdpbf16ps_follows_the_sdm(gemm_emulated):
    g = seeded("amx-emu-bf16")
    a = torch.randn(16, 32, generator=g).bfloat16()
    b = torch.randn(16, 32, generator=g).bfloat16()
    c = torch.randn(16, 16, generator=g)
    denormal = torch.tensor([0x7F], dtype=torch.int16).view(torch.bfloat16)[0]  # the largest, ~1.17e-38
    a[3, 4], b[2, 6] = denormal, 1e35  # row 3, column 3: the denormal times 1e35 would add ~1e-3
    out = c.clone()
    gemm_emulated.tile_product(out.data_ptr(), a.data_ptr(), b.data_ptr(), 0)
    assert _no_faults(gemm_emulated) == 1
    assert torch.equal(out, _sdm_tdpbf16ps(c, a, b))
    # the input denormal is read as zero: without DAZ that element would differ
    assert out[3, 3] != c[3, 3] + (a[3].float().reshape(16, 2) * b[:, 6:8].float()).sum()


def test_emulated_tdpbusd_is_exact_and_wraps(gemm_emulated):
    g = seeded("amx-emu-int8")
    a = torch.randint(0, 256, (16, 64), generator=g, dtype=torch.int32).to(torch.uint8)
    b = torch.randint(-128, 128, (16, 64), generator=g, dtype=torch.int32).to(torch.int8)
    c = torch.randint(-(2**20), 2**20, (16, 16), generator=g, dtype=torch.int32)
    c[0, 0] = 2**31 - 1  # with a positive product the sum wraps past 2^31, as the instruction's does
    a[0], b[:, 0:4] = 255, 127
    out = c.clone()
    gemm_emulated.tile_product(out.data_ptr(), a.data_ptr(), b.data_ptr(), 1)
    assert _no_faults(gemm_emulated) == 1
    # A row m holds K groups of 4: [m, r, i]; B row r holds 16 columns of such a group: [r, n, i]
    a_groups, b_groups = a.long().reshape(16, 16, 4), b.long().reshape(16, 16, 4)
    exact = c.long() + (a_groups[:, None] * b_groups.permute(1, 0, 2)[None]).sum((2, 3))
    wrapped = (exact + 2**31) % 2**32 - 2**31
    assert exact[0, 0] > 2**31 - 1 and torch.equal(out.long(), wrapped)


@pytest.mark.parametrize(
    "which,fault",
    [
        (0, "bad_config"),
        (1, "bad_config"),
        (2, "shape_mismatch"),
        (3, "same_tile"),
        (4, "not_configured"),
        (5, "bad_row_bytes"),
        (6, "not_configured"),
    ],
    ids=[
        "17-rows",
        "rows-without-bytes",
        "k-mismatch",
        "same-tile",
        "unconfigured-tile",
        "partial-dword",
        "after-release",
    ],
)
def test_emulation_reports_what_the_hardware_faults_on(gemm_emulated, which, fault):
    gemm_emulated.misuse(which)
    assert _take_counters(gemm_emulated) == {"faults": 1, "last_fault": FAULTS[fault], "dot_products": 0}


# --------------------------------------------------------------------------- bf16 on emulated tiles


def _bf16_operands(m, n, k, key):
    g = seeded("amx-bf16", m, n, k, *key)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    return x, w, bias


def _tile_order_model(x, w, bias):
    """The tile path's arithmetic, in order: per 32-value K step (the last zero-padded), per output,
    an even and an odd fp32 sum over the step's 16 pairs, added to the running sum; then + bias,
    rounded to bf16. Everything is exact in fp32 except those sums, so this is bit-exact."""
    m, k = x.shape
    n = w.shape[0]
    steps = max(-(-k // 32), 0)
    xs = torch.zeros(m, steps * 32)
    ws = torch.zeros(n, steps * 32)
    xs[:, :k], ws[:, :k] = x.float(), w.float()
    xs, ws = xs.reshape(m, 1, steps, 16, 2), ws.reshape(1, n, steps, 16, 2)
    even = torch.zeros(m, n, steps)
    odd = torch.zeros(m, n, steps)
    for p in range(16):
        even = even + xs[..., p, 0] * ws[..., p, 0]
        odd = odd + xs[..., p, 1] * ws[..., p, 1]
    acc = torch.zeros(m, n)
    for s in range(steps):
        acc = acc + (even[..., s] + odd[..., s])
    return (acc + bias.float()).bfloat16()


def _run_linear(kernel, entry, x, packed, bias, threads=2):
    m, k = x.shape
    out = torch.full((m, packed.n), float("nan"), dtype=torch.bfloat16)
    status = getattr(kernel, entry)(
        out.data_ptr(),
        packed.n,
        x.data_ptr(),
        k,
        packed.packed.data_ptr(),
        packed.panel_width,
        bias.data_ptr(),
        m,
        packed.n,
        k,
        threads,
    )
    assert status in (None, 0), f"{entry} returned {status}"
    return out


BF16_SHAPES = [
    (1, 1, 1),
    (1, 47, 17),
    (5, 33, 64),
    (16, 32, 31),
    (17, 64, 33),
    (33, 47, 129),
    (70, 40, 95),
    (33, 15, 4109),
    (300, 290, 300),  # row groups, column chunks and K blocks, each with a tail
    (260, 40, 4100),  # the deep-K blocking
]


@pytest.mark.parametrize("m,n,k", BF16_SHAPES, ids=[f"m{m}_n{n}_k{k}" for m, n, k in BF16_SHAPES])
def test_emulated_bf16_tiles_match_the_operation_order_and_torch(gemm_emulated, m, n, k):
    x, w, bias = _bf16_operands(m, n, k, ("tiles",))
    packed = convert_weight_packed(w)
    out = _run_linear(gemm_emulated, "linear_tiles", x, packed, bias)
    assert _no_faults(gemm_emulated) == _expected_dot_products(m, n, k, STEP_K["bf16"], TASK_COLUMNS["bf16"])
    assert torch.equal(out, _tile_order_model(x, w, bias))
    reference = linear_reference(x, w, bias)
    torch.testing.assert_close(out.float(), reference, rtol=1e-2, atol=1e-2 * k**0.5)


def test_emulated_bf16_linear_takes_tiles_from_min_rows(gemm_emulated):
    """The op's entry: vector micro-kernels below kMinRows rows, tiles from there on, same products."""
    n, k = 40, 77
    for m in (MIN_ROWS - 1, MIN_ROWS, 67):
        x, w, bias = _bf16_operands(m, n, k, ("dispatch",))
        packed = convert_weight_packed(w)
        out = _run_linear(gemm_emulated, "linear", x, packed, bias)
        dots = _no_faults(gemm_emulated)
        if m < MIN_ROWS:
            assert dots == 0, f"m={m} took the tile path"
            torch.testing.assert_close(out.float(), linear_reference(x, w, bias), rtol=1e-2, atol=1e-2 * k**0.5)
        else:
            assert dots == _expected_dot_products(m, n, k, STEP_K["bf16"], TASK_COLUMNS["bf16"])
            assert torch.equal(out, _tile_order_model(x, w, bias))


def test_emulated_bf16_result_does_not_depend_on_threads(gemm_emulated):
    x, w, bias = _bf16_operands(130, 100, 70, ("threads",))
    packed = convert_weight_packed(w)
    outs = [_run_linear(gemm_emulated, "linear", x, packed, bias, threads) for threads in (1, 2, 3)]
    _no_faults(gemm_emulated)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


# --------------------------------------------------------------------------- int8 on emulated tiles


def _int8_operands(m, n, k, key):
    g = seeded("amx-int8", m, n, k, *key)
    a_q = torch.randint(0, 256, (m, k), generator=g, dtype=torch.int32).to(torch.uint8)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int32).to(torch.int8)
    scale = torch.rand(n, generator=g) * 1e-2 + 1e-3
    return a_q, w, scale


def _accumulate(kernel, entry, a_q, packed, threads=2):
    m, k = a_q.shape
    out = torch.full((m, packed.n), -7, dtype=torch.int32)
    status = getattr(kernel, entry)(
        a_q.data_ptr(),
        k,
        packed.packed.data_ptr(),
        packed.panel_width,
        packed.compensation.data_ptr(),
        out.data_ptr(),
        packed.n,
        m,
        packed.n,
        k,
        threads,
    )
    assert status in (None, 0), f"{entry} returned {status}"
    return out


INT8_SHAPES = [
    (1, 1, 1),
    (1, 15, 17),
    (5, 64, 64),
    (16, 65, 63),
    (33, 70, 129),
    (70, 130, 200),
    (33, 17, 4109),
    (300, 290, 600),  # row groups, column chunks and K blocks, each with a tail
    (260, 40, 8200),  # the deep-K blocking
]


@pytest.mark.parametrize("m,n,k", INT8_SHAPES, ids=[f"m{m}_n{n}_k{k}" for m, n, k in INT8_SHAPES])
def test_emulated_int8_tiles_are_bit_exact(int8_emulated, m, n, k):
    a_q, w, scale = _int8_operands(m, n, k, ("tiles",))
    packed = convert_weight_packed_int8(w, scale)
    out = _accumulate(int8_emulated, "accumulate_tiles", a_q, packed)
    assert _no_faults(int8_emulated) == _expected_dot_products(m, n, k, STEP_K["int8"], TASK_COLUMNS["int8"])
    exact = int8_accumulate_reference(a_q, w)  # every partial sum is an integer below 2^53
    assert torch.equal(out.double(), exact)
    assert torch.equal(out, int8_accumulate(a_q, packed))  # the vpdpbusd path, bit for bit


def test_emulated_int8_driver_takes_tiles_from_min_rows(int8_emulated):
    n, k = 70, 150
    for m in (MIN_ROWS - 1, MIN_ROWS, 33):
        a_q, w, scale = _int8_operands(m, n, k, ("dispatch",))
        packed = convert_weight_packed_int8(w, scale)
        out = _accumulate(int8_emulated, "accumulate", a_q, packed)
        dots = _no_faults(int8_emulated)
        assert (dots > 0) == (m >= MIN_ROWS), f"m={m}: {dots} tile products"
        assert torch.equal(out, int8_accumulate(a_q, packed))


def test_emulated_int8_scaled_mm_equals_the_vector_path(int8_emulated):
    m, n, k = 33, 70, 150
    a_q, w, scale = _int8_operands(m, n, k, ("scaled",))
    packed = convert_weight_packed_int8(w, scale)
    a_scale = torch.rand(m, generator=seeded("amx-int8-scale")) * 1e-2
    bias = torch.randn(n, generator=seeded("amx-int8-bias"))
    out = torch.empty(m, n, dtype=torch.bfloat16)
    status = int8_emulated.scaled_mm(
        a_q.data_ptr(),
        k,
        a_scale.data_ptr(),
        packed.packed.data_ptr(),
        packed.panel_width,
        packed.compensation.data_ptr(),
        packed.scale.data_ptr(),
        bias.data_ptr(),
        out.data_ptr(),
        n,
        m,
        n,
        k,
        2,
    )
    assert status == 0 and _no_faults(int8_emulated) > 0
    assert torch.equal(out, int8_scaled_mm(a_q, packed, a_scale, bias))


# --------------------------------------------------------------------------- the real amx builds


def _amx_build(module, params, cache):
    result, _ = core.build(core.KernelSpec.make(module, params, "amx"), load=False)  # compile only
    meta = disk.Entry(cache, result.key).trusted_meta()
    assert meta is not None and {"-mamx-tile", "-mamx-bf16", "-mamx-int8"} <= set(meta["command"])
    assert {"amx_tile", "amx_bf16", "amx_int8"} <= set(meta["requires"])
    return disk.Entry(cache, result.key).so


def _mnemonics(so) -> str:
    if shutil.which("objdump") is None:
        pytest.skip("objdump (binutils) is not installed: cannot look into the built library")
    return subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(so)], capture_output=True, text=True, check=True
    ).stdout


@pytest.mark.parametrize(
    "module,params,product",
    [
        (GEMM, None, "tdpbf16ps"),
        (GEMM_INT8, {"dtype": "bf16"}, "tdpbusd"),
        (GEMM_INT4, {"dtype": "bf16", "row_block": 128, "few_rows": 4}, "tdpbusd"),
        (GEMM_INT4, {"dtype": "bf16", "row_block": 128, "few_rows": 4}, "tdpbf16ps"),
    ],
    ids=["gemm", "gemm_int8", "gemm_int4_w4a8", "gemm_int4_w4a16"],
)
def test_amx_builds_compile_with_the_tile_path(cache, module, params, product):
    so = _amx_build(module, params or _gemm_params(), cache)
    code = _mnemonics(so)
    for mnemonic in (product, "ldtilecfg", "tileloadd", "tilestored", "tilezero", "tilerelease"):
        assert mnemonic in code, f"the amx build of {module.name} has no {mnemonic}"


def test_gemm_ops_build_amx_exactly_where_it_runs(monkeypatch):
    """The ops run their amx builds where the CPU and OS allow AMX, else the avx512 ones (no kernel is
    loaded: only which build dispatch would pick)."""
    monkeypatch.setattr(isa, "_forced", None)
    monkeypatch.setattr(isa, "_forced_read_env", True)  # KERNFORGE_ISA unread
    with_amx = isa.cpu_features() | set(isa.TIERS["amx"].requires)
    for features, tier in [(with_amx, "amx"), (with_amx - {"amx_tile"}, "avx512"), (with_amx - {"amx_int8"}, "avx512")]:
        monkeypatch.setattr(isa, "_features", frozenset(features))
        assert GEMM.variant(**_gemm_params()).spec().tier == tier
        assert GEMM_INT8.variant(dtype="bf16").spec().tier == tier


# --------------------------------------------------------------------------- on AMX hardware


@pytest.fixture
def amx():
    if "amx" not in isa.runnable_tiers():
        missing = [f for f in isa.TIERS["amx"].requires if f not in isa.cpu_features()]
        pytest.skip(f"this CPU/OS cannot run AMX tiles (missing or not granted: {', '.join(missing)})")
    with kernforge.use_isa("amx"):
        yield


@pytest.mark.parametrize("m,n,k", [(1, 47, 17), (5, 33, 64), (33, 47, 129), (256, 64, 4109)])
def test_amx_bf16_linear_matches_torch(amx, m, n, k):
    x, w, bias = _bf16_operands(m, n, k, ("hardware",))
    out = weight_packed_linear(x, convert_weight_packed(w), bias)
    reference = linear_reference(x, w, bias)
    torch.testing.assert_close(out.float(), reference, rtol=1e-2, atol=1e-2 * k**0.5)


@pytest.mark.parametrize("m,n,k", [(1, 15, 17), (5, 64, 64), (33, 70, 129), (256, 130, 4109)])
def test_amx_int8_is_bit_exact(amx, m, n, k):
    a_q, w, scale = _int8_operands(m, n, k, ("hardware",))
    packed = convert_weight_packed_int8(w, scale)
    assert torch.equal(int8_accumulate(a_q, packed).double(), int8_accumulate_reference(a_q, w))
    x = torch.randn(m, k, generator=seeded("amx-int8-x", m, k)).bfloat16()
    q, q_scale = per_token_quant_int8(x)
    ref = int8_linear_reference(q, q_scale, w, scale)
    torch.testing.assert_close(
        int8_scaled_mm(q, packed, q_scale).float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item()
    )
