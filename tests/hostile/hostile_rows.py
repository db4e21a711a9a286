"""The table's cases for the row-wise families: activation, norm, rope, sampling."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hostile_checks import arg, in_place_out, matches, nan_rows, result
from hostile_harness import CaseList, Runs, Setup, i32, i64, on_meta, overlapping, randn, same_bits, with_value

import kernforge

BF16, F32 = torch.bfloat16, torch.float32
NAN, INF = float("nan"), float("inf")


# --------------------------------------------------------------------------- activation

ACTIVATIONS = {
    "silu_and_mul": lambda x: F.silu(x[..., : x.shape[-1] // 2]) * x[..., x.shape[-1] // 2 :],
    "gelu_and_mul": lambda x: F.gelu(x[..., : x.shape[-1] // 2]) * x[..., x.shape[-1] // 2 :],
    "gelu_tanh_and_mul": lambda x: F.gelu(x[..., : x.shape[-1] // 2], approximate="tanh") * x[..., x.shape[-1] // 2 :],
}


def activation_cases(name: str) -> CaseList:
    op = getattr(kernforge, name)
    c = CaseList(name, lambda: Setup(op, input=randn(3, 2 * 40, dtype=BF16), out=torch.empty(3, 40, dtype=BF16)))
    c.dtype("input", torch.int32).dtype("input", torch.float64).dtype("out", F32)
    c.meta("input").meta("out")
    c.refuse("shape", "input last dim odd", lambda a: {"input": randn(3, 79, dtype=BF16)}, "input")
    c.refuse("shape", "input 0-dim", lambda a: {"input": torch.tensor(1.0, dtype=BF16)}, "input")
    c.refuse("shape", "out [3, 41]", lambda a: {"out": torch.empty(3, 41, dtype=BF16)}, "out")
    c.refuse(
        "shape", "out rows expanded (overlap)", lambda a: {"out": torch.empty(1, 40, dtype=BF16).expand(3, 40)}, "out"
    )
    c.refuse("alias", "out is input[:, 1:41] (overlaps it)", lambda a: {"out": a["input"][:, 1:41]}, "out")
    c.refuse("alias", "out overlaps input's last rows", lambda a: overlapping(a, "input", "out", (3, 40), 120), "out")
    c.add(
        "nan",
        "NaN in row 1's gate",
        lambda a: {"input": with_value(a["input"], (1, 5), NAN)},
        nan_rows(result(), [1], "row 1 NaN, others unchanged"),
    )
    c.add(
        "nan",
        "+Inf in the gate",
        lambda a: {"input": with_value(a["input"], (2, 0), INF)},
        matches(result(), lambda a: ACTIVATIONS[name](a["input"].float()), "as torch (inf * up, NaN for inf * 0)"),
    )
    c.guard("input").guard("input", "out")
    c.guard("input", setup=lambda: Setup(op, input=randn(5, 2 * 33, dtype=F32)))
    return c


# --------------------------------------------------------------------------- norm


def _ref_rmsnorm(x, w, eps=1e-6, gemma=False):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * ((1 + w.float()) if gemma else w.float())


def norm_cases(name: str) -> CaseList:
    op = getattr(kernforge, name)
    gemma = name.startswith("gemma")
    c = CaseList(
        name,
        lambda: Setup(
            op, input=randn(4, 48, dtype=BF16), weight=randn(48, dtype=BF16, seed=1), out=torch.empty(4, 48, dtype=BF16)
        ),
    )
    c.dtype("input", torch.int32).dtype("weight", F32).dtype("out", F32)
    c.meta("input").meta("weight").meta("out")
    c.refuse("shape", "input 1-D", lambda a: {"input": randn(48, dtype=BF16)}, "input")
    c.refuse("shape", "input 4-D", lambda a: {"input": randn(1, 2, 2, 48, dtype=BF16), "out": None}, "input")
    c.refuse("shape", "weight [47]", lambda a: {"weight": a["weight"][:47]}, "weight")
    c.refuse("shape", "out [4, 47]", lambda a: {"out": torch.empty(4, 47, dtype=BF16)}, "out")
    c.refuse(
        "shape", "out rows expanded (overlap)", lambda a: {"out": torch.empty(1, 48, dtype=BF16).expand(4, 48)}, "out"
    )
    in_place_out(c, "input", (4, 48))
    c.refuse("alias", "out overlaps weight", lambda a: {"weight": a["out"][0]}, "out")
    c.add(
        "nan",
        "NaN in row 2",
        lambda a: {"input": with_value(a["input"], (2, 7), NAN)},
        nan_rows(result(), [2], "row 2 all NaN, others unchanged", whole_row=True),
    )
    c.add(
        "nan",
        "+Inf in row 1",
        lambda a: {"input": with_value(a["input"], (1, 3), INF)},
        matches(result(), lambda a: _ref_rmsnorm(a["input"], a["weight"], gemma=gemma), "as torch: 0, NaN where inf"),
    )
    c.add(
        "nan",
        "NaN in weight",
        lambda a: {"weight": with_value(a["weight"], 5, NAN)},
        matches(result(), lambda a: _ref_rmsnorm(a["input"], a["weight"], gemma=gemma), "column 5 NaN"),
    )
    c.guard("input", "weight", "out")
    c.guard("input", "weight", setup=lambda: Setup(op, input=randn(3, 2, 37, dtype=F32), weight=randn(37, seed=1)))
    return c


def fused_norm_cases(name: str) -> CaseList:
    op = getattr(kernforge, name)
    c = CaseList(
        name,
        lambda: Setup(
            op,
            input=randn(4, 48, dtype=BF16),
            residual=randn(4, 48, dtype=BF16, seed=2),
            weight=randn(48, dtype=BF16, seed=1),
        ),
    )
    c.dtype("input", torch.float64).dtype("residual", F32).dtype("weight", torch.float16)
    c.meta("input").meta("residual").meta("weight")
    c.refuse(
        "shape", "input 1-D", lambda a: {"input": randn(48, dtype=BF16), "residual": randn(48, dtype=BF16)}, "input"
    )
    c.refuse("shape", "residual [4, 47]", lambda a: {"residual": randn(4, 47, dtype=BF16)}, "residual")
    c.refuse("shape", "weight [49]", lambda a: {"weight": randn(49, dtype=BF16)}, "weight")
    c.refuse(
        "shape",
        "input rows expanded (overlap)",
        lambda a: {"input": randn(1, 48, dtype=BF16).expand(4, 48), "residual": a["residual"]},
        "input",
    )
    c.refuse("alias", "residual is input", lambda a: {"residual": a["input"]}, "residual")
    c.refuse("alias", "weight is a row of input", lambda a: {"weight": a["input"][1]}, "input")
    c.add(
        "nan",
        "NaN in input row 0",
        lambda a: {"input": with_value(a["input"], (0, 9), NAN)},
        nan_rows(arg("input"), [0], "row 0 all NaN, others unchanged", whole_row=True, others=()),
    )
    c.add(
        "nan",
        "NaN in residual row 3",
        lambda a: {"residual": with_value(a["residual"], (3, 1), NAN)},
        nan_rows(arg("residual"), [3], "residual row 3 NaN, others unchanged"),
    )
    c.guard("input", "residual", "weight")
    c.guard(
        "input",
        "residual",
        "weight",
        setup=lambda: Setup(op, input=randn(3, 37), residual=randn(3, 37, seed=2), weight=randn(37, seed=1)),
    )
    return c


# --------------------------------------------------------------------------- rope


def _qk(nnz=4, dtype=BF16, head_dim=64):
    return randn(nnz, 4, head_dim, dtype=dtype), randn(nnz, 2, head_dim, dtype=dtype, seed=1)


def _rotated(in_place: bool, q: str = "q", k: str = "k"):
    """Where a rope op leaves the rotated q and k: the in-place forms in their arguments, the others in
    the (q, k) they return."""
    return (arg(q), arg(k)) if in_place else (result(0), result(1))


def pos_ids_cases(name: str) -> CaseList:
    op = getattr(kernforge, name)
    in_place = name.endswith("inplace")

    def setup():
        q, k = _qk()
        return Setup(op, q=q, k=k, pos_ids=i32(0, 5, 9, 70000))

    c = CaseList(name, setup)
    c.dtype("q", torch.float64).dtype("k", F32).dtype("pos_ids", torch.float32)
    c.meta("q").meta("k").meta("pos_ids")
    c.refuse("shape", "q 2-D", lambda a: {"q": a["q"].flatten(1)}, "q")
    c.refuse("shape", "k has 3 tokens", lambda a: {"k": a["k"][:3]}, "k")
    c.refuse("shape", "pos_ids has 3 entries", lambda a: {"pos_ids": a["pos_ids"][:3]}, "pos_ids")
    c.refuse("shape", "pos_ids 2-D", lambda a: {"pos_ids": a["pos_ids"][None]}, "pos_ids")
    c.refuse("shape", "rotary_dim odd", lambda a: {"rotary_dim": 33}, "rotary_dim")
    c.refuse("shape", "rotary_dim > head_dim", lambda a: {"rotary_dim": 66}, "rotary_dim")
    c.refuse("shape", "q head_dim strided", lambda a: {"q": randn(4, 4, 128, dtype=BF16)[..., ::2]}, "q")
    c.add(
        "index",
        "negative position (an angle, as FlashInfer)",
        lambda a: {"pos_ids": i32(0, -5, 9, 1)},
        Runs(lambda *_: None, "runs: any position is an angle"),
    )
    if in_place:
        c.refuse("alias", "k is q", lambda a: {"k": a["q"]}, "k")
        c.refuse(
            "alias", "q heads expanded (overlap)", lambda a: {"q": randn(4, 1, 64, dtype=BF16).expand(4, 4, 64)}, "q"
        )
    get_q, get_k = _rotated(in_place)
    c.add(
        "nan",
        "NaN in q token 1",
        lambda a: {"q": with_value(a["q"], (1, 0, 3), NAN)},
        nan_rows(get_q, [1], "token 1's q NaN, the rest unchanged", others=(get_k,)),
    )
    c.guard("q", "k", "pos_ids")
    c.guard(
        "q", "k", "pos_ids", setup=lambda: Setup(op, q=randn(3, 3, 34), k=randn(3, 1, 34, seed=1), pos_ids=i64(3, 1, 2))
    )
    return c


def ragged_cases(name: str) -> CaseList:
    op = getattr(kernforge, name)
    in_place = name.endswith("inplace")

    def setup():
        q, k = _qk(5)
        return Setup(op, q=q, k=k, indptr=i32(0, 2, 5), offsets=i32(0, 10))

    c = CaseList(name, setup)
    c.dtype("q", torch.int32).dtype("k", torch.float16).dtype("indptr", torch.float32).dtype("offsets", torch.float64)
    c.refuse("dtype", "indptr int64, offsets int32", lambda a: {"indptr": a["indptr"].long()}, "indptr", TypeError)
    c.meta("q").meta("k").meta("indptr").meta("offsets")
    c.refuse("shape", "indptr one entry short", lambda a: {"indptr": i32(0, 5)}, "indptr")
    c.refuse("shape", "offsets 2-D", lambda a: {"offsets": a["offsets"][None]}, "offsets")
    c.refuse("shape", "k has 4 tokens", lambda a: {"k": a["k"][:4]}, "k")
    c.refuse("indptr", "indptr not starting at 0", lambda a: {"indptr": i32(1, 2, 5)}, "indptr")
    c.refuse("indptr", "indptr decreasing", lambda a: {"indptr": i32(0, 4, 3)}, "indptr")
    c.refuse("indptr", "indptr past nnz", lambda a: {"indptr": i32(0, 2, 6)}, "indptr")
    c.refuse("indptr", "indptr short of nnz", lambda a: {"indptr": i32(0, 2, 4)}, "indptr")
    c.refuse("indptr", "indptr negative", lambda a: {"indptr": i32(0, -2, 5)}, "indptr")
    if in_place:
        c.refuse("alias", "k is q", lambda a: {"k": a["q"]}, "k")
    get_q, get_k = _rotated(in_place)
    c.add(
        "nan",
        "NaN in k token 4",
        lambda a: {"k": with_value(a["k"], (4, 1, 0), NAN)},
        nan_rows(get_k, [4], "token 4's k NaN, the rest unchanged", others=(get_q,)),
    )
    c.guard("q", "k", "indptr", "offsets")
    return c


def _cache(rows=16, rotary_dim=64):
    angle = torch.arange(rows, dtype=torch.float64)[:, None] * (
        1e4 ** (-torch.arange(rotary_dim // 2) / (rotary_dim // 2))
    )
    return torch.cat((angle.cos(), angle.sin()), -1).float()


def cos_sin_cases(name: str) -> CaseList:
    op = getattr(kernforge, name)
    in_place = name.endswith("inplace")

    def setup():
        return Setup(
            op,
            positions=i64(0, 3, 15),
            query=randn(3, 4 * 64, dtype=BF16),
            key=randn(3, 2 * 64, dtype=BF16, seed=1),
            head_size=64,
            cos_sin_cache=_cache(),
        )

    c = CaseList(name, setup)
    c.dtype("query", torch.int32).dtype("key", F32).dtype("positions", F32)
    c.dtype("cos_sin_cache", BF16, ValueError)  # FlashInfer: ValueError "cos_sin_cache should be float32"
    c.meta("query").meta("key").meta("positions").meta("cos_sin_cache")
    c.refuse("shape", "positions has 2 entries", lambda a: {"positions": a["positions"][:2]}, "positions")
    c.refuse("shape", "key has 2 tokens", lambda a: {"key": a["key"][:2]}, "key")
    c.refuse("shape", "head_size 0", lambda a: {"head_size": 0}, "head_size")
    c.refuse(
        "shape", "query not a multiple of head_size", lambda a: {"query": randn(3, 4 * 64 + 1, dtype=BF16)}, "query"
    )
    c.refuse("shape", "cos_sin_cache 1-D", lambda a: {"cos_sin_cache": a["cos_sin_cache"].flatten()}, "cos_sin_cache")
    c.refuse("shape", "rotary_dim > head_size", lambda a: {"cos_sin_cache": _cache(16, 66)}, "cos_sin_cache")
    c.refuse("index", "position = cache rows", lambda a: {"positions": i64(0, 16, 1)}, "positions")
    c.refuse("index", "position -1", lambda a: {"positions": i64(0, 1, -1)}, "positions")
    c.refuse("index", "position 2**40", lambda a: {"positions": i64(0, 2**40, 1)}, "positions")
    if in_place:
        c.refuse("alias", "key is query's first heads", lambda a: {"key": a["query"][:, :128]}, "key")
    get_q, get_k = _rotated(in_place, "query", "key")
    c.add(
        "nan",
        "NaN in cos_sin_cache row 3",
        lambda a: {"cos_sin_cache": with_value(a["cos_sin_cache"], (3, 0), NAN)},
        nan_rows(get_q, [1], "token 1 (position 3) NaN only", others=()),
    )
    c.add(
        "nan",
        "NaN in an unread cache row",
        lambda a: {"cos_sin_cache": with_value(a["cos_sin_cache"], 7, NAN)},
        nan_rows(get_q, [], "unread rows are not read", others=(get_k,)),
    )
    c.guard("positions", "query", "key", "cos_sin_cache")
    return c


# --------------------------------------------------------------------------- sampling


def _probs(rows=4, vocab=37, seed=0):
    return torch.softmax(randn(rows, vocab, seed=seed), -1)


SAMPLERS = {  # name -> (input argument, the extra parameters)
    "sampling_from_probs": ("probs", {}),
    "sampling_from_logits": ("logits", {}),
    "top_p_sampling_from_probs": ("probs", {"top_p": 0.9}),
    "top_k_sampling_from_probs": ("probs", {"top_k": 5}),
    "min_p_sampling_from_probs": ("probs", {"min_p": 0.1}),
    "top_k_top_p_sampling_from_probs": ("probs", {"top_k": 5, "top_p": 0.9}),
    "top_k_top_p_sampling_from_logits": ("logits", {"top_k": 5, "top_p": 0.9}),
}


def sampler_cases(name: str) -> CaseList:
    op = getattr(kernforge, name)
    x_name, params = SAMPLERS[name]
    logits = x_name == "logits"

    def setup():
        x = randn(4, 37, seed=3) if logits else _probs()
        return Setup(op, **{x_name: x}, **params, seed=7, offset=0, return_valid=True)

    c = CaseList(name, setup)
    c.dtype(x_name, torch.int32).dtype(x_name, torch.float64)
    if not logits:
        c.dtype(x_name, BF16)  # probabilities are fp32, as in FlashInfer
    c.meta(x_name)
    c.refuse("shape", f"{x_name} 1-D", lambda a: {x_name: a[x_name][0]}, x_name)
    c.refuse("shape", f"{x_name} vocab 0", lambda a: {x_name: a[x_name][:, :0]}, x_name)
    c.refuse("dtype", "indices float", lambda a: {"indices": torch.zeros(2)}, "indices", TypeError)
    c.refuse("index", "indices -1", lambda a: {"indices": i32(0, -1)}, "indices")
    c.refuse("index", "indices = rows", lambda a: {"indices": i64(0, 4)}, "indices")
    c.refuse("device", "indices on meta", lambda a: {"indices": on_meta(i32(0, 1))}, "indices")
    for p, bad in (("top_k", 0), ("top_p", -0.5), ("min_p", 1.5)):
        if p in params:
            c.refuse("index", f"{p} = {bad}", lambda a, p=p, bad=bad: {p: bad}, p)
            c.refuse("shape", f"{p} tensor of 3 rows", lambda a, p=p: {p: torch.full((3,), params[p])}, p)
            c.refuse("device", f"{p} on meta", lambda a, p=p: {p: on_meta(torch.full((4,), params[p]))}, p)
            c.refuse("nan", f"{p} NaN", lambda a, p=p: {p: torch.tensor([params[p]] * 3 + [NAN])}, p)
    c.refuse("shape", "seed tensor of 3", lambda a: {"seed": i64(1, 2, 3)}, "seed")
    c.refuse(
        "nan", "NaN with check_nan", lambda a: {x_name: with_value(a[x_name], (1, 2), NAN), "check_nan": True}, x_name
    )
    c.add("nan", f"NaN in {x_name} row 1", lambda a: {x_name: with_value(a[x_name], (1, 2), NAN)}, _invalid_rows([1]))
    c.guard(x_name)
    c.guard(
        x_name,
        setup=lambda: Setup(
            op, **{x_name: randn(3, 1000, seed=4) if logits else _probs(3, 1000)}, **params, seed=1, offset=2
        ),
    )
    return c


def _invalid_rows(rows):
    """FlashInfer: a row holding NaN gives token 0 and valid False; the other rows are unaffected."""

    def check(res, args, plain):
        samples, valid = res
        plain_samples, plain_valid = plain[0]
        for r in range(samples.shape[0]):
            if r in rows:
                assert not valid[r] and samples[r] == 0, f"row {r}: NaN row gave {samples[r]}, valid {valid[r]}"
            else:
                assert valid[r] and samples[r] == plain_samples[r], f"row {r} changed"

    return Runs(check, "token 0 and valid False for that row")


def row_out_cases(name: str) -> CaseList:
    """softmax, the renorm ops, top_k_mask_logits: one output row per input row, out= allowed."""
    op = getattr(kernforge, name)
    x_name = "logits" if name in ("softmax", "top_k_mask_logits") else "probs"
    param = {"softmax": ("temperature", 0.7), "top_k_mask_logits": ("top_k", 3)}.get(
        name, ("top_k", 3) if "top_k" in name else ("top_p", 0.8)
    )
    out_dtype = F32 if name == "softmax" else None

    def setup():
        x = randn(4, 37, seed=3) if x_name == "logits" else _probs()
        return Setup(op, **{x_name: x, param[0]: param[1]}, out=torch.empty(4, 37))

    c = CaseList(name, setup)
    c.dtype(x_name, torch.int64).dtype("out", torch.float64)
    c.meta(x_name).meta("out")
    c.refuse("shape", f"{x_name} 3-D", lambda a: {x_name: a[x_name][None]}, x_name)
    c.refuse("shape", "out [4, 36]", lambda a: {"out": torch.empty(4, 36)}, "out")
    c.refuse("shape", "out rows expanded (overlap)", lambda a: {"out": torch.empty(1, 37).expand(4, 37)}, "out")
    c.refuse("shape", f"{param[0]} tensor of 5 rows", lambda a: {param[0]: torch.full((5,), float(param[1]))}, param[0])
    c.refuse(
        "device", f"{param[0]} on meta", lambda a: {param[0]: on_meta(torch.full((4,), float(param[1])))}, param[0]
    )
    if out_dtype is None:
        c.dtype("out", BF16)
    bad = {"temperature": 0.0, "top_k": 0, "top_p": -1.0}[param[0]]
    c.refuse("index", f"{param[0]} = {bad}", lambda a: {param[0]: bad}, param[0])
    c.refuse("nan", f"{param[0]} NaN", lambda a: {param[0]: torch.tensor([param[1]] * 3 + [NAN])}, param[0])
    in_place_out(c, x_name, (4, 37))
    if name == "top_k_mask_logits":  # FlashInfer keeps x >= the k-th largest: false for NaN
        c.add(
            "nan", "NaN in logits row 2", lambda a: {"logits": with_value(a["logits"], (2, 4), NAN)}, _nan_masked(2, 4)
        )
    else:
        c.add(
            "nan",
            f"NaN in {x_name} row 2",
            lambda a: {x_name: with_value(a[x_name], (2, 4), NAN)},
            nan_rows(result(), [2], "row 2 NaN, others unchanged"),
        )
    c.guard(x_name, "out")
    return c


def _nan_masked(row, column):
    def check(res, args, plain):
        assert res[row, column] == -INF and not torch.isnan(res).any(), res[row]
        assert all(same_bits(res[r], plain[0][r]) for r in range(res.shape[0]) if r != row)

    return Runs(check, "the NaN masked to -inf (x >= k-th is false), other rows unchanged")


def cases() -> list[CaseList]:
    found = [activation_cases(n) for n in ACTIVATIONS]
    found += [norm_cases(n) for n in ("rmsnorm", "gemma_rmsnorm")]
    found += [fused_norm_cases(n) for n in ("fused_add_rmsnorm", "gemma_fused_add_rmsnorm")]
    found += [
        pos_ids_cases(n)
        for n in (
            "apply_rope_pos_ids",
            "apply_rope_pos_ids_inplace",
            "apply_llama31_rope_pos_ids",
            "apply_llama31_rope_pos_ids_inplace",
        )
    ]
    found += [
        ragged_cases(n)
        for n in ("apply_rope", "apply_rope_inplace", "apply_llama31_rope", "apply_llama31_rope_inplace")
    ]
    found += [cos_sin_cases(n) for n in ("apply_rope_with_cos_sin_cache", "apply_rope_with_cos_sin_cache_inplace")]
    found += [sampler_cases(n) for n in SAMPLERS]
    found += [
        row_out_cases(n)
        for n in (
            "softmax",
            "top_k_mask_logits",
            "top_k_renorm_probs",
            "top_k_renorm_prob",
            "top_p_renorm_probs",
            "top_p_renorm_prob",
        )
    ]
    return found
