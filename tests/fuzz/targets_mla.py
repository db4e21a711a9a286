"""Fuzz targets: MLA. ``BatchMLAPagedAttentionWrapper`` as plan/run sequences (as the attention wrappers in
targets_attention.py: layers, the first run again, re-plans, shuffled and shared page tables, spare pages in
the pool and in a request's own pages, index buffers longer than the batch, NaN in unread slots),
``append_paged_mla_kv_cache`` bit for bit, and the output absorption ``mla_output_proj``.

The attention reference is test_mla_attention.py's: the latent cache expanded per request into one KV
head (keys ``[ckv | kpe]``, values ``ckv``), ``references.attention_reference`` in float64; out within
the q dtype's tolerance (bf16 1e-2, fp16 1e-3; the absolute part times v_scale above 1), LSE to 1e-4.
"""

from __future__ import annotations

import math
import random

import torch
from fuzzing import FuzzFailure, generator, size
from targets_attention import (
    ATTENTION_TOL,
    BF16,
    E4M3,
    E5M2,
    FP16,
    FP32,
    SENTINEL,
    ByName,
    add_layer_reference,
    as_float,
    batch_size,
    bits,
    garbage_tail,
    indptr_of,
    kv_length,
    page_table,
    read_slots,
    run_layers,
    run_outputs,
    scale_arg,
    scale_float,
    scale_value,
    scribble,
    target,
    threads,
    workspace,
)

import kernforge

from references import attention_reference

MLA_LSE_TOL = (1e-4, 1e-4)  # test_mla_attention.py
# (q dtype, latent cache dtype, head_dim_ckv, head_dim_kpe): DeepSeek's 512 + 64, without a rope part, small.
MLA_GEOMETRIES = [
    (BF16, BF16, 512, 64),
    (BF16, BF16, 512, 64),
    (BF16, E4M3, 512, 64),
    (BF16, E5M2, 512, 64),
    (FP16, FP16, 512, 64),
    (BF16, BF16, 512, 0),
    (BF16, E4M3, 512, 0),
    (BF16, BF16, 128, 32),
]


# --------------------------------------------------------------------------- BatchMLAPagedAttentionWrapper


def draw_mla_plan(rng: random.Random, first: dict | None) -> dict:
    batch = batch_size(rng, 5)
    causal = rng.random() < 0.5
    heads = first["num_heads"] if first and rng.random() < 0.5 else rng.choice([1, 3, 16, 16, 64, 128])
    # a query token is `heads` rows of 576: long chunks with few heads only (the generic tier's time)
    qo_lens = [rng.choice([1, 1, 1, 0, 2, 3, size(rng, 33) if heads <= 16 else 1]) for _ in range(batch)]
    kv_lens = [kv_length(rng, 1500) for _ in range(batch)]
    return {
        "qo_lens": qo_lens,
        "kv_lens": kv_lens,
        "causal": causal,
        "page_size": rng.choice([1, 1, 3, 16, 16, 64]),
        "spare": rng.choice([0, 1, 3]),  # pool pages no request owns
        "own_spare": rng.choice([0, 0, 1, 2]),  # pages a request owns beyond its length (unused)
        "share": rng.random() < 0.25,
        "poison": rng.random() < 0.5,
        "extra": rng.choice([0, 0, 1, 3]),  # qo_indptr, kv_indptr and kv_indices longer than the batch
        "num_heads": heads,
        "sm_scale": rng.choice([1.0 / math.sqrt(192), 0.05, 0.2]),
        "q_scale": rng.choice([None, None, 1.5]),
        "k_scale": scale_arg(rng, [None, None, 0.5]),
        "v_scale": scale_arg(rng, [None, None, 2.0]),
        "cache": rng.choice(["adjacent", "separate"]),  # one [..., ckv + kpe] buffer, or two tensors
        "q_form": rng.choice(["separate", "joined"]),  # q_nope and q_pe sliced from one buffer
        "layers": rng.choice([1, 1, 2, 3]),
        "io": rng.choice(["fresh", "fresh", "given"]),
        "return_lse": rng.random() < 0.85,
        "index_dtype": rng.choice([torch.int32, torch.int32, torch.int64]),
    }


def draw_mla(rng: random.Random) -> dict:
    q_dtype, kv_dtype, ckv, kpe = rng.choice(MLA_GEOMETRIES)
    plans = [draw_mla_plan(rng, None)]
    for _ in range(rng.choice([0, 0, 1, 2])):
        plans.append(draw_mla_plan(rng, plans[0]))
    return {
        "seed": rng.getrandbits(31),
        "q_dtype": q_dtype,
        "kv_dtype": kv_dtype,
        "head_dim_ckv": ckv,
        "head_dim_kpe": kpe,
        "threads": rng.choice([1, 2, 3]),
        "plans": plans,
    }


def mla_table(plan, g):
    """(qo_indptr, kv_indptr, kv_indices, num_pages): targets_attention.page_table's (a shuffled pool with
    spare pages, shared pages with ``share``), each request owning ``own_spare`` pages past those its
    length needs (FlashInfer's MLA reads the first ones)."""
    kv_indptr, indices, _, num_pages = page_table(
        plan["kv_lens"], plan["page_size"], plan["spare"], plan["share"], g, own_spare=plan["own_spare"]
    )
    return indptr_of(plan["qo_lens"]), kv_indptr, indices, num_pages


def mla_inputs(case):
    g = generator(case)
    ckv_dim, kpe_dim = case["head_dim_ckv"], case["head_dim_kpe"]
    plans = []
    for p, plan in enumerate(case["plans"]):
        qo_indptr, kv_indptr, indices, num_pages = mla_table(plan, g)
        read = read_slots(plan["kv_lens"], plan["page_size"], kv_indptr, indices, num_pages)
        total, heads = int(qo_indptr[-1]), plan["num_heads"]
        layers = []
        for layer in range(plan["layers"]):
            rows = torch.randn(
                (num_pages, plan["page_size"], ckv_dim + kpe_dim), generator=generator(case, 100 * p + layer)
            )
            if plan["poison"]:
                rows[~read] = math.nan
            rows = rows.to(case["kv_dtype"])
            if plan["cache"] == "adjacent":
                ckv, kpe = rows[..., :ckv_dim], rows[..., ckv_dim:]
            else:
                ckv, kpe = rows[..., :ckv_dim].clone(), rows[..., ckv_dim:].clone()
            q = torch.randn((total, heads, ckv_dim + kpe_dim), generator=g).to(case["q_dtype"])
            if plan["q_form"] == "joined":
                q_nope, q_pe = q[..., :ckv_dim], q[..., ckv_dim:]
            else:
                q_nope, q_pe = q[..., :ckv_dim].clone(), q[..., ckv_dim:].clone()
            layers.append({"rows": rows, "ckv": ckv, "kpe": kpe, "q": q, "q_nope": q_nope, "q_pe": q_pe})
        plans.append({"qo_indptr": qo_indptr, "kv_indptr": kv_indptr, "indices": indices, "layers": layers})
    return plans


def mla_run(case, inputs):
    outputs = {}
    with threads(case["threads"]):
        wrapper = kernforge.BatchMLAPagedAttentionWrapper(workspace())
        for p, (plan, tables) in enumerate(zip(case["plans"], inputs)):
            g = torch.Generator().manual_seed(case["seed"] + p)
            index, extra = plan["index_dtype"], plan["extra"]
            given = [garbage_tail(tables[name], extra, g).to(index) for name in ("qo_indptr", "kv_indptr", "indices")]
            kv_lens = torch.tensor(plan["kv_lens"], dtype=index)
            wrapper.plan(
                *given, kv_lens, plan["num_heads"], case["head_dim_ckv"], case["head_dim_kpe"], plan["page_size"],
                plan["causal"], plan["sm_scale"], case["q_dtype"], case["kv_dtype"],
            )  # fmt: skip
            scribble(*given, kv_lens)
            run_layers(outputs, p, tables["layers"], lambda layer: mla_layer(wrapper, case, plan, layer))
    return outputs


def mla_layer(wrapper, case, plan, layer) -> dict:
    out = lse = None
    if plan["io"] == "given":
        rows, heads = layer["q"].shape[:2]
        out = torch.full((rows, heads, case["head_dim_ckv"]), math.nan, dtype=case["q_dtype"])
        lse = torch.full((rows, heads), math.nan)
    scales = {name: scale_value(plan[name]) for name in ("q_scale", "k_scale", "v_scale")}
    result = wrapper.run(
        layer["q_nope"], layer["q_pe"], layer["ckv"], layer["kpe"], out=out, lse=lse, return_lse=plan["return_lse"],
        **scales,
    )  # fmt: skip
    return run_outputs(result, out, lse, plan["return_lse"])


def mla_reference(case, inputs):
    ckv_dim = case["head_dim_ckv"]
    outputs = {}
    for p, (plan, tables) in enumerate(zip(case["plans"], inputs)):
        for layer_index, layer in enumerate(tables["layers"]):
            rows = layer["rows"].double()
            outs, lses = [], []
            for b, kv_len in enumerate(plan["kv_lens"]):
                queries = slice(int(tables["qo_indptr"][b]), int(tables["qo_indptr"][b + 1]))
                pages = tables["indices"][int(tables["kv_indptr"][b]) : int(tables["kv_indptr"][b + 1])].long()
                keys = rows[pages].flatten(0, 1)[:kv_len]
                out, lse = attention_reference(
                    layer["q"][queries],
                    keys[:, None],
                    keys[:, None, :ckv_dim],
                    sm_scale=plan["sm_scale"] * as_float(plan["q_scale"]),
                    causal=plan["causal"],
                    k_scale=scale_float(plan["k_scale"]),
                    v_scale=scale_float(plan["v_scale"]),
                )
                outs.append(out)
                lses.append(lse)
            heads = plan["num_heads"]
            outs.insert(0, torch.zeros(0, heads, ckv_dim, dtype=torch.float64))  # an empty batch: no rows
            lses.insert(0, torch.zeros(0, heads, dtype=torch.float64))
            add_layer_reference(outputs, p, layer_index, plan, torch.cat(outs), torch.cat(lses))
    return outputs


def mla_tolerance(case):
    tol = ATTENTION_TOL[case["q_dtype"]]
    v_scales = {f"p{p}": scale_float(plan["v_scale"]) for p, plan in enumerate(case["plans"])}

    def pick(name):
        if name.endswith("lse"):
            return MLA_LSE_TOL
        return (tol * max(1.0, v_scales[name.split(".")[0]]), tol)

    return ByName(pick)


# --------------------------------------------------------------------------- append_paged_mla_kv_cache


def draw_mla_append(rng: random.Random) -> dict:
    batch = 1 if rng.random() < 0.3 else rng.randint(2, 6)
    return {
        "seed": rng.getrandbits(31),
        "seq_before": [kv_length(rng, 300) for _ in range(batch)],
        "appended": [rng.choice([0, 1, 1, size(rng, 40), rng.randint(0, 150)]) for _ in range(batch)],
        "page_size": rng.choice([1, 1, 3, 16, 64]),
        "spare": rng.choice([0, 1, 3]),
        "dims": rng.choice([(512, 64), (512, 64), (512, 0), (128, 32), (33, 7)]),
        "dtype": rng.choice([FP32, BF16, FP16, E4M3, E5M2]),
        "cache": rng.choice(["adjacent", "separate"]),
        "rows": rng.choice(["contiguous", "strided"]),
        "index_dtype": rng.choice([torch.int32, torch.int64]),
        "threads": rng.choice([1, 2, 3]),
    }


def mla_append_inputs(case):
    g = generator(case)
    after = [b + a for b, a in zip(case["seq_before"], case["appended"])]
    # FlashInfer's kv_last_page_len of a request without pages is 0
    indptr, indices, last, num_pages = page_table(after, case["page_size"], case["spare"], False, g, empty_last=0)
    append_indptr = indptr_of(case["appended"])
    nnz = int(append_indptr[-1])
    ckv_dim, kpe_dim = case["dims"]
    new_ckv = torch.randn((nnz, ckv_dim), generator=g).to(case["dtype"])
    new_kpe = torch.randn((nnz, kpe_dim), generator=g).to(case["dtype"])
    if case["rows"] == "strided":  # rows of one wider buffer
        wide = torch.randn((nnz, ckv_dim + kpe_dim + 3), generator=g).to(case["dtype"])
        wide[:, :ckv_dim], wide[:, ckv_dim + 3 :] = new_ckv, new_kpe
        new_ckv, new_kpe = wide[:, :ckv_dim], wide[:, ckv_dim + 3 :]
    return {
        "num_pages": num_pages,
        "indptr": indptr,
        "indices": indices,
        "last": last,
        "append_indptr": append_indptr,
        "nnz": nnz,
        "ckv": new_ckv,
        "kpe": new_kpe,
    }


def mla_cache(case, num_pages):
    """(backing, ckv view, kpe view), every element the sentinel."""
    ckv_dim, kpe_dim = case["dims"]
    shape = (num_pages, case["page_size"], ckv_dim + kpe_dim + (0 if case["cache"] == "adjacent" else 5))
    backing = torch.full(shape, SENTINEL, dtype=case["dtype"])
    if case["cache"] == "adjacent":
        return backing, backing[..., :ckv_dim], backing[..., ckv_dim:]
    return backing, backing[..., 2 : 2 + ckv_dim], backing[..., ckv_dim + 5 :]  # two views with gaps


def mla_append_run(case, inputs):
    index = case["index_dtype"]
    seq_lens = kernforge.get_seq_lens(inputs["indptr"], inputs["last"], case["page_size"])
    batch_indices, positions = kernforge.get_batch_indices_positions(inputs["append_indptr"], seq_lens, inputs["nnz"])
    backing, ckv, kpe = mla_cache(case, inputs["num_pages"])
    with threads(case["threads"]):
        kernforge.append_paged_mla_kv_cache(
            inputs["ckv"], inputs["kpe"], batch_indices.to(index), positions.to(index), ckv, kpe,
            inputs["indices"].to(index), inputs["indptr"].to(index), inputs["last"].to(index),
        )  # fmt: skip
    return {"backing": bits(backing)}


def mla_append_reference(case, inputs):
    backing, ckv, kpe = mla_cache(case, inputs["num_pages"])
    i, ps = 0, case["page_size"]
    for b, (before, appended) in enumerate(zip(case["seq_before"], case["appended"])):
        for position in range(before, before + appended):
            page = int(inputs["indices"][int(inputs["indptr"][b]) + position // ps])
            ckv[page, position % ps] = inputs["ckv"][i]
            kpe[page, position % ps] = inputs["kpe"][i]
            i += 1
    return {"backing": bits(backing)}


# --------------------------------------------------------------------------- mla_output_proj


def draw_output_proj(rng: random.Random) -> dict:
    return {
        "seed": rng.getrandbits(31),
        "tokens": size(rng, 40),
        "heads": rng.choice([1, 2, 16]),
        "kv_lora_rank": rng.choice([64, 512, 33]),
        "v_head_dim": rng.choice([40, 128, 17]),
        "dtype": rng.choice([BF16, BF16, FP16, FP32]),
        "weights": rng.choice(["packed", "raw", "fp8"]),  # absorb_kv_b_proj's, a bf16 tensor, e4m3fn with a scale
        "latent": rng.choice(["contiguous", "strided"]),  # the attention output's heads inside a wider buffer
        "out": rng.choice(["fresh", "given"]),
        "threads": rng.choice([1, 2, 3]),
    }


def output_proj_inputs(case):
    g = generator(case)
    T, H, rank, v_dim = case["tokens"], case["heads"], case["kv_lora_rank"], case["v_head_dim"]
    latent = torch.randn((T, H, rank), generator=g).to(case["dtype"])
    w = torch.randn((H, v_dim, rank), generator=g) / math.sqrt(rank)
    scale = None
    if case["weights"] == "fp8":
        w = (w * 64).to(E4M3)
        scale = 1.0 / 64
    else:
        w = w.to(BF16)
    return latent, w, scale


def output_proj_run(case, inputs):
    latent, w, scale = inputs
    T, H, rank = latent.shape
    if case["latent"] == "strided":
        wide = torch.randn((T, H + 2, rank + 4)).to(latent.dtype)
        wide[:, 1 : 1 + H, 2 : 2 + rank] = latent
        latent = wide[:, 1 : 1 + H, 2 : 2 + rank]
    w_vc = w
    if case["weights"] == "packed":
        w_vc = [kernforge.convert_weight_packed(w[h]) for h in range(H)]
    out = None
    if case["out"] == "given":
        out = torch.full((T, H * w.shape[1]), math.nan, dtype=latent.dtype)
    with threads(case["threads"]):
        result = kernforge.mla_output_proj(latent, w_vc, out=out, w_scale=scale)
    if out is not None and result is not out:
        raise FuzzFailure("mla_output_proj(out=...) did not return the given out")
    return {"out": result}


def output_proj_reference(case, inputs):
    latent, w, scale = inputs
    product = torch.einsum("thr,hvr->thv", latent.double(), w.double()) * (1.0 if scale is None else scale)
    return {"out": product.reshape(latent.shape[0], w.shape[0] * w.shape[1])}


def output_proj_tolerance(case):
    # The GEMM's fp32 sums rounded once to the activations' dtype (test_mla_projections.py's tolerances).
    tol = {BF16: 2e-2, FP16: 3e-3, FP32: 2e-5}[case["dtype"]]
    return (tol, tol)


# --------------------------------------------------------------------------- qkv_proj_with_rope

PROJ_TOL = {BF16: 2e-2, FP16: 3e-3, FP32: 2e-5}  # test_mla_projections.py: one rounding per stage
MAX_POSITION = 64


def draw_qkv_proj(rng: random.Random) -> dict:
    return {
        "seed": rng.getrandbits(31),
        "tokens": size(rng, 20),
        "heads": rng.choice([1, 3, 16]),
        "hidden": rng.choice([64, 96, 130]),
        "q_lora": rng.choice([48, 64]),
        "kv_lora": rng.choice([40, 64, 512]),
        "nope": rng.choice([16, 32, 128]),
        "rope": rng.choice([16, 64]),
        "v_head": rng.choice([32, 40]),
        "dtype": rng.choice([BF16, BF16, FP16, FP32]),
        "weights": rng.choice(["packed", "raw"]),  # is_vnni: prepacked, or raw tensors packed per call
        "x_rows": rng.choice(["contiguous", "strided"]),
        "positions": rng.choice([torch.int64, torch.int32]),
        "cache_dtype": rng.choice(["fp32", "fp32", "x"]),  # the cos/sin cache in fp32 or in x's dtype
        "eps": rng.choice([1e-6, 1e-5]),
        "threads": rng.choice([1, 2, 3]),
    }


def qkv_proj_inputs(case):
    g = generator(case)
    H, hidden, q_lora, kv_lora = case["heads"], case["hidden"], case["q_lora"], case["kv_lora"]
    nope, rope, v_head, dtype = case["nope"], case["rope"], case["v_head"], case["dtype"]

    def weight(n, k):
        return (torch.randn(n, k, generator=g) / math.sqrt(k)).bfloat16()

    layer = {
        "q_a": weight(q_lora, hidden),
        "q_b": weight(H * (nope + rope), q_lora),
        "kv_a": weight(kv_lora + rope, hidden),
        "kv_b": weight(H * (nope + v_head), kv_lora),
        "q_norm": (1 + 0.3 * torch.randn(q_lora, generator=g)).to(dtype),
        "kv_norm": (1 + 0.3 * torch.randn(kv_lora, generator=g)).to(dtype),
    }
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rope, 2, dtype=torch.float64) / rope)
    angles = torch.arange(MAX_POSITION, dtype=torch.float64)[:, None] * inv_freq
    cos_sin = torch.cat([angles.cos(), angles.sin()], -1).float()  # DeepSeek's (SGLang's) cache
    layer["cos_sin"] = cos_sin if case["cache_dtype"] == "fp32" else cos_sin.to(dtype)
    x = torch.randn(case["tokens"], hidden, generator=g).to(dtype)
    positions = torch.randint(0, MAX_POSITION, (case["tokens"],), generator=g)
    return layer, x, positions


def rmsnorm64(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def rope_interleaved(x, cos, sin):
    """GPT-J / DeepSeek RoPE: pairs (2i, 2i + 1) turn by the angle of pair i. x [T, ..., rope]."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1] // 2,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], -1).flatten(-2)


def qkv_proj_run(case, inputs):
    layer, x, positions = inputs
    nope, v_head = case["nope"], case["v_head"]
    if case["x_rows"] == "strided":
        wide = torch.randn(x.shape[0], x.shape[1] + 7).to(x.dtype)
        wide[:, 3 : 3 + x.shape[1]] = x
        x = wide[:, 3 : 3 + x.shape[1]]
    if case["weights"] == "packed":
        absorbed = kernforge.absorb_kv_b_proj(layer["kv_b"], nope, v_head)
        weights = [kernforge.convert_weight_packed(layer[name]) for name in ("q_a", "q_b", "kv_a")]
        weights.append(absorbed.w_kc)
        extra = {}
    else:
        w_kc = layer["kv_b"].unflatten(0, (-1, nope + v_head))[:, :nope]  # [H, nope, kv_lora]
        weights = [layer["q_a"], layer["q_b"], layer["kv_a"], w_kc.transpose(1, 2)]
        extra = {"is_vnni": False}
    with threads(case["threads"]):
        q_input, k_input, v_input = kernforge.qkv_proj_with_rope(
            x, *weights, layer["q_norm"], layer["kv_norm"], positions.to(case["positions"]), layer["cos_sin"],
            case["eps"], **extra,
        )  # fmt: skip
    if v_input.numel() and (v_input.data_ptr() != k_input.data_ptr() or v_input.stride() != k_input.stride()):
        raise FuzzFailure("v_input is not a view of k_input's storage")
    return {"q_input": q_input, "k_input": k_input, "v_input": v_input}


def qkv_proj_reference(case, inputs):
    """float64 DeepSeek MLA (absorbed), rounded to the activations' dtype where every implementation rounds
    (each GEMM and norm output): test_mla_projections.py's reference."""
    layer, x, positions = inputs
    T, H, kv_lora = x.shape[0], case["heads"], case["kv_lora"]
    nope, rope, v_head, eps = case["nope"], case["rope"], case["v_head"], case["eps"]

    def stage(t):
        return t.to(case["dtype"]).double()

    w_kc = layer["kv_b"].unflatten(0, (-1, nope + v_head))[:, :nope].double()  # [H, nope, kv_lora]
    x = x.double()
    q_latent = stage(rmsnorm64(stage(x @ layer["q_a"].double().T), layer["q_norm"], eps))
    q = stage(q_latent @ layer["q_b"].double().T).view(T, H, nope + rope)
    q_nope, q_pe = q.split([nope, rope], -1)
    q_absorbed = torch.einsum("thn,hnl->thl", q_nope, w_kc)
    kv = stage(x @ layer["kv_a"].double().T)
    latent, k_pe = kv.split([kv_lora, rope], -1)
    cos, sin = layer["cos_sin"].double()[positions].chunk(2, -1)
    q_input = torch.cat([q_absorbed, rope_interleaved(q_pe, cos, sin)], -1)
    k_input = torch.cat([rmsnorm64(latent, layer["kv_norm"], eps), rope_interleaved(k_pe, cos, sin)], -1)[:, None]
    return {"q_input": q_input, "k_input": k_input, "v_input": k_input[..., :kv_lora]}


def qkv_proj_tolerance(case):
    tol = PROJ_TOL[case["dtype"]]
    return (tol, tol)


TARGETS = [
    target("BatchMLAPagedAttentionWrapper", draw_mla, mla_inputs, mla_run, mla_reference, mla_tolerance),
    target(
        "append_paged_mla_kv_cache",
        draw_mla_append,
        mla_append_inputs,
        mla_append_run,
        mla_append_reference,
        lambda case: (0, 0),
    ),
    target("qkv_proj_with_rope", draw_qkv_proj, qkv_proj_inputs, qkv_proj_run, qkv_proj_reference, qkv_proj_tolerance),
    target(
        "mla_output_proj",
        draw_output_proj,
        output_proj_inputs,
        output_proj_run,
        output_proj_reference,
        output_proj_tolerance,
    ),
]
