"""The ops' ``bound_*`` forms (a prepared decode step's calls): checked once, then each call runs the
kernel on whatever its tensors hold at that moment, exactly as the op would.

Each bound call is run, its inputs rewritten in place, and run again; both results must equal the
eager op's on the same values (the same kernel: bit for bit). Bad arguments raise at binding.
"""

import pytest
import torch

import kernforge
import kernforge.nn
from kernforge.ops.activation import bound_gated
from kernforge.ops.attention._wrapper import PlanStateError
from kernforge.ops.attention.page import bound_append_paged_kv_cache
from kernforge.ops.gemm import bf16, gguf
from kernforge.ops.gemm.bf16 import bound_weight_packed_linear
from kernforge.ops.norm import bound_rmsnorm
from kernforge.ops.rope import bound_rope_with_cos_sin_cache_inplace

DTYPES = [torch.bfloat16, torch.float32]


def _rows(*shape, dtype=torch.bfloat16, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bound_rmsnorm_reads_its_input_when_called(dtype, tier):
    x, weight, out = _rows(3, 111, dtype=dtype), _rows(111, dtype=dtype, seed=1), torch.empty(3, 111, dtype=dtype)
    call = bound_rmsnorm(x, weight, 1e-5, out)
    for seed in (2, 3):
        x.copy_(_rows(3, 111, dtype=dtype, seed=seed))
        call()
        assert torch.equal(out, kernforge.rmsnorm(x, weight, 1e-5))


def test_bound_rmsnorm_over_heads_of_a_strided_view(tier):
    qkv = _rows(2, 5 * 64)
    q = qkv[:, : 3 * 64].view(2, 3, 64)  # rows of q inside the packed q|k|v
    out, weight = torch.empty(2, 3, 64, dtype=torch.bfloat16), _rows(64, seed=1)
    bound_rmsnorm(q, weight, 1e-6, out)()
    assert torch.equal(out, kernforge.rmsnorm(q.contiguous(), weight, 1e-6))


@pytest.mark.parametrize("op", ["silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"])
def test_bound_gated_activation(op, tier):
    x, out = _rows(2, 2 * 173), torch.empty(2, 173, dtype=torch.bfloat16)
    call = bound_gated(op, x, out)
    for seed in (1, 2):
        x.copy_(_rows(2, 2 * 173, seed=seed))
        call()
        assert torch.equal(out, getattr(kernforge, op)(x))


def test_bound_gated_names_a_gated_op():
    with pytest.raises(ValueError, match="op must be one of"):
        bound_gated("relu", _rows(1, 4), torch.empty(1, 2, dtype=torch.bfloat16))


def test_bound_rope_reads_the_positions_it_holds_when_called(tier):
    heads, kv_heads, head_dim, rows = 3, 1, 64, 2
    angles = torch.arange(64, dtype=torch.float32)[:, None] * torch.rand(head_dim // 2)[None]
    cache = torch.cat([angles.cos(), angles.sin()], dim=1)
    qkv = _rows(rows, (heads + 2 * kv_heads) * head_dim)
    q, k = qkv[:, : heads * head_dim], qkv[:, heads * head_dim : (heads + kv_heads) * head_dim]
    positions = torch.zeros(rows, dtype=torch.int64)
    call = bound_rope_with_cos_sin_cache_inplace(positions, q, k, head_dim, cache, is_neox=True)
    for step in (5, 63):
        positions.fill_(step)
        fresh = _rows(rows, qkv.shape[1], seed=step)
        qkv.copy_(fresh)
        expected_q, expected_k = (
            fresh[:, : heads * head_dim].clone(),
            fresh[:, heads * head_dim :][:, :head_dim].clone(),
        )
        kernforge.apply_rope_with_cos_sin_cache_inplace(positions, expected_q, expected_k, head_dim, cache)
        call()
        assert torch.equal(q, expected_q) and torch.equal(k, expected_k), f"position {step}"
    positions.fill_(64)  # past the cache's rows: the kernel's check, raised by the call
    with pytest.raises(ValueError, match="out of range for cos_sin_cache"):
        call()


def test_bound_rope_takes_contiguous_positions_only():
    q, k = _rows(2, 64), _rows(2, 64)
    positions = torch.zeros(2, 2, dtype=torch.int64)[:, 0]
    with pytest.raises(ValueError, match="positions must be contiguous"):
        bound_rope_with_cos_sin_cache_inplace(positions, q, k, 64, torch.zeros(8, 64), is_neox=True)


def _paged_layers(layers=3, pages=6, kv_heads=2, page_size=4, head_dim=64):
    return torch.zeros(layers, pages, 2, kv_heads, page_size, head_dim, dtype=torch.bfloat16)


def _page_table():
    # two requests: pages [4, 1] holding 6 tokens, and [3] holding 2; each appends one token
    kv_indices = torch.tensor([4, 1, 3], dtype=torch.int32)
    kv_indptr = torch.tensor([0, 2, 3], dtype=torch.int32)
    last_page_len = torch.tensor([2, 2], dtype=torch.int32)
    batch_indices, positions = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([5, 1], dtype=torch.int32)
    return batch_indices, positions, kv_indices, kv_indptr, last_page_len


def test_bound_append_writes_each_layer_where_the_op_would(tier):
    caches, expected = _paged_layers(), _paged_layers()
    batch_indices, positions, kv_indices, kv_indptr, last_page_len = _page_table()
    key, value = _rows(2, 2, 64), _rows(2, 2, 64, seed=1)
    append = bound_append_paged_kv_cache(
        key, value, batch_indices, positions, list(caches), kv_indices, kv_indptr, last_page_len, kv_layout="HND"
    )
    for layer in (2, 0):
        key.copy_(_rows(2, 2, 64, seed=10 + layer))  # the call reads the rows as they are now
        append(layer)
        kernforge.append_paged_kv_cache(
            key, value, batch_indices, positions, expected[layer], kv_indices, kv_indptr, last_page_len, kv_layout="HND"
        )
    assert torch.equal(caches, expected)
    assert not caches[1].any(), "a layer not called is untouched"


def test_bound_append_checks_its_arguments_once():
    batch_indices, positions, kv_indices, kv_indptr, last_page_len = _page_table()
    key, value = _rows(2, 2, 64), _rows(2, 2, 64)
    layers = list(_paged_layers())
    args = (batch_indices, positions, layers, kv_indices, kv_indptr, last_page_len)
    with pytest.raises(ValueError, match=r"paged_kv_caches\[1\] differs"):
        bound_append_paged_kv_cache(key, value, *args[:2], [layers[0], layers[1][:3]], *args[3:], kv_layout="HND")
    with pytest.raises(ValueError, match="contiguous head_dim"):
        strided = torch.zeros(2, 2, 128, dtype=torch.bfloat16)[..., ::2]
        bound_append_paged_kv_cache(strided, value, *args, kv_layout="HND")
    with pytest.raises(TypeError, match="non-empty sequence"):
        bound_append_paged_kv_cache(key, value, *args[:2], [], *args[3:], kv_layout="HND")
    bad_page = kv_indices.clone()
    bad_page[1] = 99  # the page request 0's new token lands in
    append = bound_append_paged_kv_cache(key, value, *args[:3], bad_page, *args[4:], kv_layout="HND")
    with pytest.raises(ValueError, match="kv_indices"):
        append(0)
    assert not torch.stack(layers).any(), "a refused append wrote nothing"


def test_bound_decode_run_attends_each_layer_as_run_does(tier):
    caches = _paged_layers()
    caches.normal_(generator=torch.Generator().manual_seed(3))
    _, _, kv_indices, kv_indptr, last_page_len = _page_table()
    wrapper = kernforge.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), "HND")
    wrapper.plan(kv_indptr, kv_indices, last_page_len, 4, 2, 64, 4, q_data_type=torch.bfloat16)
    q, out = _rows(2, 4, 64), torch.empty(2, 4, 64, dtype=torch.bfloat16)
    attend = wrapper.bound_run(q, list(caches), out)
    for layer in (1, 2):
        q.copy_(_rows(2, 4, 64, seed=layer))
        attend(layer)
        assert torch.equal(out, wrapper.run(q, caches[layer])), f"layer {layer}"


def test_bound_decode_run_needs_a_plan_and_one_cache_geometry():
    wrapper = kernforge.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), "HND")
    q, out, caches = _rows(2, 4, 64), torch.empty(2, 4, 64, dtype=torch.bfloat16), list(_paged_layers())
    with pytest.raises(PlanStateError, match="before plan"):
        wrapper.bound_run(q, caches, out)
    _, _, kv_indices, kv_indptr, last_page_len = _page_table()
    wrapper.plan(kv_indptr, kv_indices, last_page_len, 4, 2, 64, 4, q_data_type=torch.bfloat16)
    with pytest.raises(ValueError, match=r"paged_kv_caches\[1\] differs"):
        wrapper.bound_run(q, [caches[0], caches[1].float()], out)
    with pytest.raises(ValueError):
        wrapper.bound_run(_rows(3, 4, 64), caches, out)  # q of another batch than planned


@pytest.mark.parametrize("qtypes", [("Q4_0",), ("Q4_1", "Q8_0")])  # two parts: a fused layer of two types
def test_bound_gguf_linear_equals_the_runner(qtypes, tier):
    gguf_quants = pytest.importorskip("gguf").quants
    from gguf import GGMLQuantizationType

    parts = []
    for index, qtype in enumerate(qtypes):
        weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(index)).numpy()
        blocks = gguf_quants.quantize(weight, GGMLQuantizationType[qtype])
        parts.append(gguf.pack_gguf(torch.from_numpy(blocks), qtype, 64, 256))
    runner = gguf.GGUFLinearRunner(parts)
    x, out = _rows(3, 256), torch.empty(3, runner.n, dtype=torch.bfloat16)
    call = runner.bound(x, out)
    for seed in (1, 2):
        x.copy_(_rows(3, 256, seed=seed))
        call()
        assert torch.equal(out, runner(x))
    with pytest.raises(ValueError, match="out must be a contiguous"):
        runner.bound(x, torch.empty(3, runner.n + 1, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="share a dtype"):
        runner.bound(x, torch.empty(3, runner.n, dtype=torch.float32))


@pytest.mark.parametrize("quant", [None, "int8"])
def test_bound_linear_equals_its_forward(quant, tier):
    layer = torch.nn.Linear(96, 72, bias=True)
    linear = kernforge.nn.Linear.from_linear(layer, dtype=torch.bfloat16, quant=quant)
    x, out = _rows(3, 96), torch.empty(3, 72, dtype=torch.bfloat16)
    call = linear.bound(x, out)
    for seed in (1, 2):
        x.copy_(_rows(3, 96, seed=seed))
        call()
        assert torch.equal(out, linear(x))


def test_bound_weight_packed_linear_reads_rows_in_place():
    packed = bf16.convert_weight_packed(_rows(72, 96))
    with pytest.raises(ValueError, match="unit last stride"):
        bound_weight_packed_linear(_rows(3, 192)[:, ::2], packed, None, torch.empty(3, 72, dtype=torch.bfloat16))
