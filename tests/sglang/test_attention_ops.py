"""SGLang's CPU attention ops as kernforge serves them (kernforge/integrations/sglang/attention.py), against a
float64 reference: SGLang's token-slot pool (one row per token, a request's slots in req_to_token), requests of
1, 77 and 260 tokens in shuffled slots, GQA, soft cap, sliding window, causal and not."""

import math

import pytest
import torch

from kernforge.integrations.sglang import attention

SLOTS, KV_HEADS, HEADS, HEAD_DIM = 600, 2, 6, 64
POOL_ROWS, CONTEXT = 5, 300
SM_SCALE = 0.125


def reference(q, k_buffer, v_buffer, req_to_token, pool_rows, seq_lens, q_lens, cap, window_left, causal):
    """Each request's q rows (its last q_lens[i] tokens) over its seq_lens[i] slots, in float64."""
    outputs, start = [], 0
    for row, length, count in zip(pool_rows.tolist(), seq_lens.tolist(), q_lens):
        slots = req_to_token[row, :length].long()
        group = HEADS // KV_HEADS
        k = k_buffer[slots].double().repeat_interleave(group, 1)
        v = v_buffer[slots].double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[start : start + count].double(), k) * SM_SCALE
        start += count
        if cap:
            scores = cap * torch.tanh(scores / cap)
        q_pos = torch.arange(length - count, length)[:, None]
        k_pos = torch.arange(length)[None, :]
        visible = torch.ones(count, length, dtype=torch.bool)
        if causal:
            visible &= k_pos <= q_pos
        if window_left >= 0:
            visible &= k_pos >= q_pos - window_left
        probs = torch.softmax(scores.masked_fill(~visible, -math.inf), -1).nan_to_num(0.0)
        outputs.append(torch.einsum("hqk,khd->qhd", probs, v))
    return torch.cat(outputs)


@pytest.fixture
def pool():
    g = torch.Generator().manual_seed(0)
    k_buffer = torch.randn(SLOTS, KV_HEADS, HEAD_DIM, generator=g).bfloat16()
    v_buffer = torch.randn(SLOTS, KV_HEADS, HEAD_DIM, generator=g).bfloat16()
    req_to_token = torch.randperm(SLOTS, generator=g).int().repeat(3)[: POOL_ROWS * CONTEXT].view(POOL_ROWS, CONTEXT)
    return k_buffer, v_buffer, req_to_token.contiguous(), torch.tensor([3, 0, 4]), torch.tensor([1, 77, 260]), g


# SGLang passes its layer's sliding_window_size + 1: 0 for none, else FlashInfer's window_left + 1
@pytest.mark.parametrize("cap, window", [(0.0, 0), (30.0, 0), (0.0, 18)])
def test_decode_stores_the_new_rows_then_attends(pool, cap, window):
    k_buffer, v_buffer, req_to_token, rows, seq_lens, g = pool
    q = torch.randn(3, HEADS, HEAD_DIM, generator=g).bfloat16()
    key, value = (torch.randn(3, KV_HEADS, HEAD_DIM, generator=g).bfloat16() for _ in range(2))
    loc = req_to_token[rows, seq_lens - 1].long()
    out = torch.empty_like(q)
    attention.decode_attention_cpu(
        q, k_buffer, v_buffer, 1.0, 1.0, out, key, value, loc, torch.empty(1), req_to_token, rows, seq_lens,
        SM_SCALE, cap, False, window, None, None,
    )  # fmt: skip
    assert torch.equal(k_buffer[loc], key) and torch.equal(v_buffer[loc], value)
    expected = reference(q, k_buffer, v_buffer, req_to_token, rows, seq_lens, [1, 1, 1], cap, window - 1, True)
    torch.testing.assert_close(out.double(), expected, atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cap, window", [(0.0, 0), (30.0, 0), (0.0, 18)])
def test_extend_attends_to_prefix_and_new_tokens(pool, cap, window, causal):
    k_buffer, v_buffer, req_to_token, rows, seq_lens, g = pool
    extend_lens, starts = torch.tensor([1, 30, 100]), torch.tensor([0, 1, 31])
    q = torch.randn(131, HEADS, HEAD_DIM, generator=g).bfloat16()
    out = torch.empty_like(q)
    attention.extend_attention_cpu(
        q, None, None, out, k_buffer, v_buffer, 1.0, 1.0, req_to_token, rows, seq_lens, extend_lens, starts, 100,
        SM_SCALE, cap, False, window, None, None, None, causal,
    )  # fmt: skip
    expected = reference(q, k_buffer, v_buffer, req_to_token, rows, seq_lens, [1, 30, 100], cap, window - 1, causal)
    torch.testing.assert_close(out.double(), expected, atol=1.6e-2, rtol=1.6e-2)


def test_a_new_batch_with_the_same_lengths_is_planned_again(pool):
    # A request that took over a pool row at the same length reads its own slots, not the old plan's.
    k_buffer, v_buffer, req_to_token, rows, seq_lens, g = pool
    q = torch.randn(3, HEADS, HEAD_DIM, generator=g).bfloat16()
    out = torch.empty_like(q)

    def decode():
        attention.decode_attention_cpu(
            q, k_buffer, v_buffer, 1.0, 1.0, out, None, None, torch.empty(0, dtype=torch.long), torch.empty(1),
            req_to_token, rows, seq_lens, SM_SCALE, 0.0, False, 0, None, None,
        )  # fmt: skip
        return reference(q, k_buffer, v_buffer, req_to_token, rows, seq_lens, [1, 1, 1], 0.0, -1, True)

    expected = decode()
    torch.testing.assert_close(out.double(), expected, atol=1.6e-2, rtol=1.6e-2)
    req_to_token[4] = req_to_token[4].flip(0)  # row 4 now holds another request's slots
    expected = decode()
    torch.testing.assert_close(out.double(), expected, atol=1.6e-2, rtol=1.6e-2)


def test_store_cache_writes_rows_into_their_slots(pool):
    k_buffer, v_buffer, *_, g = pool
    k, v = (torch.randn(4, KV_HEADS * HEAD_DIM, generator=g).bfloat16() for _ in range(2))
    slots = torch.tensor([5, 9, SLOTS - 1, 0])
    attention.store_cache_cpu(k, v, k_buffer, v_buffer, slots, KV_HEADS * HEAD_DIM)
    assert torch.equal(k_buffer[slots].view(4, -1), k) and torch.equal(v_buffer[slots].view(4, -1), v)


def test_bad_tables_are_refused_before_anything_is_written(pool):
    k_buffer, v_buffer, req_to_token, rows, seq_lens, g = pool
    before = k_buffer.clone()
    q = torch.randn(3, HEADS, HEAD_DIM, generator=g).bfloat16()
    key = torch.randn(3, KV_HEADS, HEAD_DIM, generator=g).bfloat16()
    args = {"loc": torch.tensor([1, 2, 3]), "seq_lens": seq_lens, "rows": rows}
    for name, change, match in [
        ("loc", {"loc": torch.tensor([1, 2, SLOTS])}, "kv_indices"),
        ("seq_lens", {"seq_lens": torch.tensor([1, 77, CONTEXT + 1])}, "seq_lens"),
        ("req_pool_indices", {"rows": torch.tensor([3, 0, POOL_ROWS])}, "req_pool_indices"),
    ]:
        call = {**args, **change}
        with pytest.raises(ValueError, match=match):
            attention.decode_attention_cpu(
                q, k_buffer, v_buffer, 1.0, 1.0, torch.empty_like(q), key, key, call["loc"], torch.empty(1),
                req_to_token, call["rows"], call["seq_lens"], SM_SCALE, 0.0, False, 0, None, None,
            )  # fmt: skip
        assert torch.equal(k_buffer, before), name


def test_what_is_not_served_says_so(pool):
    k_buffer, v_buffer, req_to_token, rows, seq_lens, g = pool
    q = torch.randn(3, HEADS, HEAD_DIM, generator=g).bfloat16()
    with pytest.raises(NotImplementedError, match="sinks"):
        attention.decode_attention_cpu(
            q, k_buffer, v_buffer, 1.0, 1.0, torch.empty_like(q), None, None, torch.empty(0, dtype=torch.long),
            torch.empty(1), req_to_token, rows, seq_lens, SM_SCALE, 0.0, False, 0, None, torch.zeros(HEADS),
        )  # fmt: skip
