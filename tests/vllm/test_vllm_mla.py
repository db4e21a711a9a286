"""kernforge's vLLM MLA backends without an engine, on vLLM's own latent cache layout: the absorbed
decode (``forward_mqa``) against vLLM's CPU_MLA decode kernel and a float64 reference, on block
tables handed out shuffled; the prefill backend's new-token and context-chunk attention (with the
LSE vLLM merges by) against vLLM's CPU prefill backend."""

import math
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl
from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend

from kernforge.integrations.vllm.mla import KernforgeMLAImpl, KernforgeMLAPrefillBackend, MLADecodePlanner

LORA, ROPE, NOPE, V_HEAD = 512, 64, 128, 128
BLOCK = 16  # what vLLM's CPU platform sets for MLA models


def _impl(cls, heads, scale):
    return cls(
        heads, LORA + ROPE, scale, 1, None, None, "auto", None, "decoder", None,
        q_lora_rank=None, kv_lora_rank=LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
        qk_head_dim=NOPE + ROPE, v_head_dim=V_HEAD, kv_b_proj=None,
    )  # fmt: skip


def _decode_step(seq_lens, generator):
    """vLLM's decode metadata (block table wider than needed, blocks shuffled, -1 past the end)."""
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    blocks = (seq_lens + BLOCK - 1) // BLOCK
    free = torch.randperm(int(blocks.sum()) + 5, generator=generator).to(torch.int32)
    table = torch.full((len(seq_lens), int(blocks.max()) + 2), -1, dtype=torch.int32)
    taken = 0
    for row, count in enumerate(blocks.tolist()):
        table[row, :count] = free[taken : taken + count]
        taken += count
    return table, seq_lens, len(free)


@pytest.mark.parametrize("heads", [16, 4])
@pytest.mark.parametrize("seq_lens", [[1, 17, 300, 64, 1000], [33]], ids=["batch5", "batch1"])
def test_decode_matches_vllms_cpu_mla_and_a_reference(vllm_config, heads, seq_lens):
    generator = torch.Generator().manual_seed(heads + len(seq_lens))
    table, lens, blocks = _decode_step(seq_lens, generator)
    dtype = torch.bfloat16
    cache = torch.randn(blocks, BLOCK, LORA + ROPE, generator=generator).to(dtype)
    q_nope = torch.randn(len(seq_lens), heads, LORA, generator=generator).to(dtype)
    q_pe = torch.randn(len(seq_lens), heads, ROPE, generator=generator).to(dtype)
    scale = (NOPE + ROPE) ** -0.5
    planner = MLADecodePlanner(BLOCK)
    query_start_loc = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    decode = SimpleNamespace(
        block_table=table, seq_lens=lens, kernforge_step=planner.step(query_start_loc, lens, table)
    )
    metadata = SimpleNamespace(decode=decode)

    ours, lse = _impl(KernforgeMLAImpl, heads, scale).forward_mqa((q_nope, q_pe), cache, metadata, None)
    theirs, _ = _impl(CPUMLAImpl, heads, scale).forward_mqa((q_nope, q_pe), cache, metadata, None)

    assert lse is None and ours.shape == (len(seq_lens), heads, LORA) and ours.dtype == dtype
    for row, length in enumerate(seq_lens):
        pages = table[row, : (length + BLOCK - 1) // BLOCK].long()
        keys = cache[pages].reshape(-1, LORA + ROPE)[:length].double()
        q = torch.cat([q_nope[row], q_pe[row]], -1).double()
        expected = torch.softmax(q @ keys.T * scale, -1) @ keys[:, :LORA]
        torch.testing.assert_close(ours[row].double(), expected, atol=2e-2, rtol=2e-2, msg=f"request {row}")
        torch.testing.assert_close(ours[row].float(), theirs[row].float(), atol=2e-2, rtol=2e-2)
    assert not decode.kernforge_step.plans or len(decode.kernforge_step.plans) == 1  # one plan per step and kind


def _prefill_backends(heads, vllm_config):
    scale = (NOPE + ROPE) ** -0.5
    args = dict(
        num_heads=heads, scale=scale, kv_lora_rank=LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
        v_head_dim=V_HEAD, vllm_config=vllm_config,
    )  # fmt: skip
    return KernforgeMLAPrefillBackend(**args), CPUSDPAMLAPrefillBackend(**args)


def test_prefill_new_tokens_and_context_chunks_match_vllms(vllm_config):
    """A step of three prefills, the last two with earlier tokens in the cache (one context chunk):
    the new tokens' causal attention with and without LSE, and the chunk's attention and LSE."""
    heads, dtype = 4, torch.bfloat16
    generator = torch.Generator().manual_seed(7)
    q_lens, context_lens = [40, 17, 65], [0, 30, 100]
    query_start_loc = torch.tensor([0, 40, 57, 122], dtype=torch.int32)
    tokens = int(query_start_loc[-1])
    chunk = SimpleNamespace(
        index=0,
        query_start_loc=query_start_loc,
        cu_seq_lens=torch.tensor([0, 0, 30, 130], dtype=torch.int32),
        token_slice=slice(0, tokens),
    )
    metadata = SimpleNamespace(
        query_start_loc=query_start_loc,
        q_data_type=dtype,
        chunked_context=SimpleNamespace(chunks=[chunk]),
    )
    q = torch.randn(tokens, heads, NOPE + ROPE, generator=generator).to(dtype)
    k = torch.randn(tokens, heads, NOPE + ROPE, generator=generator).to(dtype)
    v = torch.randn(tokens, heads, 2 * V_HEAD, generator=generator).to(dtype)[..., :V_HEAD]  # strided, as vLLM's
    context = sum(context_lens)
    k_context = torch.randn(context, heads, NOPE + ROPE, generator=generator).to(dtype)
    v_context = torch.randn(context, heads, V_HEAD, generator=generator).to(dtype)
    ours, theirs = _prefill_backends(heads, vllm_config)
    for backend in (ours, theirs):
        backend.prepare_metadata(metadata)

    out = ours.run_prefill_new_tokens(q, k, v, return_softmax_lse=False)
    expected = theirs.run_prefill_new_tokens(q, k, v, return_softmax_lse=False)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    (out, lse), (expected, expected_lse) = (
        backend.run_prefill_new_tokens(q, k, v, return_softmax_lse=True) for backend in (ours, theirs)
    )
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, expected_lse.float(), atol=1e-3, rtol=1e-3)

    out, lse = ours.run_prefill_context_chunk(chunk, q, k_context, v_context)
    expected, expected_lse = theirs.run_prefill_context_chunk(chunk, q, k_context, v_context)
    assert lse.shape == (heads, tokens)
    rows = slice(q_lens[0], tokens)  # the first request has no context: vLLM's gives NaN there
    torch.testing.assert_close(out[rows].float(), expected[rows].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse[:, rows], expected_lse[:, rows].float(), atol=1e-3, rtol=1e-3)
    assert (lse[:, : q_lens[0]] == -math.inf).all() and (out[: q_lens[0]] == 0).all()
