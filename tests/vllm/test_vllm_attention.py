"""kernforge's vLLM attention backend on vLLM's own cache layout, without an engine: one scheduler
step (decodes and chunked-prefill pieces together, or decodes only) through the backend's
``forward`` against the float64 reference, the new K/V checked in the cache slots vLLM's block
table gives them. Block tables are shuffled, so a kernel that ignored them would fail."""

from types import SimpleNamespace

import pytest
import torch

from kernforge.integrations.vllm.attention import KernforgeAttentionImpl, KernforgeStep, StepPlanner, _in_huge_pages
from kernforge.memory import HUGE_PAGE

from op_helpers import THP_OFF, thp_eligible
from references import attention_reference

HEADS, KV_HEADS, HEAD = 8, 2, 64
# (query tokens, sequence length after the step) per request
MIXED = [(1, 300), (17, 17), (40, 200), (1, 1), (64, 130), (3, 33)]
DECODES = [(1, 300), (1, 1), (1, 97), (1, 1024), (1, 33)]


def _scheduler_step(requests, block_size, generator):
    """vLLM's metadata of a step (the fields the backend reads); blocks handed out shuffled."""
    q_lens = torch.tensor([q for q, _ in requests], dtype=torch.int32)
    seq_lens = torch.tensor([s for _, s in requests], dtype=torch.int32)
    blocks_per_request = (seq_lens + block_size - 1) // block_size
    width = int(blocks_per_request.max()) + 2  # vLLM's table is wider than any request needs
    free = torch.randperm(int(blocks_per_request.sum()) + 7, generator=generator).to(torch.int32)
    table = torch.full((len(requests), width), -1, dtype=torch.int32)  # unused entries: garbage
    taken = 0
    for row, count in enumerate(blocks_per_request.tolist()):
        table[row, :count] = free[taken : taken + count]
        taken += count
    query_start_loc = torch.zeros(len(requests) + 1, dtype=torch.int32)
    torch.cumsum(q_lens, 0, out=query_start_loc[1:])
    return SimpleNamespace(
        num_reqs=len(requests),
        num_actual_tokens=int(query_start_loc[-1]),
        max_query_len=int(q_lens.max()),
        query_start_loc=query_start_loc,
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens=seq_lens,
        block_table_tensor=table,
        causal=True,
    ), len(free)


def _token_rows(cache_half, table_row, length, block_size):
    """[length, kv_heads, head] of one request's tokens from one half of the cache."""
    blocks = table_row[: (length + block_size - 1) // block_size].long()
    rows = cache_half[blocks].permute(0, 2, 1, 3).reshape(-1, KV_HEADS, HEAD)
    return rows[:length]


@pytest.mark.parametrize(
    "requests, block_size, window, soft_cap, cache",
    [
        (MIXED, 32, None, None, "auto"),
        (MIXED, 128, 50, 30.0, "auto"),
        (DECODES, 32, None, None, "auto"),
        (DECODES, 128, 64, None, "fp8"),
        (MIXED, 64, None, None, "fp8"),
    ],
    ids=["mixed", "mixed-window-softcap-block128", "decodes", "decodes-fp8-window", "mixed-fp8"],
)
def test_step_matches_reference_and_writes_vllms_slots(vllm_config, requests, block_size, window, soft_cap, cache):
    generator = torch.Generator().manual_seed(len(requests) * block_size)
    metadata, blocks = _scheduler_step(requests, block_size, generator)
    dtype = torch.bfloat16
    fp8 = cache == "fp8"
    kv_cache = torch.randn(blocks, KV_HEADS, block_size, 2 * HEAD, generator=generator).to(dtype)
    if fp8:
        kv_cache = kv_cache.to(torch.float8_e4m3fn).view(torch.uint8)  # vLLM's fp8 cache: uint8 storage
    tokens = metadata.num_actual_tokens
    query = torch.randn(tokens, HEADS, HEAD, generator=generator).to(dtype)
    key = torch.randn(tokens, KV_HEADS, HEAD, generator=generator).to(dtype)
    value = torch.randn(tokens, KV_HEADS, HEAD, generator=generator).to(dtype)
    output = torch.full((tokens + 3, HEADS, HEAD), float("nan"), dtype=dtype)  # rows past the step: untouched
    scale = HEAD**-0.5
    impl = KernforgeAttentionImpl(HEADS, HEAD, scale, KV_HEADS, None, window, cache, soft_cap)
    k_scale, v_scale = (0.5, 2.0) if fp8 else (1.0, 1.0)
    layer = SimpleNamespace(_k_scale_float=k_scale, _v_scale_float=v_scale)
    step = StepPlanner(block_size, dtype).step(metadata)
    assert isinstance(step, KernforgeStep) and step.decode_only == all(q == 1 for q, _ in requests)

    impl.forward(layer, query, key, value, kv_cache, step, output[:tokens])

    halves = kv_cache.view(torch.float8_e4m3fn if fp8 else dtype).view(blocks, KV_HEADS, 2 * block_size, HEAD)
    k_cache, v_cache = halves.chunk(2, dim=2)
    start = 0
    for row, (q_len, seq_len) in enumerate(requests):
        new = slice(start, start + q_len)
        k_all = _token_rows(k_cache, metadata.block_table_tensor[row], seq_len, block_size)
        v_all = _token_rows(v_cache, metadata.block_table_tensor[row], seq_len, block_size)
        stored_k, stored_v = key[new] / k_scale, value[new] / v_scale
        if fp8:
            stored_k, stored_v = stored_k.to(torch.float8_e4m3fn), stored_v.to(torch.float8_e4m3fn)
        assert torch.equal(k_all[seq_len - q_len :].float(), stored_k.float()), f"request {row}: K not in its slots"
        assert torch.equal(v_all[seq_len - q_len :].float(), stored_v.float()), f"request {row}: V not in its slots"
        expected, _ = attention_reference(
            query[new],
            k_all,
            v_all,
            sm_scale=scale,
            causal=True,
            window_left=window - 1 if window else -1,
            soft_cap=soft_cap or 0.0,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        torch.testing.assert_close(output[new].double(), expected, atol=2e-2, rtol=2e-2, msg=f"request {row}")
        start += q_len
    assert output[tokens:].isnan().all()


def test_one_plan_per_step_and_layer_kind(vllm_config):
    """Every layer of a step with the same head shape, scale, window and soft cap runs one plan;
    another kind plans its own; the next step plans again."""
    generator = torch.Generator().manual_seed(3)
    planner = StepPlanner(32, torch.bfloat16)
    metadata, _ = _scheduler_step(MIXED, 32, generator)
    step = planner.step(metadata)
    plain = KernforgeAttentionImpl(HEADS, HEAD, HEAD**-0.5, KV_HEADS, None, None, "auto", None)
    twin = KernforgeAttentionImpl(HEADS, HEAD, HEAD**-0.5, KV_HEADS, None, None, "auto", None)
    windowed = KernforgeAttentionImpl(HEADS, HEAD, HEAD**-0.5, KV_HEADS, None, 16, "auto", None)
    first = step.wrapper(plain, torch.bfloat16)
    assert step.wrapper(twin, torch.bfloat16) is first and len(step.plans) == 1
    assert step.wrapper(windowed, torch.bfloat16) is not first and len(step.plans) == 2
    assert not planner.step(metadata).plans  # a new step starts unplanned


@pytest.mark.skipif(THP_OFF, reason="transparent huge pages are disabled or not Linux's here")
def test_kv_cache_allocation_starts_in_huge_pages():
    """vLLM allocates one buffer of zeros and views it per layer; the wrapped allocation returns the
    same views, still all zeros, over memory advised into huge pages."""
    buffer = torch.zeros(12 << 20, dtype=torch.int8)

    def allocate_kv_cache(kv_cache_config, device, layout, kernel_block_sizes=None):
        return {f"layer.{i}": buffer[i << 20 : (i + 4) << 20].view(torch.bfloat16) for i in range(3)}

    caches = _in_huge_pages(allocate_kv_cache)("config", "cpu", "layout", [32])
    assert [c.data_ptr() for c in caches.values()] == [buffer.data_ptr() + (i << 20) for i in range(3)]
    assert not buffer.any()
    assert thp_eligible(-(-buffer.data_ptr() // HUGE_PAGE) * HUGE_PAGE)
