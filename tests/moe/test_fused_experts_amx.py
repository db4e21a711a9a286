"""The AMX path of fused_experts (kernforge/moe/experts.h: row blocks of 5 rows or more in tiles, bf16
and int8 weights, and fp8 ones converted to bf16 pairs per K block).

As for the GEMM (tests/gemm/test_gemm_amx.py), three ways: the real template built on the avx512 tier
with the tile instructions emulated, against the float32 loop; the real amx build compiled here and
holding the tile instructions; on AMX hardware, the ``tier`` fixture of test_fused_experts.py runs
every case under amx.
"""

import shutil
import subprocess

import pytest
import torch
from test_fused_experts import check, int8_reference, make_fp8_weights, make_int8_weights, make_weights, route

from kernforge.cache import disk
from kernforge.jit import core, isa
from kernforge.jit.module import Entry, Module
from kernforge.ops.moe.experts import EXPERTS, pack_experts, pack_experts_fp8, pack_experts_int8, run_kernel

from op_helpers import seeded
from references import fp8_block_dequantize

pytestmark = pytest.mark.usefixtures("test_templates")

EXPERTS_EMULATED = Module(
    "moe_amx_emulated",
    "moe_amx_emulated.cpp.jinja",
    params=EXPERTS.params,
    structs=EXPERTS.structs.values(),
    entries=[*EXPERTS.entries.values(), Entry("take_counters", "int64_t counters")],
    tiers={"avx512": "avx512"},
    register=False,
)


def _emulated(weights: str):
    if not isa.runnable("avx512"):
        pytest.skip("the emulated AMX kernels are built on the avx512 tier, which this CPU cannot run")
    return core.load_kernel(EXPERTS_EMULATED, {"dtype": "bf16", "weights": weights}, "avx512")


@pytest.fixture(scope="module")
def emulated(test_templates):
    return _emulated("bf16")


@pytest.fixture(scope="module")
def emulated_int8(test_templates):
    return _emulated("int8")


@pytest.fixture(scope="module")
def emulated_fp8(test_templates):
    return _emulated("fp8")


def _counters(kernel) -> tuple[int, int]:
    """(faults, dot-product instructions) since the last call."""
    counters = torch.zeros(3, dtype=torch.int64)
    kernel.take_counters(counters.data_ptr())
    faults, _, dots = counters.tolist()
    return faults, dots


# tokens, hidden, inter, experts, k: row blocks of 1 to 64 rows (tiles from 5), K tails (H, I not
# multiples of 32), and experts with one row (vectors) beside experts with many (tiles)
@pytest.mark.parametrize(
    "tokens,hidden,inter,experts,k", [(40, 96, 64, 4, 2), (100, 72, 50, 8, 3), (3, 64, 32, 8, 2), (70, 33, 17, 2, 1)]
)
def test_emulated_tiles_match_the_float32_loop(emulated, tokens, hidden, inter, experts, k):
    g = seeded("moe-amx-emu", tokens, hidden, inter, experts, k)
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    w1, w2 = make_weights(experts, hidden, inter, g)
    topk_weights, topk_ids = route(tokens, experts, k, g)
    out = torch.empty_like(x)
    _counters(emulated)
    status = run_kernel(emulated, out, x, pack_experts(w1, gated=True), pack_experts(w2), topk_weights, topk_ids)
    faults, dots = _counters(emulated)
    assert status == 0 and faults == 0
    rows_per_expert = torch.bincount(topk_ids.view(-1).long(), minlength=experts)
    assert (dots > 0) == bool((rows_per_expert >= 5).any())  # tiles exactly where a block has 5 rows
    check(out, x, w1, w2, topk_weights, topk_ids)


@pytest.mark.parametrize("tokens,hidden,inter,experts,k", [(40, 130, 64, 4, 2), (3, 64, 64, 8, 2), (70, 67, 33, 2, 1)])
def test_emulated_int8_tiles_match_the_reference_that_quantizes_alike(emulated_int8, tokens, hidden, inter, experts, k):
    g = seeded("moe-amx-emu-int8", tokens, hidden, inter, experts, k)
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    w1, s1, w2, s2 = make_int8_weights(experts, hidden, inter, g)
    topk_weights, topk_ids = route(tokens, experts, k, g)
    out = torch.empty_like(x)
    _counters(emulated_int8)
    p1, p2 = pack_experts_int8(w1, s1, gated=True), pack_experts_int8(w2, s2)
    assert run_kernel(emulated_int8, out, x, p1, p2, topk_weights, topk_ids) == 0
    faults, dots = _counters(emulated_int8)
    assert faults == 0
    rows_per_expert = torch.bincount(topk_ids.view(-1).long(), minlength=experts)
    assert (dots > 0) == bool((rows_per_expert >= 5).any())
    expected = int8_reference(x, w1, s1, w2, s2, topk_weights, topk_ids)
    assert (out.float() - expected).abs().max().item() <= 1.6e-2 * expected.abs().max().item()


@pytest.mark.parametrize("weights,product", [("bf16", "tdpbf16ps"), ("int8", "tdpbusd"), ("fp8", "tdpbf16ps")])
def test_amx_build_compiles_with_the_tile_path(cache, weights, product):
    result, _ = core.build(core.KernelSpec.make(EXPERTS, {"dtype": "bf16", "weights": weights}, "amx"), load=False)
    so = disk.Entry(cache, result.key).so
    if shutil.which("objdump") is None:
        pytest.skip("objdump (binutils) is not installed: cannot look into the built library")
    code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(so)], capture_output=True, text=True).stdout
    for mnemonic in (product, "ldtilecfg", "tileloadd", "tilestored", "tilezero", "tilerelease"):
        assert mnemonic in code, f"the amx build of moe_experts ({weights} weights) has no {mnemonic}"


@pytest.mark.parametrize("tokens,hidden,inter,experts,k", [(40, 130, 64, 4, 2), (3, 64, 64, 8, 2)])
def test_emulated_fp8_converts_k_blocks_for_the_tiles(emulated_fp8, tokens, hidden, inter, experts, k):
    """fp8 weights: from 5 rows on, each K block is converted to bf16 pairs and multiplied in tiles."""
    g = seeded("moe-amx-emu-fp8", tokens, hidden, inter, experts, k)
    block = (32, 64)
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    w1, s1, w2, s2 = make_fp8_weights(experts, hidden, inter, block, g)
    topk_weights, topk_ids = route(tokens, experts, k, g)
    out = torch.empty_like(x)
    _counters(emulated_fp8)
    p1, p2 = pack_experts_fp8(w1, s1, block, gated=True), pack_experts_fp8(w2, s2, block)
    assert run_kernel(emulated_fp8, out, x, p1, p2, topk_weights, topk_ids) == 0
    faults, dots = _counters(emulated_fp8)
    assert faults == 0
    rows_per_expert = torch.bincount(topk_ids.view(-1).long(), minlength=experts)
    assert (dots > 0) == bool((rows_per_expert >= 5).any())
    dequantized = [
        torch.stack([fp8_block_dequantize(w[e], s[e], block) for e in range(experts)]) for w, s in ((w1, s1), (w2, s2))
    ]
    check(out, x, *dequantized, topk_weights, topk_ids)
