"""The table's cases for the MLA family (its wrapper, the latent append, the absorbed projections) and the
MoE family (routing, fused and shared experts)."""

from __future__ import annotations

import math

import torch
from hostile_checks import all_finite, arg, in_place_out, nan_rows, result
from hostile_harness import (
    CaseList,
    Refuses,
    Runs,
    SameAsPlain,
    Setup,
    gen,
    guarded,
    i32,
    i64,
    on_meta,
    overlapping,
    randn,
    same_bits,
    with_value,
)

import kernforge
from kernforge.ops.attention._wrapper import PlanStateError

BF16, F32 = torch.bfloat16, torch.float32
NAN, INF = float("nan"), float("inf")

# --------------------------------------------------------------------------- MLA attention

CKV, KPE, MLA_HEADS, MLA_PAGES, MLA_PAGE = 512, 64, 4, 5, 4  # DeepSeek's latent dims, as the MLA tests use


def _mla_table(**changes):
    # request 0: 2 queries over 7 tokens in pages 3, 0; request 1: 1 query over 2 tokens in page 4 (the last)
    table = {"qo_indptr": i32(0, 2, 3), "kv_indptr": i32(0, 2, 3), "kv_indices": i32(3, 0, 4), "kv_len_arr": i32(7, 2)}
    table.update(changes)
    return table


def _mla_plan_args(**changes):
    args = _mla_table()
    args.update(
        num_heads=MLA_HEADS,
        head_dim_ckv=CKV,
        head_dim_kpe=KPE,
        page_size=MLA_PAGE,
        causal=True,
        sm_scale=1 / math.sqrt(192),
        q_data_type=BF16,
        kv_data_type=BF16,
    )
    args.update(changes)
    return args


def _latent_cache():
    buffer = randn(MLA_PAGES, MLA_PAGE, CKV + KPE, dtype=BF16, seed=31)
    return buffer[..., :CKV], buffer[..., CKV:]  # adjacent views of one buffer, as engines hold it


MLA_UNREAD = ((1, slice(None)), (2, slice(None)), (0, slice(3, None)), (4, slice(2, None)))


def _poisoned_latents(ckv, kpe):
    ckv, kpe = ckv.clone(), kpe.clone()
    for page, slots in MLA_UNREAD:
        ckv[page, slots] = NAN
        kpe[page, slots] = NAN
    return ckv, kpe


def mla_wrapper_cases() -> CaseList:
    name = "BatchMLAPagedAttentionWrapper"

    def plan_setup():
        wrapper = kernforge.BatchMLAPagedAttentionWrapper(torch.empty(8 << 20, dtype=torch.uint8))
        return Setup(wrapper.plan, **_mla_plan_args())

    def run_setup(**changes):
        def setup():
            wrapper = kernforge.BatchMLAPagedAttentionWrapper(torch.empty(8 << 20, dtype=torch.uint8))
            wrapper.plan(**_mla_plan_args(**changes))
            ckv, kpe = _latent_cache()
            return Setup(
                wrapper.run,
                q_nope=randn(3, MLA_HEADS, CKV, dtype=BF16, seed=32),
                q_pe=randn(3, MLA_HEADS, KPE, dtype=BF16, seed=33),
                ckv_cache=ckv,
                kpe_cache=kpe,
                out=torch.empty(3, MLA_HEADS, CKV, dtype=BF16),
            )

        return setup

    run = run_setup()
    c = CaseList(name, plan_setup)
    c.add(
        "dtype",
        "plan: kv_indices float",
        lambda a: {"kv_indices": a["kv_indices"].float()},
        Refuses(TypeError, "kv_indices"),
    )
    c.add("dtype", "plan: q_data_type int8", lambda a: {"q_data_type": torch.int8}, Refuses(TypeError, "q_data_type"))
    c.add(
        "device",
        "plan: kv_len_arr on meta",
        lambda a: {"kv_len_arr": on_meta(a["kv_len_arr"])},
        Refuses(ValueError, "kv_len_arr"),
    )
    c.add("shape", "plan: qo_indptr one short", lambda a: {"qo_indptr": i32(0, 2)}, Refuses(ValueError, "qo_indptr"))
    c.add("shape", "plan: head_dim_kpe -1", lambda a: {"head_dim_kpe": -1}, Refuses(ValueError, "head_dim_kpe"))
    c.add("index", "plan: kv_indices -1", lambda a: {"kv_indices": i32(3, -1, 4)}, Refuses(ValueError, "kv_indices"))
    c.add(
        "indptr", "plan: kv_indptr decreasing", lambda a: {"kv_indptr": i32(0, 2, 1)}, Refuses(ValueError, "kv_indptr")
    )
    c.add(
        "indptr",
        "plan: kv_indptr not starting at 0",
        lambda a: {"kv_indptr": i32(1, 2, 3)},
        Refuses(ValueError, "kv_indptr"),
    )
    c.add(
        "indptr",
        "plan: kv_indptr past kv_indices",
        lambda a: {"kv_indptr": i32(0, 2, 4)},
        Refuses(ValueError, "kv_indptr"),
    )
    c.add(
        "indptr", "plan: qo_indptr decreasing", lambda a: {"qo_indptr": i32(0, 2, 1)}, Refuses(ValueError, "qo_indptr")
    )
    c.add(
        "length",
        "plan: kv_len_arr past its pages",
        lambda a: {"kv_len_arr": i32(9, 2)},
        Refuses(ValueError, "kv_len_arr"),
    )
    c.add("length", "plan: kv_len_arr -1", lambda a: {"kv_len_arr": i32(7, -1)}, Refuses(ValueError, "kv_len_arr"))
    c.add("misuse", "run before plan", None, Refuses(PlanStateError, "plan"), setup=_unplanned_mla)
    c.add(
        "misuse",
        "run: q_nope 2 tokens, planned 3",
        lambda a: {"q_nope": a["q_nope"][:2]},
        Refuses(ValueError, "q_nope"),
        setup=run,
    )
    c.add(
        "misuse",
        "run: q_pe head_dim 32, planned 64",
        lambda a: {"q_pe": a["q_pe"][..., :32]},
        Refuses(ValueError, "q_pe"),
        setup=run,
    )
    c.add(
        "misuse",
        "run: ckv_cache page_size 2, planned 4",
        lambda a: {"ckv_cache": a["ckv_cache"][:, :2], "kpe_cache": a["kpe_cache"][:, :2]},
        Refuses(ValueError, "page_size"),
        setup=run,
    )
    c.add(
        "misuse",
        "run: latent cache float16, planned bf16",
        lambda a: {"ckv_cache": a["ckv_cache"].half(), "kpe_cache": a["kpe_cache"].half()},
        Refuses(ValueError, "ckv_cache"),
        setup=run,
    )
    c.add(
        "index",
        "run: kv_indices hold page 5 of a 5-page cache",
        None,
        Refuses(ValueError, "kv_indices"),
        setup=run_setup(kv_indices=i32(3, 0, 5)),
    )
    c.add(
        "dtype",
        "run: kpe_cache float32, ckv_cache bf16",
        lambda a: {"kpe_cache": a["kpe_cache"].float()},
        Refuses(TypeError, "kpe_cache"),
        setup=run,
    )
    c.add("dtype", "run: out float32", lambda a: {"out": a["out"].float()}, Refuses(ValueError, "out"), setup=run)
    c.add(
        "device",
        "run: ckv_cache on meta",
        lambda a: {"ckv_cache": on_meta(a["ckv_cache"])},
        Refuses(ValueError, "ckv_cache"),
        setup=run,
    )
    c.add(
        "device",
        "run: q_nope on meta",
        lambda a: {"q_nope": on_meta(a["q_nope"])},
        Refuses(ValueError, "q_nope"),
        setup=run,
    )
    c.add(
        "shape", "run: out [3, 4, 256]", lambda a: {"out": a["out"][..., :256]}, Refuses(ValueError, "out"), setup=run
    )
    c.add("alias", "run: out is q_nope", lambda a: {"out": a["q_nope"]}, Refuses(ValueError, "out"), setup=run)
    c.add(
        "alias",
        "run: out is in ckv_cache",
        lambda a: {
            "out": a["ckv_cache"].reshape(-1)[: 3 * MLA_HEADS * CKV].view(3, MLA_HEADS, CKV)
            if a["ckv_cache"].is_contiguous()
            else torch.as_strided(a["ckv_cache"], (3, MLA_HEADS, CKV), (MLA_HEADS * (CKV + KPE), CKV + KPE, 1))
        },
        Refuses(ValueError, "out"),
        setup=run,
    )
    c.add(
        "nan",
        "run: NaN in every unread latent slot",
        lambda a: dict(zip(("ckv_cache", "kpe_cache"), _poisoned_latents(a["ckv_cache"], a["kpe_cache"]))),
        all_finite(arg("out"), "not read: output unchanged"),
        setup=run,
    )
    c.add(
        "nan",
        "run: NaN in q_nope token 2",
        lambda a: {"q_nope": with_value(a["q_nope"], (2, 1, 0), NAN)},
        nan_rows(arg("out"), [2], "token 2 NaN, others unchanged"),
        setup=run,
    )
    c.add(
        "guard",
        "run: q_nope, q_pe, separate caches, out end at a PROT_NONE page",
        lambda a: {n: guarded(a[n]) for n in ("q_nope", "q_pe", "ckv_cache", "kpe_cache", "out")},
        SameAsPlain(),
        setup=run,
    )
    return c


def _unplanned_mla():
    wrapper = kernforge.BatchMLAPagedAttentionWrapper(torch.empty(8 << 20, dtype=torch.uint8))
    ckv, kpe = _latent_cache()
    return Setup(
        wrapper.run,
        q_nope=randn(3, MLA_HEADS, CKV, dtype=BF16),
        q_pe=randn(3, MLA_HEADS, KPE, dtype=BF16),
        ckv_cache=ckv,
        kpe_cache=kpe,
    )


def append_mla_cases() -> CaseList:
    def setup():
        ckv, kpe = _latent_cache()
        t = _mla_table()
        return Setup(
            kernforge.append_paged_mla_kv_cache,
            append_ckv=randn(3, CKV, dtype=BF16, seed=34),
            append_kpe=randn(3, KPE, dtype=BF16, seed=35),
            batch_indices=i32(0, 0, 1),
            positions=i32(4, 6, 3),
            ckv_cache=ckv.clone(),
            kpe_cache=kpe.clone(),
            kv_indices=t["kv_indices"],
            kv_indptr=t["kv_indptr"],
            kv_last_page_len=i32(3, 2),
        )

    c = CaseList("append_paged_mla_kv_cache", setup)
    c.dtype("append_ckv", F32).dtype("positions", F32).dtype("kpe_cache", torch.float16)
    c.meta("append_kpe").meta("batch_indices").meta("ckv_cache")
    c.refuse("shape", "append_ckv [3, 511]", lambda a: {"append_ckv": a["append_ckv"][:, :511]}, "append_ckv")
    c.refuse("shape", "append_kpe 2 tokens", lambda a: {"append_kpe": a["append_kpe"][:2]}, "append_kpe")
    c.refuse("shape", "kpe_cache 3 pages", lambda a: {"kpe_cache": a["kpe_cache"][:3]}, "kpe_cache")
    c.refuse("index", "batch_indices 2 (= batch)", lambda a: {"batch_indices": i32(0, 2, 1)}, "batch_indices")
    c.refuse("index", "positions -3", lambda a: {"positions": i32(4, -3, 3)}, "positions")
    c.refuse("index", "positions past the request's pages", lambda a: {"positions": i32(4, 6, 4)}, "positions")
    c.refuse("index", "kv_indices 5 (= num_pages)", lambda a: {"kv_indices": i32(3, 5, 4)}, "kv_indices")
    c.refuse("indptr", "kv_indptr past kv_indices", lambda a: {"kv_indptr": i32(0, 2, 5)}, "kv_indptr")
    c.refuse("indptr", "kv_indptr decreasing", lambda a: {"kv_indptr": i32(0, 3, 2)}, "kv_indptr")
    c.add(
        "nan",
        "NaN in append_kpe, copied as is",
        lambda a: {"append_kpe": with_value(a["append_kpe"], (2, 0), NAN)},
        Runs(lambda res, args, plain: _check(torch.isnan(args["kpe_cache"][4, 3, 0])), "stored as is"),
    )
    c.guard("append_ckv", "append_kpe", "ckv_cache", "kpe_cache")
    return c


# --------------------------------------------------------------------------- MLA projections

HIDDEN, Q_LORA, KV_LORA, NOPE, ROPE, V_HEAD, PROJ_HEADS = 96, 48, 64, 32, 16, 40, 4


def _weight(n, k, seed):
    return (randn(n, k, seed=seed) / math.sqrt(k)).to(BF16)


def _mla_layer():
    angles = torch.arange(16, dtype=torch.float64)[:, None] / 1e4 ** (torch.arange(0, ROPE, 2) / ROPE)
    return {
        "q_a": _weight(Q_LORA, HIDDEN, 41),
        "q_b": _weight(PROJ_HEADS * (NOPE + ROPE), Q_LORA, 42),
        "kv_a": _weight(KV_LORA + ROPE, HIDDEN, 43),
        "kv_b": _weight(PROJ_HEADS * (NOPE + V_HEAD), KV_LORA, 44),
        "q_norm": (1 + 0.3 * randn(Q_LORA, seed=45)).to(BF16),
        "kv_norm": (1 + 0.3 * randn(KV_LORA, seed=46)).to(BF16),
        "cos_sin": torch.cat([angles.cos(), angles.sin()], -1).float(),
    }


def _proj_common(layer):
    return {
        "hidden_states": randn(3, HIDDEN, dtype=BF16, seed=47),
        "q_a_layernorm_weight": layer["q_norm"],
        "kv_a_layernorm_weight": layer["kv_norm"],
        "positions": i64(0, 7, 15),
        "cos_sin_cache": layer["cos_sin"],
        "eps": 1e-6,
    }


def qkv_proj_cases(name: str) -> CaseList:
    fused = name.endswith("fused_weight")

    def setup():
        layer = _mla_layer()
        absorbed = kernforge.absorb_kv_b_proj(layer["kv_b"], NOPE, V_HEAD)
        if fused:
            return Setup(
                kernforge.qkv_proj_with_rope_fused_weight,
                qkv_a_proj_weight=kernforge.convert_weight_packed(torch.cat([layer["q_a"], layer["kv_a"]])),
                q_b_proj_weight=kernforge.convert_weight_packed(layer["q_b"]),
                w_kc=absorbed.w_kc,
                **_proj_common(layer),
                use_int8_w8a8=False,
                use_fp8_w8a16=False,
                qkv_a_proj_scale=None,
                q_b_proj_scale=None,
                w_scale=None,
                is_vnni=True,
                block_size=None,
                q_lora_rank=Q_LORA,
                kv_lora_rank=KV_LORA,
                qk_rope_head_dim=ROPE,
            )
        return Setup(
            kernforge.qkv_proj_with_rope,
            q_a_proj_weight=kernforge.convert_weight_packed(layer["q_a"]),
            q_b_proj_weight=kernforge.convert_weight_packed(layer["q_b"]),
            kv_a_proj_weight=kernforge.convert_weight_packed(layer["kv_a"]),
            w_kc=absorbed.w_kc,
            **_proj_common(layer),
        )

    c = CaseList(name, setup)
    c.dtype("hidden_states", torch.int32).dtype("positions", F32).dtype("kv_a_layernorm_weight", F32)
    c.meta("hidden_states").meta("positions").meta("cos_sin_cache").meta("q_a_layernorm_weight")
    c.refuse("shape", "hidden_states 3-D", lambda a: {"hidden_states": a["hidden_states"][None]}, "hidden_states")
    c.refuse(
        "shape",
        "hidden_states hidden 97",
        lambda a: {"hidden_states": randn(3, HIDDEN + 1, dtype=BF16)},
        "hidden_states",
    )
    c.refuse("shape", "positions 2 entries", lambda a: {"positions": i64(0, 1)}, "positions")
    c.refuse(
        "shape",
        "q_a_layernorm_weight [49]",
        lambda a: {"q_a_layernorm_weight": randn(Q_LORA + 1, dtype=BF16)},
        "q_a_layernorm_weight",
    )
    c.refuse("shape", "w_kc 3 heads", lambda a: {"w_kc": a["w_kc"][:3]}, "w_kc")
    c.refuse("index", "positions 16 (= cache rows)", lambda a: {"positions": i64(0, 16, 1)}, "positions")
    c.refuse("index", "positions -1", lambda a: {"positions": i64(0, -1, 1)}, "positions")
    c.add(
        "nan",
        "NaN in hidden_states token 1",
        lambda a: {"hidden_states": with_value(a["hidden_states"], (1, 3), NAN)},
        nan_rows(
            result(0),
            [1],
            "token 1 NaN in every output, others unchanged",
            others=(lambda r, a: r[1][[0, 2]], lambda r, a: r[2][[0, 2]]),
        ),
    )
    c.guard("hidden_states", "positions", "cos_sin_cache", "q_a_layernorm_weight", "kv_a_layernorm_weight")
    return c


def absorb_cases() -> CaseList:
    c = CaseList(
        "absorb_kv_b_proj",
        lambda: Setup(
            kernforge.absorb_kv_b_proj, kv_b_proj_weight=_mla_layer()["kv_b"], qk_nope_head_dim=NOPE, v_head_dim=V_HEAD
        ),
    )
    c.dtype("kv_b_proj_weight", F32).dtype("kv_b_proj_weight", torch.int32)
    c.meta("kv_b_proj_weight")
    c.refuse(
        "shape",
        "kv_b_proj_weight a row short",
        lambda a: {"kv_b_proj_weight": a["kv_b_proj_weight"][1:]},
        "kv_b_proj_weight",
    )
    c.refuse("shape", "qk_nope_head_dim 0", lambda a: {"qk_nope_head_dim": 0}, "qk_nope_head_dim")
    c.refuse("shape", "weight_scale for a bf16 weight", lambda a: {"weight_scale": torch.ones(1)}, "weight_scale")
    c.add(
        "nan",
        "NaN in kv_b_proj_weight, kept",
        lambda a: {"kv_b_proj_weight": with_value(a["kv_b_proj_weight"], (0, 0), NAN)},
        Runs(
            lambda res, args, plain: _check(sum(int(torch.isnan(p.packed.float()).sum()) for p in res.w_kc) == 1),
            "packed as is (head 0's w_kc)",
        ),
    )
    c.guard("kv_b_proj_weight")
    return c


def mla_output_proj_cases() -> CaseList:
    def setup():
        absorbed = kernforge.absorb_kv_b_proj(_mla_layer()["kv_b"], NOPE, V_HEAD)
        return Setup(
            kernforge.mla_output_proj,
            attn_latent=randn(3, PROJ_HEADS, KV_LORA, dtype=BF16, seed=48),
            w_vc=absorbed.w_vc,
            out=torch.empty(3, PROJ_HEADS * V_HEAD, dtype=BF16),
        )

    c = CaseList("mla_output_proj", setup)
    c.dtype("attn_latent", torch.int32).dtype("out", F32)
    c.meta("attn_latent").meta("out")
    c.refuse("shape", "attn_latent 2-D", lambda a: {"attn_latent": a["attn_latent"][0]}, "attn_latent")
    c.refuse("shape", "attn_latent 3 heads", lambda a: {"attn_latent": a["attn_latent"][:, :3]}, "w_vc")
    c.refuse("shape", "out [3, 159]", lambda a: {"out": a["out"][:, :-1]}, "out")
    c.refuse("shape", "w_vc not weights", lambda a: {"w_vc": [1, 2]}, "w_vc", TypeError)
    c.refuse(
        "alias",
        "out overlaps attn_latent",
        lambda a: overlapping(a, "attn_latent", "out", (3, PROJ_HEADS * V_HEAD), 16),
        "out",
    )
    c.add(
        "nan",
        "NaN in attn_latent token 2",
        lambda a: {"attn_latent": with_value(a["attn_latent"], (2, 0, 1), NAN)},
        nan_rows(result(), [2], "token 2 NaN, others unchanged"),
    )
    c.guard("attn_latent", "out")
    return c


# --------------------------------------------------------------------------- MoE routing

TOKENS, EXPERTS = 4, 8


def _gating(seed=51):
    return randn(TOKENS, EXPERTS, seed=seed)


def _ids_in_range_others_unchanged(row):
    def check(res, args, plain):
        weights, ids = res
        assert bool(((ids >= 0) & (ids < EXPERTS)).all()), f"expert ids out of range: {ids}"
        for r in range(TOKENS):
            if r != row:
                assert same_bits(weights[r], plain[0][0][r]) and same_bits(ids[r], plain[0][1][r])

    return Runs(check, "ids stay in [0, E), other tokens unchanged")


def routing_cases(name: str) -> CaseList:
    op = getattr(kernforge, name)
    grouped = "grouped" in name
    biased = name.startswith("biased")

    def setup():
        args = {
            "hidden_states": torch.zeros(TOKENS, 16, dtype=BF16),
            "gating_output": _gating(),
            "topk": 2,
            "renormalize": True,
        }
        if biased:
            args["correction_bias"] = randn(EXPERTS, seed=52)
        if grouped:
            args.update(num_expert_group=4, topk_group=2)
        return Setup(op, **args)

    c = CaseList(name, setup)
    c.dtype("gating_output", torch.int32).dtype("gating_output", torch.float64)
    c.meta("gating_output")
    c.refuse("shape", "gating_output 1-D", lambda a: {"gating_output": a["gating_output"][0]}, "gating_output")
    c.refuse("shape", "hidden_states 3 tokens", lambda a: {"hidden_states": a["hidden_states"][:3]}, "hidden_states")
    c.refuse("index", "topk 0", lambda a: {"topk": 0}, "topk")
    c.refuse("index", "topk 9 > experts", lambda a: {"topk": EXPERTS + 1}, "topk")
    if grouped:
        c.refuse("index", "num_expert_group 3 (not dividing 8)", lambda a: {"num_expert_group": 3}, "num_expert_group")
        c.refuse("index", "topk_group 5 > groups", lambda a: {"topk_group": 5}, "topk_group")
    if biased:
        c.dtype("correction_bias", torch.int32)
        c.meta("correction_bias")
        c.refuse(
            "shape", "correction_bias [7]", lambda a: {"correction_bias": a["correction_bias"][:7]}, "correction_bias"
        )
    c.add(
        "nan",
        "NaN in gating_output token 1",
        lambda a: {"gating_output": with_value(a["gating_output"], (1, 3), NAN)},
        _ids_in_range_others_unchanged(1),
    )
    c.add(
        "nan",
        "all-NaN gating row 2",
        lambda a: {"gating_output": with_value(a["gating_output"], 2, NAN)},
        _ids_in_range_others_unchanged(2),
    )
    c.guard("gating_output")
    return c


# --------------------------------------------------------------------------- MoE experts

HIDDEN_MOE, INTER = 32, 16


def _expert_weights():
    g = gen(61)
    w1 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN_MOE, generator=g) / math.sqrt(HIDDEN_MOE)).to(BF16)
    w2 = (torch.randn(EXPERTS, HIDDEN_MOE, INTER, generator=g) / math.sqrt(INTER)).to(BF16)
    return w1, w2


def _route():
    weights, ids = torch.topk(torch.softmax(_gating(62), -1), 2)
    return weights, ids.to(torch.int32)


def fused_experts_cases() -> CaseList:
    def setup():
        w1, w2 = _expert_weights()
        weights, ids = _route()
        return Setup(
            kernforge.fused_experts,
            hidden_states=randn(TOKENS, HIDDEN_MOE, dtype=BF16, seed=63),
            w1=w1,
            w2=w2,
            topk_weights=weights,
            topk_ids=ids,
            out=torch.empty(TOKENS, HIDDEN_MOE, dtype=BF16),
        )

    c = CaseList("fused_experts", setup)
    c.dtype("hidden_states", torch.int32).dtype("w1", F32).dtype("topk_ids", F32).dtype("out", F32)
    c.meta("hidden_states").meta("topk_ids").meta("out")
    c.refuse("shape", "hidden_states 3-D", lambda a: {"hidden_states": a["hidden_states"][None]}, "hidden_states")
    c.refuse("shape", "w2 [E, H, I - 1]", lambda a: {"w2": a["w2"][..., :-1]}, "w2")
    c.refuse("shape", "topk_weights [4, 1]", lambda a: {"topk_weights": a["topk_weights"][:, :1]}, "topk_weights")
    c.refuse(
        "shape",
        "out rows expanded (overlap)",
        lambda a: {"out": torch.empty(1, HIDDEN_MOE, dtype=BF16).expand(TOKENS, HIDDEN_MOE)},
        "out",
    )
    c.refuse("index", "topk_ids -1", lambda a: {"topk_ids": with_value(a["topk_ids"], (0, 0), -1)}, "topk_ids")
    c.refuse(
        "index", "topk_ids 8 (= E)", lambda a: {"topk_ids": with_value(a["topk_ids"], (3, 1), EXPERTS)}, "topk_ids"
    )
    c.refuse(
        "index",
        "topk_ids int64 2**32",
        lambda a: {"topk_ids": with_value(a["topk_ids"].long(), (2, 0), 2**32)},
        "topk_ids",
    )
    in_place_out(c, "hidden_states", (TOKENS, HIDDEN_MOE), "allowed: as inplace=True")
    c.add(
        "nan",
        "NaN in hidden_states token 2",
        lambda a: {"hidden_states": with_value(a["hidden_states"], (2, 5), NAN)},
        nan_rows(arg("out"), [2], "token 2 NaN, others unchanged"),
    )
    c.add(
        "nan",
        "NaN in topk_weights token 0",
        lambda a: {"topk_weights": with_value(a["topk_weights"], (0, 1), NAN)},
        nan_rows(arg("out"), [0], "token 0 NaN, others unchanged"),
    )
    c.guard("hidden_states", "w1", "w2", "topk_weights", "topk_ids", "out")
    return c


def _check(ok):
    assert ok


def shared_expert_cases() -> CaseList:
    def setup():
        w1, w2 = _expert_weights()
        return Setup(
            kernforge.shared_expert,
            hidden_states=randn(TOKENS, HIDDEN_MOE, dtype=BF16, seed=64),
            w1=w1[0],
            w2=w2[0],
            fused_experts_out=randn(TOKENS, HIDDEN_MOE, dtype=BF16, seed=65),
            routed_scaling_factor=2.5,
            out=torch.empty(TOKENS, HIDDEN_MOE, dtype=BF16),
        )

    c = CaseList("shared_expert", setup)
    c.dtype("hidden_states", torch.float64).dtype("w2", torch.float16).dtype("out", F32)
    c.refuse(
        "dtype",
        "fused_experts_out float32",
        lambda a: {"fused_experts_out": a["fused_experts_out"].float()},
        "fused_experts_out",
    )
    c.meta("hidden_states").meta("fused_experts_out").meta("out")
    c.refuse("shape", "w1 3-D (two experts)", lambda a: {"w1": torch.stack([a["w1"], a["w1"]])}, "w1")
    c.refuse(
        "shape",
        "fused_experts_out 3 tokens",
        lambda a: {"fused_experts_out": a["fused_experts_out"][:3]},
        "fused_experts_out",
    )
    c.refuse(
        "shape",
        "routed_scaling_factor without fused_experts_out",
        lambda a: {"fused_experts_out": None},
        "fused_experts_out",
    )
    in_place_out(c, "fused_experts_out", (TOKENS, HIDDEN_MOE), "allowed: same result", "out is fused_experts_out")
    c.add(
        "nan",
        "NaN in fused_experts_out token 1",
        lambda a: {"fused_experts_out": with_value(a["fused_experts_out"], (1, 0), NAN)},
        nan_rows(arg("out"), [1], "token 1 NaN, others unchanged"),
    )
    c.add(
        "nan",
        "Inf in hidden_states token 3",
        lambda a: {"hidden_states": with_value(a["hidden_states"], (3, 2), INF)},
        nan_rows(arg("out"), [3], "token 3 non-finite (NaN), others unchanged"),
    )
    c.guard("hidden_states", "w1", "w2", "fused_experts_out", "out")
    return c


def cases() -> list[CaseList]:
    return [
        mla_wrapper_cases(),
        append_mla_cases(),
        qkv_proj_cases("qkv_proj_with_rope"),
        qkv_proj_cases("qkv_proj_with_rope_fused_weight"),
        absorb_cases(),
        mla_output_proj_cases(),
        *(routing_cases(n) for n in ("topk_softmax", "topk_sigmoid", "grouped_topk", "biased_grouped_topk")),
        fused_experts_cases(),
        shared_expert_cases(),
    ]
