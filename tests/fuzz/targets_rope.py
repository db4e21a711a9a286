"""Fuzz targets: every RoPE op (FlashInfer's forms), in place and out of place: by ``pos_ids``, on a
ragged batch (``indptr`` + ``offsets``), plain and Llama 3.1 frequencies, and from a ``cos_sin_cache``.

Cases draw any even ``rotary_dim`` up to any ``head_dim`` (odd ones too; the tail past it must come
back bit for bit), both pair styles, q and k head counts (k may have none), q and k as contiguous
tensors, as slices of one packed qkv row or as heads-major buffers (token stride below the head
stride), int32 and int64 positions up to 2^24 (fp32 angles up to 2^24 radians, the kernel's
stated range), empty requests
in a ragged batch, and strided caches. Every byte of the buffers q and k live in is checked: in
place only q and k change, out of place nothing does.

The reference is FlashInfer's contract: pair ``i`` turns by the fp32 angle ``float(pos) * freq_i``
with ``freq_i`` formed in float64 and rounded to fp32 once (Llama 3.1: Meta's wavelength bands), its
cos/sin and the rotation in float64; the cache forms read cos | sin from row ``pos`` of the cache.
"""

from __future__ import annotations

import math
import random

import torch
from fuzzing import EDGES, FLOAT_DTYPES, TOLERANCES, Target, generator, size, threaded_target

import kernforge

PAD = 3
HEAD_DIMS = [2, 4, 13, 16, 17, 32, 33, 55, 63, 64, 65, 80, 96, 128, 129, 200, 256, 511]
POSITION_RANGES = [1, 17, 4096, 2**16, 2**20, 2**24]
LLAMA31 = [  # (rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len)
    (8.0, 5e5, 1.0, 4.0, 8192),
    (32.0, 5e5, 1.0, 4.0, 8192),
    (4.0, 1e4, 2.0, 8.0, 2048),
    (16.0, 1e6, 1.0, 2.0, 4096),
]


# --------------------------------------------------------------------------- drawing


def draw_common(rng: random.Random, cache: bool) -> dict:
    head_dim = rng.choice(HEAD_DIMS + [rng.randint(2, 300)])
    even_dims = [d for d in EDGES + [head_dim - 1, head_dim, head_dim // 2 + 8] if d % 2 == 0 and 2 <= d <= head_dim]
    rotary_dim = rng.choice(even_dims + [2 * rng.randint(1, head_dim // 2)])
    if not cache and head_dim % 2 == 0 and rng.random() < 0.3:
        rotary_dim = None  # the whole head
    return {
        "seed": rng.getrandbits(31),
        "nnz": size(rng, 70),
        "hq": rng.choice([1, 1, 2, 3, 4, 8]),
        "hk": rng.choice([0, 1, 1, 2, 3]),
        "head_dim": head_dim,
        "rotary_dim": rotary_dim,
        "interleave": rng.random() < 0.5,
        "dtype": rng.choice(FLOAT_DTYPES),
        "layout": rng.choice(["contig", "packed", "packed", "heads_major"]),
        "index_dtype": rng.choice([torch.int32, torch.int64]),
        "high": rng.choice(POSITION_RANGES),
    }


def frequencies_for(rng: random.Random, llama31: bool) -> dict:
    if llama31:
        scale, theta, low, high, old = rng.choice(LLAMA31)
        return {
            "rope_scale": scale,
            "rope_theta": theta,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "old_context_len": old,
        }
    return {"rope_scale": rng.choice([1.0, 1.0, 0.5, 2.5, 8.0]), "rope_theta": rng.choice([1e4, 1e4, 100.0, 5e5, 1e6])}


def with_frequencies(rng: random.Random, llama31: bool) -> dict:
    case = {**draw_common(rng, False), "frequencies": frequencies_for(rng, llama31)}
    # The kernel's sincos holds its accuracy for fp32 angles up to 2^24 (kernforge/rope.h; FlashInfer's
    # __sincosf is far looser there): the largest frequency is 1 / rope_scale (1 in Llama 3.1's
    # unscaled band), so positions stop where the largest angle reaches 2^24.
    largest_frequency = 1.0 if llama31 else 1.0 / case["frequencies"]["rope_scale"]
    case["high"] = max(1, min(case["high"], int(2**24 / max(largest_frequency, 1.0))))
    return case


def draw_pos_ids(llama31: bool):
    def draw(rng: random.Random) -> dict:
        return with_frequencies(rng, llama31)

    return draw


def draw_ragged(llama31: bool):
    def draw(rng: random.Random) -> dict:
        case = with_frequencies(rng, llama31)
        batch = rng.choice([1, 1, 2, 3, 5, 8]) if case["nnz"] else rng.choice([0, 1, 3])
        cuts = sorted(rng.randint(0, case["nnz"]) for _ in range(batch - 1)) if batch else []
        case["indptr"] = [0, *cuts, case["nnz"]] if batch else [0]
        case["offsets"] = [rng.randrange(max(case["high"] - 70, 1)) for _ in range(batch)]
        return case

    return draw


def draw_cache(rng: random.Random) -> dict:
    case = draw_common(rng, True)
    case["high"] = min(case["high"], 5000)  # the cache's rows
    case["cache_layout"] = rng.choice(["contig", "contig", "padded", "strided"])
    case["query_dims"] = rng.choice([2, 3]) if case["layout"] != "heads_major" else 3
    return case


# --------------------------------------------------------------------------- inputs


def views(case: dict, backing):
    """q [nnz, hq, D] and k [nnz, hk, D] as views into ``backing`` (any dtype)."""
    nnz, hq, hk, d = case["nnz"], case["hq"], case["hk"], case["head_dim"]
    if case["layout"] == "packed":
        (qkv,) = backing
        q = qkv[:, : hq * d].view(nnz, hq, d)
        k = qkv[:, hq * d : (hq + hk) * d].view(nnz, hk, d)
        return q, k
    if case["layout"] == "heads_major":
        q_buf, k_buf = backing
        return q_buf[..., :d].transpose(0, 1), k_buf[..., :d].transpose(0, 1)
    return backing


def backing_shapes(case: dict):
    nnz, hq, hk, d = case["nnz"], case["hq"], case["hk"], case["head_dim"]
    if case["layout"] == "packed":
        return [(nnz, (hq + 2 * hk) * d + PAD)]
    if case["layout"] == "heads_major":
        return [(hq, nnz, d + PAD), (hk, nnz, d + PAD)]
    return [(nnz, hq, d), (nnz, hk, d)]


def rotated_dim(case: dict) -> int:
    return case["rotary_dim"] or case["head_dim"]


def inputs(case: dict):
    g = generator(case)
    backing = [torch.randn(shape, generator=g).to(case["dtype"]) for shape in backing_shapes(case)]
    positions = torch.randint(0, case["high"], (case["nnz"],), generator=g, dtype=torch.int64)
    extra = {}
    if "indptr" in case:
        extra["indptr"] = torch.tensor(case["indptr"], dtype=case["index_dtype"])
        extra["offsets"] = torch.tensor(case["offsets"], dtype=case["index_dtype"])
        segments = zip(case["indptr"], case["indptr"][1:], case["offsets"])
        positions = torch.cat([torch.zeros(0, dtype=torch.int64)] + [torch.arange(b - a) + o for a, b, o in segments])
    if "cache_layout" in case:
        rot = case["rotary_dim"]
        values = torch.rand(case["high"], rot, generator=g, dtype=torch.float64) * 2 - 1
        if case["cache_layout"] == "padded":  # rows a slice of wider ones
            wide = torch.full((case["high"], rot + 7), float("nan"))
            wide[:, :rot] = values
            extra["cache"] = wide[:, :rot]
        elif case["cache_layout"] == "strided":  # a strided last dim: the op copies it
            wide = torch.full((case["high"], 2 * rot), float("nan"))
            wide[:, ::2] = values
            extra["cache"] = wide[:, ::2]
        else:
            extra["cache"] = values.float()
    return backing, positions, extra


# --------------------------------------------------------------------------- reference


def reference_frequencies(rotary_dim: int, frequencies: dict) -> torch.Tensor:
    """fp32 [rotary_dim / 2], formed in float64 (Llama 3.1: Meta's piecewise wavelength rule)."""
    theta, scale = frequencies["rope_theta"], frequencies["rope_scale"]
    base = theta ** (-2 * torch.arange(rotary_dim // 2, dtype=torch.float64) / rotary_dim)
    if "low_freq_factor" not in frequencies:
        return (base / scale).float()
    low, high = frequencies["low_freq_factor"], frequencies["high_freq_factor"]
    old = frequencies["old_context_len"]
    wavelength = 2 * math.pi / base
    smooth = (old / wavelength - low) / (high - low)
    blended = (1 - smooth) * base / scale + smooth * base
    freq = torch.where(wavelength < old / high, base, torch.where(wavelength > old / low, base / scale, blended))
    return freq.float()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, interleave: bool):
    """x [nnz, heads, D] in float64, its first rotary_dim elements of each head turned."""
    x = x.double()
    c, s = cos[:, None, :], sin[:, None, :]
    if interleave:
        x1, x2 = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
        turned = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        half = rotary_dim // 2
        x1, x2 = x[..., :half], x[..., half:rotary_dim]
        turned = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((turned, x[..., rotary_dim:]), dim=-1)


def cos_sin(case: dict, positions: torch.Tensor, extra: dict):
    rot = rotated_dim(case)
    if "cache" in extra:
        rows = extra["cache"].double()[positions]
        return rows[:, : rot // 2], rows[:, rot // 2 : rot]
    angle = positions.to(torch.float32)[:, None] * reference_frequencies(rot, case["frequencies"])[None, :]
    return angle.double().cos(), angle.double().sin()


def expected_outputs(case: dict, tensors, in_place: bool) -> dict:
    backing, positions, extra = tensors
    q, k = views(case, backing)
    cos, sin = cos_sin(case, positions, extra)
    rot, interleave = rotated_dim(case), case["interleave"]
    q_rot, k_rot = rotate(q, cos, sin, rot, interleave), rotate(k, cos, sin, rot, interleave)
    after = [b.double() for b in backing]
    if in_place:
        q_view, k_view = views(case, after)
        q_view.copy_(q_rot)
        k_view.copy_(k_rot)
    outputs = {f"backing{i}": b for i, b in enumerate(after)}
    if not in_place:
        outputs.update(q=q_rot, k=k_rot)
    outputs.update(q_tail=q.double()[..., rot:], k_tail=k.double()[..., rot:])
    return outputs


def tolerance(case: dict) -> dict:
    close = TOLERANCES[case["dtype"]]
    names = [f"backing{i}" for i in range(len(backing_shapes(case)))] + ["q", "k"]
    return {**dict.fromkeys(names, close), "q_tail": (0.0, 0.0), "k_tail": (0.0, 0.0)}


# --------------------------------------------------------------------------- targets


def collected(case: dict, backing, result, in_place: bool) -> dict:
    """The outputs: every backing buffer after the call, the results out of place, the tails."""
    rot = rotated_dim(case)
    if in_place:
        assert result is None, f"an in-place op returned {type(result).__name__}"
        q_out, k_out = views(case, backing)
        outputs = {}
    else:
        assert isinstance(result, tuple) and len(result) == 2, f"returned {type(result).__name__}"
        q_out, k_out = result
        outputs = {"q": q_out, "k": k_out}
    outputs.update({f"backing{i}": b for i, b in enumerate(backing)})
    outputs.update(q_tail=q_out[..., rot:], k_tail=k_out[..., rot:])
    return outputs


def by_position(name: str, ragged: bool, llama31: bool, in_place: bool) -> Target:
    op = getattr(kernforge, name)

    def run(case, tensors):
        backing, positions, extra = tensors
        backing = [b.clone() for b in backing]
        q, k = views(case, backing)
        if ragged:
            where = (extra["indptr"], extra["offsets"])
        else:
            where = (positions.to(case["index_dtype"]),)
        result = op(q, k, *where, rotary_dim=case["rotary_dim"], interleave=case["interleave"], **case["frequencies"])
        return collected(case, backing, result, in_place)

    def reference(case, tensors):
        return expected_outputs(case, tensors, in_place)

    draw = draw_ragged(llama31) if ragged else draw_pos_ids(llama31)
    return threaded_target(name, draw, inputs, run, reference, tolerance)


def with_cache(in_place: bool) -> Target:
    op = kernforge.apply_rope_with_cos_sin_cache_inplace if in_place else kernforge.apply_rope_with_cos_sin_cache

    def run(case, tensors):
        backing, positions, extra = tensors
        backing = [b.clone() for b in backing]
        q, k = views(case, backing)
        nnz, d = case["nnz"], case["head_dim"]
        if case["query_dims"] == 2:
            query, key = q.flatten(1), k.flatten(1)  # views: contiguous heads (contig or packed)
        else:
            query, key = q, k
        positions = positions.to(case["index_dtype"])
        result = op(positions, query, key, d, extra["cache"], is_neox=not case["interleave"])
        if result is not None:
            assert result[0].shape == query.shape and result[1].shape == key.shape, "out-of-place shapes"
            result = (result[0].view(nnz, case["hq"], d), result[1].view(nnz, case["hk"], d))
        return collected(case, backing, result, in_place)

    def reference(case, tensors):
        return expected_outputs(case, tensors, in_place)

    return threaded_target(op.__name__, draw_cache, inputs, run, reference, tolerance)


TARGETS = [
    by_position("apply_rope_pos_ids", False, False, False),
    by_position("apply_rope_pos_ids_inplace", False, False, True),
    by_position("apply_llama31_rope_pos_ids", False, True, False),
    by_position("apply_llama31_rope_pos_ids_inplace", False, True, True),
    by_position("apply_rope", True, False, False),
    by_position("apply_rope_inplace", True, False, True),
    by_position("apply_llama31_rope", True, True, False),
    by_position("apply_llama31_rope_inplace", True, True, True),
    with_cache(False),
    with_cache(True),
]
