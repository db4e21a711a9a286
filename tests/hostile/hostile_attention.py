"""The table's cases for the attention family: the cascade merges, the paged cache's append and index
helpers, single decode / prefill, and the three wrappers' plan() and run()."""

from __future__ import annotations

import torch
from hostile_checks import all_finite, arg, nan_rows, result
from hostile_harness import (
    CaseList,
    Refuses,
    Runs,
    SameAsPlain,
    Setup,
    guarded,
    i32,
    i64,
    on_meta,
    overlapping,
    randn,
    with_value,
)

import kernforge
from kernforge.ops.attention._wrapper import PlanStateError

BF16, F32 = torch.bfloat16, torch.float32
NAN, INF = float("nan"), float("inf")

# One paged batch for decode, prefill and append: 2 requests over 5 pages of 4 slots, NHD; request 0
# holds pages 3, 0 (7 tokens: 3 in its last page), request 1 page 4, the cache's last (2 tokens).
# Pages 1 and 2 are unused; slots past each request's length are never read.
PAGES, PAGE_SIZE, KV_HEADS, QO_HEADS, HEAD_DIM = 5, 4, 2, 4, 64


def page_table(**changes):
    table = {"indptr": i32(0, 2, 3), "indices": i32(3, 0, 4), "last_page_len": i32(3, 2)}
    table.update(changes)
    return table


def paged_cache(dtype=BF16):
    return randn(PAGES, 2, PAGE_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype, seed=5)


def workspace():
    return torch.empty(8 << 20, dtype=torch.uint8)


# cache slots nothing may read: unused pages 1 and 2, slot 3 of page 0 (request 0 has 3 of 4), slots 2-3 of page 4
UNREAD_SLOTS = ((1, slice(None)), (2, slice(None)), (0, slice(3, None)), (4, slice(2, None)))


def poisoned(cache, value=NAN):
    """The cache with NaN (or ``value``) in every K and V slot no request holds."""
    cache = cache.clone()
    for page, slots in UNREAD_SLOTS:
        cache[page, :, slots] = value
    return cache


# --------------------------------------------------------------------------- cascade

T, H, D = 3, 2, 40


def _state(seed):
    return randn(T, H, D, dtype=BF16, seed=seed), randn(T, H, seed=seed + 1)


def merge_state_cases() -> CaseList:
    def setup():
        (v_a, s_a), (v_b, s_b) = _state(0), _state(2)
        return Setup(kernforge.merge_state, v_a=v_a, s_a=s_a, v_b=v_b, s_b=s_b)

    c = CaseList("merge_state", setup)
    c.dtype("v_a", torch.int32).dtype("v_b", F32).dtype("s_a", torch.int64)
    c.meta("v_a").meta("s_b")
    c.refuse("shape", "v_a 2-D", lambda a: {"v_a": a["v_a"].flatten(1)}, "v_a")
    c.refuse("shape", "v_b head_dim 41", lambda a: {"v_b": randn(T, H, D + 1, dtype=BF16)}, "v_b")
    c.refuse("shape", "s_a [3, 3]", lambda a: {"s_a": randn(T, H + 1), "s_b": randn(T, H + 1)}, "s_a")
    c.add(
        "nan",
        "NaN in s_a token 1",
        lambda a: {"s_a": with_value(a["s_a"], (1, 0), NAN)},
        nan_rows(result(0), [1], "token 1 NaN (FlashInfer), others unchanged"),
    )
    c.add(
        "nan",
        "s_a = -inf (empty state)",
        lambda a: {"s_a": torch.full((T, H), -INF), "v_a": torch.full((T, H, D), NAN, dtype=BF16)},
        Runs(_empty_state_is_b, "its v unread: the result is (v_b, s_b)"),
    )
    c.guard("v_a", "s_a", "v_b", "s_b")
    return c


def _empty_state_is_b(res, args, plain):
    v, s = res
    torch.testing.assert_close(v.float(), args["v_b"].float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(s, args["s_b"])


def merge_state_in_place_cases() -> CaseList:
    def setup():
        (v, s), (v_other, s_other) = _state(0), _state(2)
        return Setup(kernforge.merge_state_in_place, v=v, s=s, v_other=v_other, s_other=s_other)

    c = CaseList("merge_state_in_place", setup)
    c.dtype("v", torch.float64).dtype("s", torch.float16).dtype("v_other", F32)
    c.refuse("dtype", "mask int32", lambda a: {"mask": torch.ones(T, dtype=torch.int32)}, "mask", TypeError)
    c.meta("v").meta("s").meta("s_other")
    c.refuse("device", "mask on meta", lambda a: {"mask": torch.ones(T, dtype=torch.bool, device="meta")}, "mask")
    c.refuse("shape", "v_other 2 tokens", lambda a: {"v_other": a["v_other"][:2]}, "v_other")
    c.refuse("shape", "mask 4 entries", lambda a: {"mask": torch.ones(T + 1, dtype=torch.bool)}, "mask")
    c.refuse("shape", "v rows expanded (overlap)", lambda a: {"v": randn(1, 1, D, dtype=BF16).expand(T, H, D)}, "v")
    c.refuse(
        "alias", "v_other overlaps v, a token later", lambda a: overlapping(a, "v", "v_other", (T, H, D), H * D), "v"
    )
    c.refuse("alias", "s_other overlaps s", lambda a: overlapping(a, "s", "s_other", (T, H), 1), "s")
    c.add(
        "nan",
        "NaN in s_other token 2",
        lambda a: {"s_other": with_value(a["s_other"], (2, 1), NAN)},
        nan_rows(arg("v"), [2], "token 2 NaN, others unchanged"),
    )
    c.guard("v", "s", "v_other", "s_other")
    return c


def merge_states_cases() -> CaseList:
    def setup():
        return Setup(kernforge.merge_states, v=randn(T, 3, H, D, dtype=BF16), s=randn(T, 3, H, seed=1))

    c = CaseList("merge_states", setup)
    c.dtype("v", torch.int8).dtype("s", torch.int32)
    c.meta("v").meta("s")
    c.refuse("shape", "v 3-D", lambda a: {"v": a["v"][:, 0]}, "v")
    c.refuse("shape", "s [3, 2, 2]", lambda a: {"s": a["s"][:, :2]}, "s")
    c.add(
        "nan",
        "NaN in s token 0",
        lambda a: {"s": with_value(a["s"], (0, 1, 0), NAN)},
        nan_rows(result(0), [0], "token 0 NaN, others unchanged"),
    )
    c.guard("v", "s")
    return c


# --------------------------------------------------------------------------- the paged cache


def append_cases() -> CaseList:
    def setup():
        t = page_table()
        return Setup(
            kernforge.append_paged_kv_cache,
            append_key=randn(3, KV_HEADS, HEAD_DIM, dtype=BF16, seed=7),
            append_value=randn(3, KV_HEADS, HEAD_DIM, dtype=BF16, seed=8),
            batch_indices=i32(0, 0, 1),
            positions=i32(4, 6, 3),  # request 0's page 1 (page 0 of the cache), request 1's last slot
            paged_kv_cache=paged_cache(),
            kv_indices=t["indices"],
            kv_indptr=t["indptr"],
            kv_last_page_len=t["last_page_len"],
        )

    c = CaseList("append_paged_kv_cache", setup)
    c.dtype("append_key", F32).dtype("batch_indices", F32).dtype("positions", torch.float64).dtype(
        "kv_indices", torch.bool
    )
    c.dtype("paged_kv_cache", torch.int16)
    c.meta("append_value").meta("positions").meta("kv_indptr").meta("paged_kv_cache")
    c.refuse("shape", "append_key 3 heads", lambda a: {"append_key": randn(3, 3, HEAD_DIM, dtype=BF16)}, "append_key")
    c.refuse("shape", "append_value 2 tokens", lambda a: {"append_value": a["append_value"][:2]}, "append_value")
    c.refuse("shape", "positions 2 entries", lambda a: {"positions": i32(4, 6)}, "positions")
    c.refuse("shape", "kv_indptr 2 entries (batch 2)", lambda a: {"kv_indptr": i32(0, 3)}, "kv_indptr")
    c.refuse(
        "shape", "kv_last_page_len 2-D", lambda a: {"kv_last_page_len": a["kv_last_page_len"][None]}, "kv_last_page_len"
    )
    c.refuse(
        "shape",
        "paged_kv_cache 4 planes",
        lambda a: {"paged_kv_cache": randn(PAGES, 4, PAGE_SIZE, KV_HEADS, HEAD_DIM, dtype=BF16)},
        "paged_kv_cache",
    )
    c.refuse("index", "batch_indices -1", lambda a: {"batch_indices": i32(0, -1, 1)}, "batch_indices")
    c.refuse("index", "batch_indices = batch", lambda a: {"batch_indices": i32(0, 2, 1)}, "batch_indices")
    c.refuse("index", "positions -1", lambda a: {"positions": i32(4, -1, 3)}, "positions")
    c.refuse("index", "positions past the request's pages", lambda a: {"positions": i32(4, 8, 3)}, "positions")
    c.refuse("index", "positions int64 beyond int32", lambda a: {"positions": i64(4, 2**32 + 6, 3)}, "positions")
    c.refuse("index", "kv_indices -1 (used)", lambda a: {"kv_indices": i32(3, -1, 4)}, "kv_indices")
    c.refuse("index", "kv_indices = num_pages (used)", lambda a: {"kv_indices": i32(3, 0, 5)}, "kv_indices")
    c.refuse("indptr", "kv_indptr decreasing", lambda a: {"kv_indptr": i32(0, 2, 1)}, "kv_indptr")
    c.refuse("indptr", "kv_indptr past kv_indices", lambda a: {"kv_indptr": i32(0, 2, 4)}, "kv_indptr")
    c.refuse("indptr", "kv_indptr negative", lambda a: {"kv_indptr": i32(-1, 2, 3)}, "kv_indptr")
    c.add(
        "nan",
        "NaN in append_key, copied as is",
        lambda a: {"append_key": with_value(a["append_key"], (1, 0, 0), NAN)},
        Runs(_nan_copied, "stored as is"),
    )
    c.guard("append_key", "append_value", "paged_kv_cache")
    return c


def _nan_copied(res, args, plain):
    # token 1 of request 0 (position 6): page 0, slot 2
    assert torch.isnan(args["paged_kv_cache"][0, 0, 2, 0, 0])


def get_seq_lens_cases() -> CaseList:
    def setup():
        return Setup(kernforge.get_seq_lens, kv_indptr=i32(0, 2, 3), kv_last_page_len=i32(3, 2), page_size=4)

    c = CaseList("get_seq_lens", setup)
    c.dtype("kv_indptr", F32).dtype("kv_last_page_len", F32)
    c.meta("kv_indptr").meta("kv_last_page_len")
    c.refuse("shape", "kv_last_page_len 3 entries", lambda a: {"kv_last_page_len": i32(3, 2, 1)}, "kv_last_page_len")
    c.refuse("shape", "kv_indptr 2-D", lambda a: {"kv_indptr": a["kv_indptr"][None]}, "kv_indptr")
    c.refuse("shape", "page_size 0", lambda a: {"page_size": 0}, "page_size")
    c.refuse("indptr", "kv_indptr decreasing", lambda a: {"kv_indptr": i32(0, 2, 1)}, "kv_indptr")
    c.refuse("length", "kv_last_page_len 5 > page_size", lambda a: {"kv_last_page_len": i32(5, 2)}, "kv_last_page_len")
    c.refuse("length", "kv_last_page_len -1", lambda a: {"kv_last_page_len": i32(3, -1)}, "kv_last_page_len")
    c.guard("kv_indptr", "kv_last_page_len")
    return c


def batch_indices_positions_cases() -> CaseList:
    def setup():
        return Setup(kernforge.get_batch_indices_positions, append_indptr=i32(0, 2, 3), seq_lens=i32(7, 2), nnz=3)

    c = CaseList("get_batch_indices_positions", setup)
    c.dtype("append_indptr", F32).dtype("seq_lens", torch.float64)
    c.meta("append_indptr").meta("seq_lens")
    c.refuse("shape", "seq_lens 3 entries", lambda a: {"seq_lens": i32(7, 2, 1)}, "seq_lens")
    c.refuse("shape", "append_indptr 2-D", lambda a: {"append_indptr": a["append_indptr"][None]}, "append_indptr")
    c.refuse("indptr", "append_indptr decreasing", lambda a: {"append_indptr": i32(0, 3, 2), "nnz": 2}, "append_indptr")
    c.refuse(
        "indptr",
        "append_indptr not starting at 0",
        lambda a: {"append_indptr": i32(1, 2, 3), "nnz": 2},
        "append_indptr",
    )
    c.refuse("length", "nnz past append_indptr[-1]", lambda a: {"nnz": 4}, "nnz")
    c.refuse("length", "seq_lens shorter than the appended tokens", lambda a: {"seq_lens": i32(1, 2)}, "seq_lens")
    c.guard("append_indptr", "seq_lens")
    return c


# --------------------------------------------------------------------------- single requests


def single_decode_cases() -> CaseList:
    def setup():
        return Setup(
            kernforge.single_decode_with_kv_cache,
            q=randn(QO_HEADS, HEAD_DIM, dtype=BF16),
            k=randn(7, KV_HEADS, HEAD_DIM, dtype=BF16, seed=1),
            v=randn(7, KV_HEADS, HEAD_DIM, dtype=BF16, seed=2),
        )

    c = CaseList("single_decode_with_kv_cache", setup)
    c.dtype("q", torch.int32).dtype("k", torch.int32).dtype("v", F32)
    c.meta("q").meta("k").meta("v")
    c.refuse("shape", "q 3-D", lambda a: {"q": a["q"][None]}, "q")
    c.refuse("shape", "v 6 tokens", lambda a: {"v": a["v"][:6]}, "v")
    c.refuse("shape", "q head_dim 32", lambda a: {"q": a["q"][:, :32]}, "head_dim")
    c.refuse("shape", "q heads not a multiple of k's", lambda a: {"q": a["q"][:3]}, "num_qo_heads")
    c.add(
        "nan",
        "NaN in k token 5",
        lambda a: {"k": with_value(a["k"], (5, 0, 0), NAN)},
        nan_rows(result(), [0, 1], "heads of kv head 0 NaN, others unchanged"),
    )
    c.guard("q", "k", "v")
    return c


def single_prefill_cases(name: str) -> CaseList:
    op = getattr(kernforge, name)
    lse = name.endswith("return_lse")

    def setup():
        return Setup(
            op,
            q=randn(5, QO_HEADS, HEAD_DIM, dtype=BF16),
            k=randn(7, KV_HEADS, HEAD_DIM, dtype=BF16, seed=1),
            v=randn(7, KV_HEADS, HEAD_DIM, dtype=BF16, seed=2),
            causal=True,
        )

    c = CaseList(name, setup)
    c.dtype("q", torch.int32).dtype("k", torch.float16).dtype("v", F32)
    c.meta("q").meta("k").meta("v")
    c.refuse("shape", "q 2-D", lambda a: {"q": a["q"][0]}, "q")
    c.refuse("shape", "v 6 tokens", lambda a: {"v": a["v"][:6]}, "v")
    c.refuse("shape", "k head_dim 32", lambda a: {"k": a["k"][..., :32]}, "k")
    c.refuse(
        "shape",
        "custom_mask [5, 6]",
        lambda a: {"causal": False, "custom_mask": torch.ones(5, 6, dtype=torch.bool)},
        "custom_mask",
    )
    c.refuse(
        "device",
        "custom_mask on meta",
        lambda a: {"causal": False, "custom_mask": torch.ones(5, 7, dtype=torch.bool, device="meta")},
        "custom_mask",
    )
    c.refuse(
        "length",
        "packed_custom_mask short",
        lambda a: {"causal": False, "packed_custom_mask": torch.ones(4, dtype=torch.uint8)},
        "packed_custom_mask",
    )
    c.refuse(
        "device",
        "packed_custom_mask on meta",
        lambda a: {"causal": False, "packed_custom_mask": torch.ones(5, dtype=torch.uint8, device="meta")},
        "packed_custom_mask",
    )
    out = result(0) if lse else result()
    c.add(
        "nan",
        "NaN in q token 3",
        lambda a: {"q": with_value(a["q"], (3, 1, 2), NAN)},
        nan_rows(out, [3], "token 3 NaN, others unchanged"),
    )
    c.add(
        "nan",
        "NaN in a key masked out (causal)",
        lambda a: {"k": with_value(a["k"], (6, 0, 0), NAN)},
        nan_rows(out, [4], "only the last query sees it"),
    )
    c.guard("q", "k", "v")
    return c


# --------------------------------------------------------------------------- wrappers


def _decode_wrapper(**table_changes):
    wrapper = kernforge.BatchDecodeWithPagedKVCacheWrapper(workspace())
    wrapper.plan(**_decode_plan_args(**table_changes))
    return wrapper


def _decode_plan_args(**changes):
    args = page_table()
    args.update(num_qo_heads=QO_HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, page_size=PAGE_SIZE, q_data_type=BF16)
    args.update(changes)
    return args


def _paged_run_cases(c: CaseList, run) -> None:
    """The run() cases the decode and paged-prefill wrappers share: both take q, paged_kv_cache and out
    over the one page table. Added before an op's own run() cases, so they lead their cells of
    docs/safety.md."""
    c.add("dtype", "run: out float32", lambda a: {"out": a["out"].float()}, Refuses(ValueError, "out"), setup=run)
    c.add("device", "run: q on meta", lambda a: {"q": on_meta(a["q"])}, Refuses(ValueError, "q"), setup=run)
    c.add("alias", "run: out is q", lambda a: {"out": a["q"]}, Refuses(ValueError, "out"), setup=run)
    c.add(
        "nan",
        "run: NaN in every unread cache slot",
        lambda a: {"paged_kv_cache": poisoned(a["paged_kv_cache"])},
        all_finite(arg("out"), "not read: output unchanged"),
        setup=run,
    )
    c.add(
        "guard",
        "run: q, paged_kv_cache, out end at a PROT_NONE page",
        lambda a: {n: guarded(a[n]) for n in ("q", "paged_kv_cache", "out")},
        SameAsPlain(),
        setup=run,
    )


def decode_cases() -> CaseList:
    name = "BatchDecodeWithPagedKVCacheWrapper"

    def plan_setup():
        wrapper = kernforge.BatchDecodeWithPagedKVCacheWrapper(workspace())
        return Setup(wrapper.plan, **_decode_plan_args())

    def run_setup(**table_changes):
        def setup():
            wrapper = _decode_wrapper(**table_changes)
            return Setup(
                wrapper.run,
                watch={"plan": wrapper._plan.keep[1:4]},
                q=randn(2, QO_HEADS, HEAD_DIM, dtype=BF16, seed=9),
                paged_kv_cache=paged_cache(),
                out=torch.empty(2, QO_HEADS, HEAD_DIM, dtype=BF16),
            )

        return setup

    c = CaseList(name, plan_setup)
    # plan()
    c.add("dtype", "plan: indptr float", lambda a: {"indptr": a["indptr"].float()}, Refuses(TypeError, "indptr"))
    c.add("dtype", "plan: q_data_type int32", lambda a: {"q_data_type": torch.int32}, Refuses(TypeError, "q_data_type"))
    c.add(
        "device", "plan: indices on meta", lambda a: {"indices": on_meta(a["indices"])}, Refuses(ValueError, "indices")
    )
    c.add("shape", "plan: indptr one short", lambda a: {"indptr": i32(0, 2)}, Refuses(ValueError, "indptr"))
    c.add("shape", "plan: head_dim 0", lambda a: {"head_dim": 0}, Refuses(ValueError, "head_dim"))
    c.add("index", "plan: indices -1", lambda a: {"indices": i32(3, -1, 4)}, Refuses(ValueError, "indices"))
    c.add("indptr", "plan: indptr not starting at 0", lambda a: {"indptr": i32(1, 2, 3)}, Refuses(ValueError, "indptr"))
    c.add("indptr", "plan: indptr decreasing", lambda a: {"indptr": i32(0, 2, 1)}, Refuses(ValueError, "indptr"))
    c.add("indptr", "plan: indptr past indices", lambda a: {"indptr": i32(0, 2, 4)}, Refuses(ValueError, "indptr"))
    c.add(
        "length",
        "plan: last_page_len 5 > page_size",
        lambda a: {"last_page_len": i32(5, 2)},
        Refuses(ValueError, "last_page_len"),
    )
    c.add(
        "length", "plan: last_page_len 0", lambda a: {"last_page_len": i32(3, 0)}, Refuses(ValueError, "last_page_len")
    )
    # run()
    run = run_setup()
    _paged_run_cases(c, run)
    c.add("misuse", "run before plan", None, Refuses(PlanStateError, "plan"), setup=_unplanned_decode_run)
    c.add("misuse", "run after a failed plan", None, Refuses(PlanStateError, "plan"), setup=_run_after_failed_plan)
    c.add(
        "misuse",
        "run: q batch 3, planned 2",
        lambda a: {"q": randn(3, QO_HEADS, HEAD_DIM, dtype=BF16)},
        Refuses(ValueError, "q"),
        setup=run,
    )
    c.add(
        "misuse", "run: q float32, planned bf16", lambda a: {"q": a["q"].float()}, Refuses(ValueError, "q"), setup=run
    )
    c.add(
        "misuse",
        "run: cache page_size 8, planned 4",
        lambda a: {"paged_kv_cache": randn(PAGES, 2, 8, KV_HEADS, HEAD_DIM, dtype=BF16)},
        Refuses(ValueError, "page_size"),
        setup=run,
    )
    c.add(
        "misuse",
        "run: cache 3 kv heads, planned 2",
        lambda a: {"paged_kv_cache": randn(PAGES, 2, PAGE_SIZE, 3, HEAD_DIM, dtype=BF16)},
        Refuses(ValueError, "num_kv_heads"),
        setup=run,
    )
    c.add(
        "misuse",
        "run: window_left differs from plan",
        lambda a: {"window_left": 3},
        Refuses(ValueError, "window_left"),
        setup=run,
    )
    c.add(
        "dtype",
        "run: paged_kv_cache int16",
        lambda a: {"paged_kv_cache": a["paged_kv_cache"].to(torch.int16)},
        Refuses(TypeError, "paged_kv_cache"),
        setup=run,
    )
    c.add(
        "device",
        "run: paged_kv_cache on meta",
        lambda a: {"paged_kv_cache": on_meta(a["paged_kv_cache"])},
        Refuses(ValueError, "paged_kv_cache"),
        setup=run,
    )
    c.add("device", "run: out on meta", lambda a: {"out": on_meta(a["out"])}, Refuses(ValueError, "out"), setup=run)
    c.add("shape", "run: out head_dim 32", lambda a: {"out": a["out"][..., :32]}, Refuses(ValueError, "out"), setup=run)
    c.add("shape", "run: lse [2, 3]", lambda a: {"lse": torch.empty(2, 3)}, Refuses(ValueError, "lse"), setup=run)
    c.add(
        "index",
        "run: indices hold page 5 of a 5-page cache",
        None,
        Refuses(ValueError, "indices"),
        setup=run_setup(indices=i32(3, 0, 5)),
    )
    c.add(
        "alias",
        "run: out is in the cache",
        lambda a: {"out": a["paged_kv_cache"][0, 0].reshape(2, QO_HEADS, HEAD_DIM)},
        Refuses(ValueError, "out"),
        setup=run,
    )
    c.add(
        "alias",
        "run: lse overlaps out",
        lambda a: {"lse": a["out"].view(-1)[:16].view(F32).view(2, 4)},
        Refuses(ValueError, "lse"),
        setup=run,
    )
    c.add(
        "nan",
        "run: Inf in every unread cache slot",
        lambda a: {"paged_kv_cache": poisoned(a["paged_kv_cache"], INF)},
        all_finite(arg("out"), "not read: output unchanged"),
        setup=run,
    )
    c.add(
        "nan",
        "run: NaN in a K slot request 1 reads",
        lambda a: {"paged_kv_cache": with_value(a["paged_kv_cache"], (4, 0, 1, 1, 0), NAN)},
        nan_rows(arg("out"), [1], "request 1 NaN, request 0 unchanged"),
        setup=run,
    )
    c.add(
        "nan",
        "run: NaN in q request 1",
        lambda a: {"q": with_value(a["q"], (1, 0, 0), NAN)},
        nan_rows(arg("out"), [1], "request 1 NaN, request 0 unchanged"),
        setup=run,
    )
    return c


def _decode_run_call(wrapper):
    """run() of a decode wrapper without a usable plan, on arguments that fit a plan of page_table()."""
    return Setup(
        wrapper.run,
        q=randn(2, QO_HEADS, HEAD_DIM, dtype=BF16),
        paged_kv_cache=paged_cache(),
        out=torch.zeros(2, QO_HEADS, HEAD_DIM, dtype=BF16),
    )


def _unplanned_decode_run():
    return _decode_run_call(kernforge.BatchDecodeWithPagedKVCacheWrapper(workspace()))


def _run_after_failed_plan():
    wrapper = _decode_wrapper()
    try:
        wrapper.plan(**_decode_plan_args(indptr=i32(0, 3, 2)))
    except ValueError:
        pass
    return _decode_run_call(wrapper)


def _prefill_plan_args(**changes):
    t = page_table()
    args = {
        "qo_indptr": i32(0, 3, 5),
        "paged_kv_indptr": t["indptr"],
        "paged_kv_indices": t["indices"],
        "paged_kv_last_page_len": t["last_page_len"],
        "num_qo_heads": QO_HEADS,
        "num_kv_heads": KV_HEADS,
        "head_dim_qk": HEAD_DIM,
        "page_size": PAGE_SIZE,
        "causal": True,
        "q_data_type": BF16,
    }
    args.update(changes)
    return args


def prefill_paged_cases() -> CaseList:
    name = "BatchPrefillWithPagedKVCacheWrapper"

    def plan_setup():
        wrapper = kernforge.BatchPrefillWithPagedKVCacheWrapper(workspace())
        return Setup(wrapper.plan, **_prefill_plan_args())

    def run_setup(**changes):
        def setup():
            wrapper = kernforge.BatchPrefillWithPagedKVCacheWrapper(workspace())
            wrapper.plan(**_prefill_plan_args(**changes))
            return Setup(
                wrapper.run,
                q=randn(5, QO_HEADS, HEAD_DIM, dtype=BF16, seed=9),
                paged_kv_cache=paged_cache(),
                out=torch.empty(5, QO_HEADS, HEAD_DIM, dtype=BF16),
            )

        return setup

    c = CaseList(name, plan_setup)
    c.add(
        "dtype",
        "plan: qo_indptr float",
        lambda a: {"qo_indptr": a["qo_indptr"].float()},
        Refuses(TypeError, "qo_indptr"),
    )
    c.add(
        "dtype", "plan: kv_data_type int8", lambda a: {"kv_data_type": torch.int8}, Refuses(TypeError, "kv_data_type")
    )
    c.add(
        "device",
        "plan: paged_kv_indices on meta",
        lambda a: {"paged_kv_indices": on_meta(a["paged_kv_indices"])},
        Refuses(ValueError, "paged_kv_indices"),
    )
    c.add(
        "device",
        "plan: custom_mask on meta",
        lambda a: {"causal": False, "custom_mask": torch.ones(3 * 7 + 2 * 2, dtype=torch.bool, device="meta")},
        Refuses(ValueError, "custom_mask"),
    )
    c.add(
        "shape",
        "plan: paged_kv_last_page_len one short",
        lambda a: {"paged_kv_last_page_len": i32(3)},
        Refuses(ValueError, "paged_kv_last_page_len"),
    )
    c.add(
        "shape",
        "plan: custom_mask 3 entries short",
        lambda a: {"causal": False, "custom_mask": torch.ones(3 * 7 + 2 * 2 - 3, dtype=torch.bool)},
        Refuses(ValueError, "custom_mask"),
    )
    c.add(
        "index",
        "plan: paged_kv_indices -1",
        lambda a: {"paged_kv_indices": i32(3, 0, -1)},
        Refuses(ValueError, "paged_kv_indices"),
    )
    c.add(
        "indptr", "plan: qo_indptr decreasing", lambda a: {"qo_indptr": i32(0, 3, 2)}, Refuses(ValueError, "qo_indptr")
    )
    c.add(
        "indptr",
        "plan: qo_indptr not starting at 0",
        lambda a: {"qo_indptr": i32(1, 3, 5)},
        Refuses(ValueError, "qo_indptr"),
    )
    c.add(
        "indptr",
        "plan: paged_kv_indptr past the indices",
        lambda a: {"paged_kv_indptr": i32(0, 2, 4)},
        Refuses(ValueError, "paged_kv_indptr"),
    )
    c.add(
        "indptr",
        "plan: paged_kv_indptr decreasing",
        lambda a: {"paged_kv_indptr": i32(0, 2, 1)},
        Refuses(ValueError, "paged_kv_indptr"),
    )
    c.add(
        "length",
        "plan: paged_kv_last_page_len 5 > page_size",
        lambda a: {"paged_kv_last_page_len": i32(3, 5)},
        Refuses(ValueError, "paged_kv_last_page_len"),
    )
    c.add(
        "length",
        "plan: paged_kv_last_page_len -1",
        lambda a: {"paged_kv_last_page_len": i32(-1, 2)},
        Refuses(ValueError, "paged_kv_last_page_len"),
    )
    run = run_setup()
    _paged_run_cases(c, run)
    c.add(
        "misuse",
        "run before plan",
        None,
        Refuses(PlanStateError, "plan"),
        setup=_unplanned(kernforge.BatchPrefillWithPagedKVCacheWrapper, 5),
    )
    c.add("misuse", "run: q 4 tokens, planned 5", lambda a: {"q": a["q"][:4]}, Refuses(ValueError, "q"), setup=run)
    c.add(
        "misuse",
        "run: cache head_dim 32, planned 64",
        lambda a: {"paged_kv_cache": a["paged_kv_cache"][..., :32]},
        Refuses(ValueError, "head_dim"),
        setup=run,
    )
    c.add(
        "misuse",
        "run: cache float16, planned bf16",
        lambda a: {"paged_kv_cache": a["paged_kv_cache"].half()},
        Refuses(ValueError, "k"),
        setup=run,
    )
    c.add(
        "index",
        "run: paged_kv_indices hold page 5 of a 5-page cache",
        None,
        Refuses(ValueError, "paged_kv_indices"),
        setup=run_setup(paged_kv_indices=i32(3, 0, 5)),
    )
    c.add(
        "alias",
        "run: out is in the cache",
        lambda a: {"out": a["paged_kv_cache"].view(-1)[: 5 * QO_HEADS * HEAD_DIM].view(5, QO_HEADS, HEAD_DIM)},
        Refuses(ValueError, "out"),
        setup=run,
    )
    c.add(
        "nan",
        "run: NaN in q token 4",
        lambda a: {"q": with_value(a["q"], (4, 3, 1), NAN)},
        nan_rows(arg("out"), [4], "token 4 NaN, others unchanged"),
        setup=run,
    )
    return c


def _unplanned(cls, tokens):
    def setup():
        wrapper = cls(workspace())
        return Setup(wrapper.run, q=randn(tokens, QO_HEADS, HEAD_DIM, dtype=BF16), paged_kv_cache=paged_cache())

    return setup


def _ragged_plan_args(**changes):
    args = {
        "qo_indptr": i32(0, 3, 5),
        "kv_indptr": i32(0, 4, 9),
        "num_qo_heads": QO_HEADS,
        "num_kv_heads": KV_HEADS,
        "head_dim_qk": HEAD_DIM,
        "causal": True,
        "q_data_type": BF16,
    }
    args.update(changes)
    return args


def prefill_ragged_cases() -> CaseList:
    name = "BatchPrefillWithRaggedKVCacheWrapper"

    def plan_setup():
        wrapper = kernforge.BatchPrefillWithRaggedKVCacheWrapper(workspace())
        return Setup(wrapper.plan, **_ragged_plan_args())

    def run():
        wrapper = kernforge.BatchPrefillWithRaggedKVCacheWrapper(workspace())
        wrapper.plan(**_ragged_plan_args())
        return Setup(
            wrapper.run,
            q=randn(5, QO_HEADS, HEAD_DIM, dtype=BF16, seed=9),
            k=randn(9, KV_HEADS, HEAD_DIM, dtype=BF16, seed=1),
            v=randn(9, KV_HEADS, HEAD_DIM, dtype=BF16, seed=2),
            out=torch.empty(5, QO_HEADS, HEAD_DIM, dtype=BF16),
        )

    c = CaseList(name, plan_setup)
    c.add(
        "dtype",
        "plan: kv_indptr float",
        lambda a: {"kv_indptr": a["kv_indptr"].float()},
        Refuses(TypeError, "kv_indptr"),
    )
    c.add(
        "device",
        "plan: qo_indptr on meta",
        lambda a: {"qo_indptr": on_meta(a["qo_indptr"])},
        Refuses(ValueError, "qo_indptr"),
    )
    c.add(
        "shape",
        "plan: kv_indptr one longer",
        lambda a: {"kv_indptr": i32(0, 4, 9, 9)},
        Refuses(ValueError, "kv_indptr"),
    )
    c.add("shape", "plan: head_dim_vo 600", lambda a: {"head_dim_vo": 600}, Refuses(ValueError, "head_dim_vo"))
    c.add(
        "indptr", "plan: kv_indptr decreasing", lambda a: {"kv_indptr": i32(0, 4, 3)}, Refuses(ValueError, "kv_indptr")
    )
    c.add(
        "indptr",
        "plan: kv_indptr not starting at 0",
        lambda a: {"kv_indptr": i32(2, 4, 9)},
        Refuses(ValueError, "kv_indptr"),
    )
    c.add(
        "indptr", "plan: qo_indptr negative", lambda a: {"qo_indptr": i32(0, -3, 5)}, Refuses(ValueError, "qo_indptr")
    )
    c.add("misuse", "run before plan", None, Refuses(PlanStateError, "plan"), setup=_unplanned_ragged)
    c.add("misuse", "run: k 8 tokens, planned 9", lambda a: {"k": a["k"][:8]}, Refuses(ValueError, "k"), setup=run)
    c.add(
        "misuse",
        "run: v 3 heads, planned 2",
        lambda a: {"v": randn(9, 3, HEAD_DIM, dtype=BF16)},
        Refuses(ValueError, "v"),
        setup=run,
    )
    c.add(
        "misuse",
        "run: q head_dim 32, planned 64",
        lambda a: {"q": a["q"][..., :32]},
        Refuses(ValueError, "q"),
        setup=run,
    )
    c.add("dtype", "run: k float32, planned bf16", lambda a: {"k": a["k"].float()}, Refuses(ValueError, "k"), setup=run)
    c.add("device", "run: v on meta", lambda a: {"v": on_meta(a["v"])}, Refuses(ValueError, "v"), setup=run)
    c.add("alias", "run: out is q", lambda a: {"out": a["q"]}, Refuses(ValueError, "out"), setup=run)
    c.add(
        "alias",
        "run: out overlaps v",
        lambda a: overlapping(a, "v", "out", (5, QO_HEADS, HEAD_DIM), HEAD_DIM),
        Refuses(ValueError, "out"),
        setup=run,
    )
    c.add(
        "nan",
        "run: NaN in k rows past kv_indptr[-1]",
        lambda a: {
            "k": torch.cat([a["k"], torch.full((2, KV_HEADS, HEAD_DIM), NAN, dtype=BF16)]),
            "v": torch.cat([a["v"], torch.full((2, KV_HEADS, HEAD_DIM), NAN, dtype=BF16)]),
        },
        all_finite(arg("out"), "not read: output unchanged"),
        setup=run,
    )
    c.add(
        "nan",
        "run: NaN in a key only the last query sees",
        lambda a: {"k": with_value(a["k"], (8, 0, 0), NAN)},
        nan_rows(arg("out"), [4], "only that query NaN"),
        setup=run,
    )
    c.add(
        "guard",
        "run: q, k, v, out end at a PROT_NONE page",
        lambda a: {n: guarded(a[n]) for n in ("q", "k", "v", "out")},
        SameAsPlain(),
        setup=run,
    )
    return c


def _unplanned_ragged():
    wrapper = kernforge.BatchPrefillWithRaggedKVCacheWrapper(workspace())
    k = randn(9, KV_HEADS, HEAD_DIM, dtype=BF16)
    return Setup(wrapper.run, q=randn(5, QO_HEADS, HEAD_DIM, dtype=BF16), k=k, v=k.clone())


def cases() -> list[CaseList]:
    return [
        merge_state_cases(),
        merge_state_in_place_cases(),
        merge_states_cases(),
        append_cases(),
        get_seq_lens_cases(),
        batch_indices_positions_cases(),
        single_decode_cases(),
        single_prefill_cases("single_prefill_with_kv_cache"),
        single_prefill_cases("single_prefill_with_kv_cache_return_lse"),
        decode_cases(),
        prefill_paged_cases(),
        prefill_ragged_cases(),
    ]
