"""Tests for ``kernforge.torch_library``: kernforge's ops as ``torch.ops.kernforge`` custom ops.

* Schemas: every op's written arguments (``Tensor(a!)``) are exactly the ones listed here.
* Every op: the custom op gives the Python op's result bit for bit (the same kernel on the same
  arguments, written arguments included), and ``torch.library.opcheck`` passes: ``test_schema``
  (the op writes exactly what its schema says and returns nothing aliasing its inputs),
  ``test_faketensor`` (the fake implementation's outputs match the real ones' shape, dtype and
  strides) and ``test_aot_dispatch_dynamic`` (AOTAutograd traces it with dynamic shapes and runs it).
* A Llama-like layer written with the module's functions (rmsnorm, packed linear, in-place RoPE on
  views of the qkv output, append to a paged cache, prefill and decode attention, fused add-rmsnorm,
  silu_and_mul) has 0 graph breaks under ``torch._dynamo.explain``, and compiled
  (``backend="aot_eager"``) gives the eager layer's output and cache bit for bit; a new plan for the
  next step reuses the compiled graph.
* Attention handles: a dead or mismatched handle raises, a traced unregistered wrapper says what to do.

Kernels run on the best tier only (these tests are about the registration, not the kernels), with
the dtypes and attention geometry the op tests use (bf16, 8 query heads on 2 KV heads, head dim 128),
so the suite compiles no variant for this file alone.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch._dynamo.testing

import kernforge
from kernforge import torch_library as tl
from kernforge.ops.attention import decode, prefill
from kernforge.ops.gemm import bf16 as gemm
from kernforge.ops.gemm import int8 as gemm_int8
from kernforge.ops.moe import experts as moe_experts

from op_helpers import randn, seeded

BF16 = torch.bfloat16
QO_HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 8, 2, 128, 16
OPCHECK_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")

# Each op's written arguments, stated independently of the module.
WRITES = {
    "rmsnorm": set(),
    "rmsnorm_out": {"out"},
    "gemma_rmsnorm": set(),
    "gemma_rmsnorm_out": {"out"},
    "fused_add_rmsnorm": {"input", "residual"},
    "gemma_fused_add_rmsnorm": {"input", "residual"},
    "silu_and_mul": set(),
    "silu_and_mul_out": {"out"},
    "gelu_and_mul": set(),
    "gelu_and_mul_out": {"out"},
    "gelu_tanh_and_mul": set(),
    "gelu_tanh_and_mul_out": {"out"},
    "apply_rope_pos_ids": set(),
    "apply_rope_pos_ids_inplace": {"q", "k"},
    "apply_llama31_rope_pos_ids": set(),
    "apply_llama31_rope_pos_ids_inplace": {"q", "k"},
    "apply_rope": set(),
    "apply_rope_inplace": {"q", "k"},
    "apply_llama31_rope": set(),
    "apply_llama31_rope_inplace": {"q", "k"},
    "apply_rope_with_cos_sin_cache": set(),
    "apply_rope_with_cos_sin_cache_inplace": {"query", "key"},
    "append_paged_kv_cache": {"paged_kv_cache", "paged_v_cache"},
    "weight_packed_linear": set(),
    "weight_packed_linear_out": {"out"},
    "int8_scaled_mm_with_quant": set(),
    "int4_scaled_mm_cpu": set(),
    "int4_w4a16_linear": set(),
    "fused_experts": set(),
    "fused_experts_out": {"out"},
    "shared_expert": set(),
    "shared_expert_out": {"out"},
    "top_k_top_p_sampling_from_logits": set(),
    "topk_softmax": set(),
    "topk_sigmoid": set(),
    "grouped_topk": set(),
    "biased_grouped_topk": set(),
    "attention_run": set(),
    "attention_run_return_lse": set(),
}


def custom_op(name: str):
    return getattr(torch.ops.kernforge, name)


def bf16(shape, g, scale=1.0):
    return randn(shape, g, scale).to(BF16)


@pytest.fixture(scope="module")
def workspace():
    return torch.empty(32 << 20, dtype=torch.uint8)


def test_schemas_state_exactly_what_each_op_writes():
    assert set(tl.SCHEMAS) == set(WRITES)
    for name in tl.SCHEMAS:
        schema = custom_op(name).default._schema
        written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert written == WRITES[name], name
        assert all(r.alias_info is None for r in schema.returns), f"{name} returns an alias of an input"


# --------------------------------------------------------------------------- cases: one per op (form)


class Case(NamedTuple):
    args: tuple
    python: Callable  # the Python op on the same arguments: what the custom op must return
    kwargs: dict = {}
    keep: object = None  # what must outlive the call (an attention wrapper)


def _writes_out(op):
    """The Python op called as an ``<op>_out`` custom op is: the result in ``out``, nothing returned."""

    def call(*args, out):
        op(*args, out=out)

    return call


def _norm_input(g):
    return bf16((7, 80), g)[:, :67], bf16((67,), g)  # strided rows, hidden not a multiple of the vector width


def _norm_case(op, g):
    x, w = _norm_input(g)
    return Case((x, w, 1e-5), op)


def _norm_out_case(op, g):
    x, w = _norm_input(g)
    return Case((x, w, 1e-5), _writes_out(op), {"out": torch.empty(7, 67, dtype=BF16)})


def _fused_add_case(op, g):
    x, w = _norm_input(g)
    return Case((x, bf16((7, 67), g), w, 1e-5), op)


def _gated_case(op, g):
    return Case((bf16((3, 5, 74), g),), op)


def _gated_out_case(op, g):
    return Case((bf16((3, 5, 74), g),), _writes_out(op), {"out": torch.empty(3, 5, 37, dtype=BF16)})


def _qk(g, nnz=5, head_dim=64):
    """q [nnz, 4, D] and k [nnz, 2, D]: views of one packed qkv tensor, as models make them."""
    qkv = bf16((nnz, 8 * head_dim), g)
    return qkv[:, : 4 * head_dim].view(nnz, 4, head_dim), qkv[:, 4 * head_dim : 6 * head_dim].view(nnz, 2, head_dim)


def _rope_pos_ids_case(op, g):
    q, k = _qk(g)
    return Case((q, k, torch.tensor([3, 0, 7, 100, 2], dtype=torch.int32), 48, False, 2.0, 1e4), op)


def _llama31_pos_ids_case(op, g):
    q, k = _qk(g)
    return Case((q, k, torch.tensor([3, 0, 7, 9000, 2], dtype=torch.int64)), op)


def _rope_segments_case(op, g):
    q, k = _qk(g)
    return Case(
        (q, k, torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([4, 0], dtype=torch.int32)),
        op,
        {"interleave": True},
    )


def _cos_sin_case(op, g):
    qkv = bf16((5, 8 * 64), g)
    angles = torch.arange(32)[:, None] * torch.linspace(0.01, 1.0, 16)[None]
    cache = torch.cat([angles.cos(), angles.sin()], dim=1).float()  # [32 positions, rotary_dim 32]
    return Case((torch.tensor([3, 0, 7, 31, 2]), qkv[:, :256], qkv[:, 256:384], 64, cache, False), op)


def _paged_batch(g, kv_lens, num_pages=8):
    """Pages in a shuffled order: (indptr, indices, last_page_len) for requests of ``kv_lens`` tokens."""
    counts = [-(-n // PAGE_SIZE) for n in kv_lens]
    indices = torch.randperm(num_pages, generator=g)[: sum(counts)].to(torch.int32)
    indptr = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    last = torch.tensor([(n - 1) % PAGE_SIZE + 1 for n in kv_lens], dtype=torch.int32)
    return indptr, indices, last


def _append_case(g, pair: bool):
    kv_lens, new = [20, 7], torch.tensor([0, 3, 5], dtype=torch.int32)  # the last 3 and 2 tokens are new
    indptr, indices, last = _paged_batch(g, kv_lens)
    batch_indices, positions = kernforge.get_batch_indices_positions(new, torch.tensor(kv_lens, dtype=torch.int32), 5)
    cache = bf16((8, 2, PAGE_SIZE, KV_HEADS, HEAD_DIM), g)
    k, v = bf16((5, KV_HEADS, HEAD_DIM), g), bf16((5, KV_HEADS, HEAD_DIM), g)
    halves = (cache[:, 0], cache[:, 1]) if pair else (cache, None)
    return Case(
        (k, v, batch_indices, positions, *halves, indices, indptr, last),
        lambda k, v, b, p, kv, v_cache, *rest: kernforge.append_paged_kv_cache(
            k, v, b, p, kv if v_cache is None else (kv, v_cache), *rest
        ),
    )


def _packed(g, n=45, k=70):
    return gemm.convert_weight_packed(bf16((n, k), g, 0.1))


def _linear_case(g):
    packed = _packed(g)
    return Case(
        (bf16((2, 3, 70), g), packed.packed, packed.n, packed.k, packed.panel_width, bf16((45,), g)),
        lambda x, p, n, k, width, bias: kernforge.weight_packed_linear(x, packed, bias),
    )


def _linear_out_case(g):
    packed = _packed(g)
    return Case(
        (bf16((3, 70), g), packed.packed, packed.n, packed.k, packed.panel_width, None),
        _writes_out(lambda x, p, n, k, width, bias, out: kernforge.weight_packed_linear(x, packed, bias, out)),
        {"out": torch.empty(3, 45, dtype=BF16)},
    )


def _int8_case(g):
    weight = torch.randint(-127, 128, (45, 70), generator=g, dtype=torch.int8)
    packed = gemm_int8.convert_weight_packed_int8(weight, randn((45,), g).abs() * 0.01)
    return Case(
        (
            bf16((3, 70), g),
            packed.packed,
            packed.compensation,
            packed.scale,
            packed.n,
            packed.k,
            packed.panel_width,
            randn((45,), g),
        ),
        lambda x, *weight_args: kernforge.int8_scaled_mm_with_quant(x, packed, weight_args[-1]),
    )


def _int4_case(op, g):
    packed = kernforge.quantize_int4(randn((45, 64), g), group_size=32)
    return Case((bf16((3, 64), g), *packed, randn((45,), g)), op)


def _experts_case(g, int8=False, fp8=False, out=False):
    """fused_experts on 9 tokens, 8 experts of H 40 and I 24 (a gated w1 in two parts), k 2."""
    if fp8:
        w1, w2 = (randn(shape, g, 8.0).to(torch.float8_e4m3fn) for shape in ((8, 48, 40), (8, 40, 24)))
        w1 = moe_experts.pack_experts_fp8(w1, randn((8, 3, 3), g).abs() * 1e-2, (16, 16), gated=True)
        w2 = moe_experts.pack_experts_fp8(w2, randn((8, 3, 2), g).abs() * 1e-2, (16, 16))
    elif int8:
        w1, w2 = (
            torch.randint(-127, 128, shape, generator=g, dtype=torch.int8) for shape in ((8, 48, 40), (8, 40, 24))
        )
        w1 = moe_experts.pack_experts_int8(w1, randn((8, 48), g).abs() * 1e-3, gated=True)
        w2 = moe_experts.pack_experts_int8(w2, randn((8, 40), g).abs() * 1e-3)
    else:
        w1 = moe_experts.pack_experts(bf16((8, 48, 40), g, 0.1), gated=True)
        w2 = moe_experts.pack_experts(bf16((8, 40, 24), g, 0.1))
    weights, ids = torch.topk(randn((9, 8), g).softmax(-1), 2)
    tensors = [bf16((9, 40), g)]
    for packed in (w1, w2):
        words = packed.packed.view(torch.uint8) if fp8 else packed.packed  # fp8 as its bytes
        tensors += [words, getattr(packed, "compensation", None), getattr(packed, "scale", None)]
        tensors += [packed.n, packed.k]
    tensors += [weights, ids.to(torch.int32)]
    if fp8:
        tensors += list(w1.block_size)

    def python(x, *args, out=None):
        ids = args[-3] if fp8 else args[-1]  # (then the block size follows)
        weights = args[-4] if fp8 else args[-2]
        return kernforge.fused_experts(x, w1, w2, weights, ids, use_int8_w8a8=int8, use_fp8_w8a16=fp8, out=out)

    if out:
        return Case(tuple(tensors), _writes_out(python), {"out": torch.empty(9, 40, dtype=BF16)})
    return Case(tuple(tensors), python)


def _shared_expert_case(g, out=False):
    """shared_expert on 9 tokens (H 40, I 24) plus 2.5 times a routed output."""
    w1 = moe_experts.pack_experts(bf16((1, 48, 40), g, 0.1), gated=True)
    w2 = moe_experts.pack_experts(bf16((1, 40, 24), g, 0.1))
    routed = bf16((9, 40), g)
    tensors = (bf16((9, 40), g), w1.packed, None, None, 48, 40, w2.packed, None, None, 40, 24, routed, 2.5)

    def python(x, *args, out=None):
        return kernforge.shared_expert(x, w1, w2, routed, 2.5, out=out)

    if out:
        return Case(tensors, _writes_out(python), {"out": torch.empty(9, 40, dtype=BF16)})
    return Case(tensors, python)


def _sampling_case(g):
    logits = randn((4, 1000), g, 3.0)
    return Case(
        (
            logits,
            torch.tensor([50, 1, 1000, 7]),
            torch.tensor([0.9, 1.0, 0.5, 0.0]),
            torch.tensor([1234567], dtype=torch.int64),
            torch.tensor([3], dtype=torch.int64),
        ),
        lambda logits, top_k, top_p, seed, offset: kernforge.top_k_top_p_sampling_from_logits(
            logits, top_k, top_p, seed=seed, offset=offset, return_valid=True
        ),
    )


def _routing_case(op, g, grouped=False, biased=False):
    """5 tokens of 64 experts (bf16 gating, a column slice), k = 6; grouped: 8 groups, 3 kept, a
    fused shared expert and a scaling factor."""
    gating = bf16((5, 70), g)[:, :64]
    head = (bf16((5, 16), g), gating) + ((randn((64,), g, 0.1),) if biased else ())
    tail = (8, 3, 1, 2.5) if grouped else ()
    return Case((*head, 6, True, *tail), op)


KV_LENS, QO_LENS = [20, 7], [3, 5]


def _decode_case(g, workspace, wrapper_class, return_lse=False):
    indptr, indices, last = _paged_batch(g, KV_LENS)
    wrapper = wrapper_class(workspace)
    wrapper.plan(indptr, indices, last, QO_HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE, q_data_type=BF16)
    tl.register_wrapper(wrapper)
    cache = bf16((8, 2, PAGE_SIZE, KV_HEADS, HEAD_DIM), g)
    q = bf16((2, QO_HEADS, HEAD_DIM), g)
    return Case(
        ([q, cache, None], wrapper._torch_library_handle, BF16, HEAD_DIM),
        lambda tensors, *planned: decode.BatchDecodeWithPagedKVCacheWrapper.run(
            wrapper, tensors[0], tensors[1], return_lse=return_lse
        ),
        keep=wrapper,
    )


def _prefill_case(g, workspace, return_lse=False):
    indptr, indices, last = _paged_batch(g, KV_LENS)
    wrapper = tl.BatchPrefillWithPagedKVCacheWrapper(workspace)
    qo_indptr = torch.tensor([0, 3, 8], dtype=torch.int32)
    wrapper.plan(
        qo_indptr, indptr, indices, last, QO_HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE, causal=True, q_data_type=BF16
    )
    cache = bf16((8, 2, PAGE_SIZE, KV_HEADS, HEAD_DIM), g)
    q = bf16((8, QO_HEADS, HEAD_DIM), g)
    return Case(
        ([q, cache[:, 0], cache[:, 1]], wrapper._torch_library_handle, BF16, HEAD_DIM, 0.5, 1.5, 0.75),
        lambda tensors, *planned: prefill.BatchPrefillWithPagedKVCacheWrapper.run(
            wrapper, tensors[0], tuple(tensors[1:]), q_scale=0.5, k_scale=1.5, v_scale=0.75, return_lse=return_lse
        ),
        keep=wrapper,
    )


def _ragged_case(g, workspace):
    wrapper = tl.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    wrapper.plan(
        torch.tensor([0, 3, 8], dtype=torch.int32),
        torch.tensor([0, 20, 27], dtype=torch.int32),
        QO_HEADS,
        KV_HEADS,
        HEAD_DIM,
        causal=True,
        q_data_type=BF16,
    )
    q, k, v = bf16((8, QO_HEADS, HEAD_DIM), g), bf16((27, KV_HEADS, HEAD_DIM), g), bf16((27, KV_HEADS, HEAD_DIM), g)
    return Case(
        ([q, k, v], wrapper._torch_library_handle, BF16, HEAD_DIM),
        lambda tensors, *planned: prefill.BatchPrefillWithRaggedKVCacheWrapper.run(wrapper, *tensors),
        keep=wrapper,
    )


def _mla_case(g, workspace, return_lse=False):
    from kernforge.ops.mla import attention as mla

    wrapper = tl.BatchMLAPagedAttentionWrapper(workspace)
    indptr, indices, _ = _paged_batch(g, KV_LENS)
    wrapper.plan(
        torch.tensor([0, 3, 8], dtype=torch.int32), indptr, indices, torch.tensor(KV_LENS, dtype=torch.int32),
        QO_HEADS, 512, 64, PAGE_SIZE, True, 0.07, BF16, BF16,
    )  # fmt: skip
    latent = bf16((8, PAGE_SIZE, 576), g)
    q = bf16((8, QO_HEADS, 576), g)
    tensors = [q[..., :512], q[..., 512:], latent[..., :512], latent[..., 512:]]
    return Case(
        (tensors, wrapper._torch_library_handle, BF16, 512, None, 1.5, 0.75),
        lambda tensors, *planned: mla.BatchMLAPagedAttentionWrapper.run(
            wrapper, *tensors, k_scale=1.5, v_scale=0.75, return_lse=return_lse
        ),
        keep=wrapper,
    )


CASES = {  # "op" or "op[form]" -> (g, workspace) -> Case
    **{
        name: (lambda op: lambda g, ws: _norm_case(op, g))(getattr(kernforge, name))
        for name in ("rmsnorm", "gemma_rmsnorm")
    },
    **{
        f"{name}_out": (lambda op: lambda g, ws: _norm_out_case(op, g))(getattr(kernforge, name))
        for name in ("rmsnorm", "gemma_rmsnorm")
    },
    **{
        name: (lambda op: lambda g, ws: _fused_add_case(op, g))(getattr(kernforge, name))
        for name in ("fused_add_rmsnorm", "gemma_fused_add_rmsnorm")
    },
    **{
        name: (lambda op: lambda g, ws: _gated_case(op, g))(getattr(kernforge, name))
        for name in ("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul")
    },
    **{
        f"{name}_out": (lambda op: lambda g, ws: _gated_out_case(op, g))(getattr(kernforge, name))
        for name in ("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul")
    },
    **{
        name: (lambda op: lambda g, ws: _rope_pos_ids_case(op, g))(getattr(kernforge, name))
        for name in ("apply_rope_pos_ids", "apply_rope_pos_ids_inplace")
    },
    **{
        name: (lambda op: lambda g, ws: _llama31_pos_ids_case(op, g))(getattr(kernforge, name))
        for name in ("apply_llama31_rope_pos_ids", "apply_llama31_rope_pos_ids_inplace")
    },
    **{
        name: (lambda op: lambda g, ws: _rope_segments_case(op, g))(getattr(kernforge, name))
        for name in ("apply_rope", "apply_rope_inplace", "apply_llama31_rope", "apply_llama31_rope_inplace")
    },
    **{
        name: (lambda op: lambda g, ws: _cos_sin_case(op, g))(getattr(kernforge, name))
        for name in ("apply_rope_with_cos_sin_cache", "apply_rope_with_cos_sin_cache_inplace")
    },
    "append_paged_kv_cache": lambda g, ws: _append_case(g, pair=False),
    "append_paged_kv_cache[pair]": lambda g, ws: _append_case(g, pair=True),
    "weight_packed_linear": lambda g, ws: _linear_case(g),
    "weight_packed_linear_out": lambda g, ws: _linear_out_case(g),
    "int8_scaled_mm_with_quant": lambda g, ws: _int8_case(g),
    "int4_scaled_mm_cpu": lambda g, ws: _int4_case(kernforge.int4_scaled_mm_cpu, g),
    "int4_w4a16_linear": lambda g, ws: _int4_case(kernforge.int4_w4a16_linear, g),
    "fused_experts": lambda g, ws: _experts_case(g),
    "fused_experts[int8]": lambda g, ws: _experts_case(g, int8=True),
    "fused_experts[fp8]": lambda g, ws: _experts_case(g, fp8=True),
    "fused_experts_out": lambda g, ws: _experts_case(g, out=True),
    "shared_expert": lambda g, ws: _shared_expert_case(g),
    "shared_expert_out": lambda g, ws: _shared_expert_case(g, out=True),
    "top_k_top_p_sampling_from_logits": lambda g, ws: _sampling_case(g),
    "topk_softmax": lambda g, ws: _routing_case(kernforge.topk_softmax, g),
    "topk_sigmoid": lambda g, ws: _routing_case(kernforge.topk_sigmoid, g),
    "grouped_topk": lambda g, ws: _routing_case(kernforge.grouped_topk, g, grouped=True),
    "biased_grouped_topk": lambda g, ws: _routing_case(kernforge.biased_grouped_topk, g, grouped=True, biased=True),
    "attention_run[decode]": lambda g, ws: _decode_case(g, ws, kernforge.BatchDecodeWithPagedKVCacheWrapper),
    "attention_run[prefill]": lambda g, ws: _prefill_case(g, ws),
    "attention_run[ragged]": lambda g, ws: _ragged_case(g, ws),
    "attention_run[mla]": lambda g, ws: _mla_case(g, ws),
    "attention_run_return_lse[mla]": lambda g, ws: _mla_case(g, ws, return_lse=True),
    "attention_run_return_lse[decode]": lambda g, ws: _decode_case(
        g, ws, tl.BatchDecodeWithPagedKVCacheWrapper, return_lse=True
    ),
    "attention_run_return_lse[prefill]": lambda g, ws: _prefill_case(g, ws, return_lse=True),
}


def _op_name(case_id: str) -> str:
    return case_id.split("[")[0]


def test_every_op_has_a_case():
    assert {_op_name(case_id) for case_id in CASES} == set(tl.SCHEMAS)


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return _tensors(list(value.values()))
    return [value]  # None, or a Python value


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_custom_op_gives_the_python_op_result(case_id, workspace):
    got_case = CASES[case_id](seeded(case_id), workspace)
    got = custom_op(_op_name(case_id))(*got_case.args, **got_case.kwargs)
    want_case = CASES[case_id](seeded(case_id), workspace)
    want = want_case.python(*want_case.args, **want_case.kwargs)
    # the results, then the tensor arguments afterwards (what the in-place ops wrote)
    got_args, want_args = (
        [t for t in _tensors([case.args, case.kwargs]) if isinstance(t, torch.Tensor)] for case in (got_case, want_case)
    )
    for a, b in zip(_tensors(got) + got_args, _tensors(want) + want_args, strict=True):
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            assert torch.equal(a, b), case_id
        else:
            assert a == b, case_id


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_opcheck(case_id, workspace):
    case = CASES[case_id](seeded(case_id), workspace)
    torch.library.opcheck(custom_op(_op_name(case_id)).default, case.args, case.kwargs, test_utils=OPCHECK_UTILS)


# --------------------------------------------------------------------------- attention handles


def test_attention_run_refuses_a_dead_or_mismatched_handle(workspace):
    case = CASES["attention_run[decode]"](seeded("handles"), workspace)
    tensors, handle, dtype, head_dim = case.args
    with pytest.raises(
        ValueError,
        match="out_dtype torch.float32 and head_dim_vo 128, but the wrapper's plan gives torch.bfloat16 and 128",
    ):
        custom_op("attention_run")(tensors, handle, torch.float32, head_dim)
    del case
    gc.collect()
    with pytest.raises(ValueError, match=f"no live attention wrapper has handle {handle}"):
        custom_op("attention_run")(tensors, handle, dtype, head_dim)


def test_register_wrapper_is_idempotent_and_checks_the_type(workspace):
    wrapper = kernforge.BatchDecodeWithPagedKVCacheWrapper(workspace)
    handle = tl.register_wrapper(wrapper)._torch_library_handle
    assert tl.register_wrapper(wrapper)._torch_library_handle == handle
    assert tl.BatchDecodeWithPagedKVCacheWrapper(workspace)._torch_library_handle > handle
    with pytest.raises(TypeError, match="wrapper must be one of kernforge's batch attention wrappers"):
        tl.register_wrapper(object())


def test_traced_unregistered_wrapper_says_to_register_it(workspace):
    case = CASES["attention_run[decode]"](seeded("unregistered"), workspace)
    wrapper = kernforge.BatchDecodeWithPagedKVCacheWrapper(workspace)
    wrapper._plan = case.keep._plan  # planned, never registered
    run = torch.compile(lambda q, cache: tl.attention_run(wrapper, q, cache), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="register_wrapper"):
        run(*case.args[0][:2])


class _SplitQueryRagged(prefill.BatchPrefillWithRaggedKVCacheWrapper):
    """A wrapper whose run() takes other tensors than q, paged_kv_cache (MLA's run(q_nope, q_pe, ckv,
    kpe) is the real case): the query in two parts. It states them through the traceable-run
    protocol and nothing else."""

    def run(self, q_a, q_b, k, v, **kwargs):
        return super().run(torch.cat([q_a, q_b], dim=-1), k, v, **kwargs)

    def traced_tensors(self, q_a, q_b, k, v):
        return [q_a, q_b, k, v]

    def run_arguments(self, tensors):
        return tuple(tensors)


class _TraceableSplitQueryRagged(tl._TraceableRun, _SplitQueryRagged):
    pass


def test_a_wrapper_with_its_own_run_signature_compiles_through_attention_run(workspace):
    g = seeded("split query")
    wrapper = _TraceableSplitQueryRagged(workspace)
    wrapper.plan(
        torch.tensor([0, 3, 8], dtype=torch.int32),
        torch.tensor([0, 20, 27], dtype=torch.int32),
        QO_HEADS,
        KV_HEADS,
        HEAD_DIM,
        causal=True,
        q_data_type=BF16,
    )
    q = bf16((8, QO_HEADS, HEAD_DIM), g)
    k, v = bf16((27, KV_HEADS, HEAD_DIM), g), bf16((27, KV_HEADS, HEAD_DIM), g)
    q_a, q_b = q[..., :40].contiguous(), q[..., 40:].contiguous()
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(lambda *t: wrapper.run(*t, return_lse=True), backend=counter, fullgraph=True)
    out, lse = compiled(q_a, q_b, k, v)
    expected, expected_lse = prefill.BatchPrefillWithRaggedKVCacheWrapper.run(wrapper, q, k, v, return_lse=True)
    assert counter.frame_count == 1 and torch.equal(out, expected) and torch.equal(lse, expected_lse)


# --------------------------------------------------------------------------- sampling, traced


def test_traced_sampling_takes_python_parameters_and_seeds():
    logits = randn((4, 1000), seeded("traced sampling"), 3.0)
    seed = torch.tensor([987], dtype=torch.int64)

    def sample(logits, seed):  # top_k above the vocabulary means no top-k, as eagerly
        return tl.top_k_top_p_sampling_from_logits(logits, 5000, 0.8, seed=seed, offset=2)

    traced = torch.compile(sample, backend="eager", fullgraph=True)
    assert torch.equal(
        traced(logits, seed), kernforge.top_k_top_p_sampling_from_logits(logits, 5000, 0.8, seed=seed, offset=2)
    )
    drawn = torch.compile(
        lambda logits: tl.top_k_top_p_sampling_from_logits(logits, 3, 0.9, return_valid=True),
        backend="eager",
        fullgraph=True,
    )(logits)  # seed from torch's default generator
    top3 = logits.topk(3).indices
    assert drawn[1].all() and (drawn[0][:, None].long() == top3).any(1).all()


# --------------------------------------------------------------------------- a layer, compiled


class PackedLinear(torch.nn.Module):
    """As kernforge.nn.Linear holds its weight: the packed tensor a buffer, the dataclass made per call."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("packed", gemm.convert_weight_packed(weight).packed)
        self.n, self.k = weight.shape

    def forward(self, x):
        return tl.weight_packed_linear(x, gemm.PackedWeight(self.packed, self.n, self.k))


class TinyLlamaLayer(torch.nn.Module):
    """A decoder layer on kernforge's ops: norm, qkv, RoPE, KV append, attention, o_proj, add-norm, MLP, norm."""

    def __init__(self, g, hidden=96, intermediate=80):
        super().__init__()
        self.register_buffer("input_norm", bf16((hidden,), g))
        self.register_buffer("post_norm", bf16((hidden,), g))
        self.register_buffer("final_norm", bf16((hidden,), g))
        self.qkv = PackedLinear(bf16(((QO_HEADS + 2 * KV_HEADS) * HEAD_DIM, hidden), g, 0.1))
        self.o_proj = PackedLinear(bf16((hidden, QO_HEADS * HEAD_DIM), g, 0.05))
        self.gate_up = PackedLinear(bf16((2 * intermediate, hidden), g, 0.1))
        self.down = PackedLinear(bf16((hidden, intermediate), g, 0.1))

    def forward(
        self, hidden, residual, pos_ids, batch_indices, positions, cache, kv_indices, kv_indptr, kv_last, wrapper
    ):
        tl.fused_add_rmsnorm(hidden, residual, self.input_norm)  # residual += hidden; hidden = norm(residual)
        qkv = self.qkv(hidden)
        q_size, kv_size = QO_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
        q = qkv[:, :q_size].view(-1, QO_HEADS, HEAD_DIM)
        k = qkv[:, q_size : q_size + kv_size].view(-1, KV_HEADS, HEAD_DIM)
        v = qkv[:, q_size + kv_size :].view(-1, KV_HEADS, HEAD_DIM)
        tl.apply_llama31_rope_pos_ids_inplace(q, k, pos_ids)
        tl.append_paged_kv_cache(k, v, batch_indices, positions, cache, kv_indices, kv_indptr, kv_last)
        attn = wrapper.run(q, cache)
        hidden = self.o_proj(attn.view(-1, q_size))
        tl.fused_add_rmsnorm(hidden, residual, self.post_norm)
        gate_up = self.gate_up(hidden)
        act = tl.silu_and_mul(gate_up, out=gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2))
        return tl.rmsnorm(self.down(act), self.final_norm, 1e-5), residual


class Sequences:
    """Two requests' pages and lengths, and the wrappers' plans for the next step."""

    def __init__(self, workspace, g):
        self.lengths = [0, 0]
        self.pages = [[0, 3], [5, 1]]  # page ids per request, not in order
        self.prefill = tl.BatchPrefillWithPagedKVCacheWrapper(workspace)
        self.decode = tl.BatchDecodeWithPagedKVCacheWrapper(workspace)
        self.g = g

    def step(self, new_tokens: list[int]):
        """Plan a step appending ``new_tokens`` per request; returns the layer's inputs after the cache."""
        self.lengths = [n + m for n, m in zip(self.lengths, new_tokens)]
        counts = [-(-n // PAGE_SIZE) for n in self.lengths]
        indices = torch.tensor([p for pages, c in zip(self.pages, counts) for p in pages[:c]], dtype=torch.int32)
        indptr = torch.tensor([0, counts[0], sum(counts)], dtype=torch.int32)
        last = torch.tensor([(n - 1) % PAGE_SIZE + 1 for n in self.lengths], dtype=torch.int32)
        qo_indptr = torch.tensor([0, new_tokens[0], sum(new_tokens)], dtype=torch.int32)
        batch_indices, positions = kernforge.get_batch_indices_positions(
            qo_indptr, torch.tensor(self.lengths, dtype=torch.int32), sum(new_tokens)
        )
        if max(new_tokens) > 1:
            self.prefill.plan(
                qo_indptr, indptr, indices, last, QO_HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE, causal=True, q_data_type=BF16
            )
            wrapper = self.prefill
        else:
            self.decode.plan(indptr, indices, last, QO_HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE, q_data_type=BF16)
            wrapper = self.decode
        hidden, residual = bf16((sum(new_tokens), 96), self.g), bf16((sum(new_tokens), 96), self.g)
        return hidden, residual, positions, batch_indices, positions, indices, indptr, last, wrapper


def test_llama_layer_compiles_without_graph_breaks_and_matches_eager(workspace):
    torch._dynamo.reset()
    layer = TinyLlamaLayer(seeded("layer"))
    sequences = Sequences(workspace, seeded("steps"))
    eager_cache = bf16((6, 2, PAGE_SIZE, KV_HEADS, HEAD_DIM), seeded("cache"))
    compiled_cache = eager_cache.clone()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter)

    def run_step(new_tokens, check_explain=False):
        hidden, residual, pos_ids, batch_indices, positions, *table, wrapper = sequences.step(new_tokens)
        eager_residual, compiled_residual = residual.clone(), residual.clone()
        inputs = (pos_ids, batch_indices, positions)
        with torch.no_grad():
            if check_explain:  # traced on copies: explain runs the function
                explained = torch._dynamo.explain(layer)(
                    hidden.clone(), residual.clone(), *inputs, eager_cache.clone(), *table, wrapper
                )
                assert explained.graph_break_count == 0, explained.break_reasons
                assert explained.graph_count == 1
                ops = {str(node.target) for graph in explained.graphs for node in graph.graph.nodes}
                assert {
                    "kernforge.fused_add_rmsnorm",
                    "kernforge.weight_packed_linear",
                    "kernforge.apply_llama31_rope_pos_ids_inplace",
                    "kernforge.append_paged_kv_cache",
                    "kernforge.attention_run",
                    "kernforge.silu_and_mul_out",
                    "kernforge.rmsnorm",
                } <= ops
            want, _ = layer(hidden.clone(), eager_residual, *inputs, eager_cache, *table, wrapper)
            got, _ = compiled(hidden.clone(), compiled_residual, *inputs, compiled_cache, *table, wrapper)
        assert torch.equal(got, want)
        assert torch.equal(compiled_residual, eager_residual)
        assert torch.equal(compiled_cache, eager_cache)

    run_step([17, 4], check_explain=True)  # prefill: 17 and 4 tokens, the first spans a page boundary
    assert counter.frame_count == 1
    run_step([1, 1], check_explain=True)  # decode
    assert counter.frame_count == 2
    run_step([1, 1])  # the next decode step: a new plan, the same graph
    run_step([1, 1])
    assert counter.frame_count == 2


def test_a_plan_with_another_output_dtype_recompiles(workspace):
    """Dynamo guards on the planned output dtype it passed to the op: a new one retraces, never mislabels."""
    torch._dynamo.reset()
    g = seeded("replan dtype")
    indptr, indices, last = _paged_batch(g, KV_LENS)
    wrapper = tl.BatchDecodeWithPagedKVCacheWrapper(workspace)
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    run = torch.compile(lambda q, cache: wrapper.run(q, cache), backend=counter, fullgraph=True)
    for dtype in (BF16, torch.float32, BF16):
        wrapper.plan(indptr, indices, last, QO_HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE, q_data_type=dtype)
        q, cache = bf16((2, QO_HEADS, HEAD_DIM), g).to(dtype), bf16((8, 2, PAGE_SIZE, KV_HEADS, HEAD_DIM), g).to(dtype)
        got = run(q, cache)
        assert got.dtype == dtype
        assert torch.equal(got, decode.BatchDecodeWithPagedKVCacheWrapper.run(wrapper, q, cache))
    assert counter.frame_count == 2


# --------------------------------------------------------------------------- schemas vs Python signatures

# Custom ops whose schema takes other arguments than the Python op (a schema holds no Python objects):
# declared so with the op (Traced.arguments, converted by its to_schema), or written in torch_library
# (the sampler's per-row tensors and Philox seed; attention_run over the wrappers' protocol).
ADAPTED = {
    name
    for op_name, op in kernforge.ops._registry.TRACED.items()
    if op.traced.arguments is not None
    for name in (op_name, f"{op_name}_out")
} | {"top_k_top_p_sampling_from_logits", "attention_run", "attention_run_return_lse"}


# torch's spelling of a schema argument's type, for a Python annotation
_TORCH_TYPES = {
    "torch.Tensor": "Tensor",
    "torch.Tensor | None": "Optional[Tensor]",
    "int": "int",
    "int | None": "Optional[int]",
    "float": "float",
    "float | None": "Optional[float]",
    "bool": "bool",
    "str": "str",
}


def _call_shape(fn) -> list:
    """What a caller sees of ``fn``'s own signature (not its wrapped op's): names, kinds, defaults."""
    import inspect

    return [(p.name, p.kind, p.default) for p in inspect.signature(fn, follow_wrapped=False).parameters.values()]


@pytest.mark.parametrize("name", sorted(tl.SCHEMAS))
def test_schema_matches_the_python_signature(name):
    """Every custom op takes its Python op's arguments, in order, with the same types and defaults
    (an out variant: plus a keyword-only out), or is listed in ADAPTED; every traceable facade has
    its Python op's signature."""
    import inspect

    base = name.removesuffix("_out")
    python_op = kernforge.ops.PUBLIC.get(base)
    facade = getattr(tl, base, None)
    if (
        facade is not None
        and python_op is not None
        and [k for _, k, _ in _call_shape(facade)] != [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]
    ):  # (*args, **kwargs) forwards as is
        assert _call_shape(facade) == _call_shape(python_op)
    if name in ADAPTED:
        return
    python = inspect.signature(python_op).parameters
    schema = custom_op(name).default._schema
    arguments = [a for a in schema.arguments if not (name.endswith("_out") and a.name == "out")]
    assert [a.name for a in arguments] == [p for p in python if p != "out"]
    assert name.endswith("_out") == (len(arguments) < len(schema.arguments))
    for argument in arguments:
        parameter = python[argument.name]
        assert str(argument.type) == _TORCH_TYPES[parameter.annotation], argument.name
        if parameter.default is inspect.Parameter.empty:
            assert not argument.has_default_value(), argument.name
        else:
            assert argument.has_default_value() and argument.default_value == parameter.default, argument.name
            if parameter.annotation in ("int", "int | None", "bool"):
                assert type(argument.default_value) is type(parameter.default), argument.name
