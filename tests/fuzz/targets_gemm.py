"""Fuzz targets: the GEMMs. bf16 prepacked (``convert_weight_packed`` + ``weight_packed_linear``, the
dispatched tile or any candidate the tuner may pick on the tier), int8 w8a8 (``per_token_quant_int8``,
``int8_scaled_mm``, ``int8_scaled_mm_with_quant``), fp8 block-scaled (``fp8_scaled_mm`` on both kernel
paths), four-bit (``int4_w4a16_linear``, ``int4_scaled_mm_cpu`` from every checkpoint packing, and
``quantize_int4``), GGUF (``gguf_linear`` over one or several parts, ``pack_gguf``, ``dequantize_rows``,
``embedding_rows``), ``bmm`` and ``bmm_fp8``.

Shapes sit around the tiles: M (rows, from 1- to 3-D ``x``) 0, 1, primes, both sides of the row
blocks; N both sides of the 16/32/64-column tiles and panels; K odd, both sides of the 4-element
groups and the 256/512 K blocks. ``x`` is read through padded rows or a strided last dim, ``out=``
written into padded rows whose padding must stay NaN.

References are float64 on the operands the kernel multiplies: the bf16/fp8 weights as they are,
the quantized weights dequantized (``scale * code + offset``, GGUF's values from llama.cpp's own
``gguf.quants.dequantize``), the activations of the quantizing ops quantized by the ops' documented
fp32 formulas (bit-exact, so the references share their integers). Tolerances are the hand-written
tests': bf16 GEMM ``(rtol, atol * sqrt(K))`` per output dtype; the quantized GEMMs ``rtol`` per output
dtype with an atol of ``rtol * max |reference|`` (fp8 adds fp32 accumulation's ``K * 2^-24``).
"""

from __future__ import annotations

import math
import random

import gguf as gguf_py
import torch
from fuzzing import FLOAT_DTYPES, Target, generator, size, threaded_target
from gguf import quants as gguf_quants

import kernforge
from kernforge.jit import isa
from kernforge.ops.gemm import bf16 as bf16_gemm
from kernforge.ops.gemm import fp8 as fp8_gemm
from kernforge.ops.gemm import gguf as gguf_gemm
from kernforge.ops.gemm import int4 as int4_gemm

# (rtol, atol per sqrt(K)) by output dtype: tests/gemm/test_gemm.py
BF16_GEMM = {torch.bfloat16: (1e-2, 1e-3), torch.float16: (1e-3, 1e-3), torch.float32: (1e-5, 1e-5)}
# rtol by output dtype, atol = rtol * max |reference|: tests/gemm/test_gemm_int8.py, test_gemm_fp8.py, test_bmm.py
SCALED = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-5}
# relative to max |reference|: tests/gemm/test_gemm_int4.py and test_gemm_gguf.py
QUANTIZED = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-5}
# K around the 4-element groups, odd, and both sides of the 256 / 512 K blocks
K_EDGES = [1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 33, 63, 64, 65, 127, 129, 255, 256, 257, 511, 512, 513, 1021]


def draw_m(rng: random.Random) -> list[int]:
    """Leading dims of x: [M] mostly, [a, b] sometimes; rarely past a 64/128-row block."""
    if rng.random() < 0.1:
        return [rng.choice([63, 64, 65, 96, 127, 128, 129, 130, 257])]
    if rng.random() < 0.2:
        return [size(rng, 7), size(rng, 9)]
    return [size(rng, 40)]


def draw_n(rng: random.Random, high: int = 300, zero: bool = False) -> int:
    return size(rng, high, zero=zero)


def draw_k(rng: random.Random, high: int = 1100, zero: bool = False) -> int:
    if rng.random() < 0.5:
        return rng.choice([k for k in K_EDGES if k <= high and (zero or k > 0)])
    return size(rng, high, zero=zero)


def rows_of(lead: list[int]) -> int:
    return math.prod(lead)


def activations(case: dict, k: int, dtype: torch.dtype, scale: float = 1.0, zeros: int = 0) -> torch.Tensor:
    """x [*lead, K] in ``case["layout"]``: contiguous, rows padded (NaN in the padding), or a
    strided last dim (the ops copy it); the first ``zeros`` elements of its first row 0."""
    x = (torch.randn(*case["lead"], k, generator=generator(case)) * scale).to(dtype)
    if x.numel():
        x.view(-1, k)[0, :zeros] = 0
    if case["layout"] == "padded":
        backing = torch.full((*case["lead"], k + 3), float("nan"), dtype=dtype)
        backing[..., :k] = x
        return backing[..., :k]
    if case["layout"] == "strided":
        backing = torch.full((*case["lead"], 2 * k), float("nan"), dtype=dtype)
        backing[..., ::2] = x
        return backing[..., ::2]
    return x


def out_buffer(case: dict, n: int, dtype: torch.dtype):
    """(out view, backing) for out=: NaN everywhere, the view's rows padded when asked."""
    pad = 4 if case["out"] == "padded" else 0
    backing = torch.full((*case["lead"], n + pad), float("nan"), dtype=dtype)
    return backing[..., :n], backing


def relative_tolerance(case: dict, rtol: float, extra: float = 0.0) -> tuple[float, float]:
    """(atol, rtol) with atol = (rtol + extra) * max |reference| (the reference stored it in the case)."""
    return ((rtol + extra) * case["_ref_max"] + 1e-6, rtol)


def with_bias(ref: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The float64 reference plus ``bias`` (added last, as every GEMM here adds it); ``ref`` without one."""
    return ref if bias is None else ref + bias.double()


def with_ref_max(case: dict, out: torch.Tensor) -> torch.Tensor:
    """Keeps max |reference| in the case for the tolerance (computed once the reference exists)."""
    case["_ref_max"] = out.abs().max().item() if out.numel() else 0.0
    return out


def per_token_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sgl-kernel's per-token int8 quantization, in its fp32 arithmetic (bit-exact): ``q = rint(x *
    (127 / amax)) + 128`` with ``127 / amax`` a true fp32 division, ``scale = amax / 127``, amax at
    least 1e-7."""
    xf = x.float()
    absmax = xf.abs().amax(-1, keepdim=True).clamp_min(1e-7) if xf.shape[-1] else torch.full((*xf.shape[:-1], 1), 1e-7)
    q = torch.round(xf * (torch.full_like(absmax, 127.0) / absmax)).to(torch.int32) + 128
    return q.to(torch.uint8), (absmax / 127).squeeze(-1)


# --------------------------------------------------------------------------- bf16


def draw_bf16(rng: random.Random) -> dict:
    return {
        "seed": rng.getrandbits(31),
        "lead": draw_m(rng),
        "n": draw_n(rng, zero=rng.random() < 0.03),
        "k": draw_k(rng, zero=rng.random() < 0.03),
        "dtype": rng.choice(FLOAT_DTYPES),
        "bias": rng.random() < 0.5,
        "layout": rng.choice(["contiguous", "contiguous", "padded", "strided"]),
        "out": rng.choice([None, None, "contiguous", "padded"]),
        "config": None if rng.random() < 0.6 else rng.randrange(16),  # else a tuner candidate of the tier
    }


def bf16_inputs(case: dict):
    g = generator(case, 1)
    x = activations(case, case["k"], case["dtype"])
    w = torch.randn(case["n"], case["k"], generator=g).to(torch.bfloat16)
    bias = torch.randn(case["n"], generator=g).to(case["dtype"]) if case["bias"] else None
    return x, w, bias


def bf16_run(case, tensors):
    x, w, bias = tensors
    packed = kernforge.convert_weight_packed(w)
    out, backing = out_buffer(case, case["n"], case["dtype"]) if case["out"] else (None, None)
    if case["config"] is None:
        y = kernforge.weight_packed_linear(x, packed, bias, out=out)
    else:
        m = rows_of(case["lead"])
        shape = bf16_gemm.tile_shape(case["dtype"], m, case["n"], case["k"])
        candidates = bf16_gemm.TILE_CANDIDATES.applicable(shape, isa.selected_tier())
        config = dict(candidates[case["config"] % len(candidates)].params)
        y = bf16_gemm.linear_with_config(x, packed, config, bias, out=out)
    assert out is None or y is out, "out= was not returned"
    assert y.dtype == case["dtype"], f"returned {y.dtype}"
    outputs = {"out": y}
    if backing is not None:
        outputs["out_backing"] = backing
    return outputs


def bf16_reference(case, tensors):
    x, w, bias = tensors
    ref = with_bias(x.double() @ w.double().T, bias)
    outputs = {"out": ref}
    if case["out"]:
        _, backing = out_buffer(case, case["n"], case["dtype"])
        backing = backing.double()
        backing[..., : case["n"]] = ref
        outputs["out_backing"] = backing
    return outputs


def bf16_tolerance(case):
    rtol, atol = BF16_GEMM[case["dtype"]]
    return (atol * max(case["k"], 1) ** 0.5, rtol)


WEIGHT_PACKED_LINEAR = threaded_target(
    "weight_packed_linear", draw_bf16, bf16_inputs, bf16_run, bf16_reference, bf16_tolerance
)


# --------------------------------------------------------------------------- int8


def draw_int8(rng: random.Random) -> dict:
    return {
        "seed": rng.getrandbits(31),
        "lead": draw_m(rng),
        "n": draw_n(rng, zero=rng.random() < 0.03),
        "k": draw_k(rng, high=1100 if rng.random() < 0.9 else 4200, zero=rng.random() < 0.03),
        "dtype": rng.choice(FLOAT_DTYPES),
        "scale": rng.choice([1e-3, 1.0, 1.0, 300.0]),
        "zero_row": rng.random() < 0.1,  # an all-zero row: amax clamps to 1e-7
        "bias": rng.choice([None, None, torch.float32, torch.bfloat16]),
        "layout": rng.choice(["contiguous", "contiguous", "padded", "strided"]),
        "scale_shape": rng.choice(["flat", "column"]),  # [N] / [N, 1] weight scales, [M] / [M, 1] row scales
        "a_q": rng.choice(["random", "quantized"]),
    }


def int8_inputs(case: dict):
    g = generator(case, 1)
    x = activations(case, case["k"], case["dtype"], scale=case["scale"], zeros=case["k"] if case["zero_row"] else 0)
    w = torch.randint(-128, 128, (case["n"], case["k"]), generator=g, dtype=torch.int8)
    w_scale = torch.rand(case["n"], generator=g) * 1e-2 + 1e-3
    bias = torch.randn(case["n"], generator=g).to(case["bias"]) if case["bias"] else None
    return x, w, w_scale, bias


def draw_quant(rng: random.Random) -> dict:
    case = draw_int8(rng)
    case["k"] = draw_k(rng, high=5000, zero=False)
    return case


def quant_run(case, tensors):
    x = tensors[0]
    q, scale = kernforge.per_token_quant_int8(x)
    return {"q": q, "scale": scale}


def quant_reference(case, tensors):
    q, scale = per_token_quant(tensors[0])
    return {"q": q, "scale": scale}


PER_TOKEN_QUANT = threaded_target(
    "per_token_quant_int8", draw_quant, int8_inputs, quant_run, quant_reference, lambda case: (0.0, 0.0)
)


def int8_packed(case, w, w_scale):
    return kernforge.convert_weight_packed_int8(w, w_scale.view(-1, 1) if case["scale_shape"] == "column" else w_scale)


def int8_mm_inputs(case: dict):
    x, w, w_scale, bias = int8_inputs(case)
    m, k = rows_of(case["lead"]), case["k"]
    g = generator(case, 2)
    if case["a_q"] == "random":  # the whole uint8 range
        a_q = torch.randint(0, 256, (*case["lead"], k), generator=g, dtype=torch.uint8)
        a_scale = torch.rand(case["lead"], generator=g) * 1e-2 + 1e-4
    else:
        a_q, a_scale = per_token_quant(x)
    if case["layout"] == "padded":
        backing = torch.full((*case["lead"], k + 5), 7, dtype=torch.uint8)
        backing[..., :k] = a_q
        a_q = backing[..., :k]
    if case["scale_shape"] == "column":
        a_scale = a_scale.reshape(*case["lead"], 1) if m else a_scale
    return a_q, a_scale, w, w_scale, bias


def draw_int8_mm(rng: random.Random) -> dict:
    case = draw_int8(rng)
    case["out_dtype"] = rng.choice(FLOAT_DTYPES)
    return case


def int8_mm_run(case, tensors):
    a_q, a_scale, w, w_scale, bias = tensors
    out = kernforge.int8_scaled_mm(a_q, int8_packed(case, w, w_scale), a_scale, bias, out_dtype=case["out_dtype"])
    assert out.dtype == case["out_dtype"], f"returned {out.dtype}"
    return {"out": out}


def int8_reference(a_q, a_scale, w, w_scale, bias):
    ref = ((a_q.double() - 128) @ w.double().T) * a_scale.double().reshape(*a_q.shape[:-1], 1) * w_scale.double()
    return with_bias(ref, bias)


def int8_mm_reference(case, tensors):
    a_q, a_scale, w, w_scale, bias = tensors
    return {"out": with_ref_max(case, int8_reference(a_q, a_scale, w, w_scale, bias))}


INT8_SCALED_MM = threaded_target(
    "int8_scaled_mm",
    draw_int8_mm,
    int8_mm_inputs,
    int8_mm_run,
    int8_mm_reference,
    lambda case: relative_tolerance(case, SCALED[case["out_dtype"]]),
)


def int8_quant_mm_run(case, tensors):
    x, w, w_scale, bias = tensors
    out_dtype = case["dtype"] if case["a_q"] == "quantized" else None  # out_dtype may be given, as x's
    out = kernforge.int8_scaled_mm_with_quant(x, int8_packed(case, w, w_scale), bias, out_dtype=out_dtype)
    assert out.dtype == case["dtype"], f"returned {out.dtype}"
    return {"out": out}


def int8_quant_mm_reference(case, tensors):
    x, w, w_scale, bias = tensors
    a_q, a_scale = per_token_quant(x)
    return {"out": with_ref_max(case, int8_reference(a_q, a_scale, w, w_scale, bias))}


INT8_SCALED_MM_WITH_QUANT = threaded_target(
    "int8_scaled_mm_with_quant",
    draw_int8,
    int8_inputs,
    int8_quant_mm_run,
    int8_quant_mm_reference,
    lambda case: relative_tolerance(case, SCALED[case["dtype"]]),
)


# --------------------------------------------------------------------------- fp8

FP8_BLOCKS = [(128, 128), (128, 128), (1, 1), (16, 48), (64, 300), (200, 7), (32, 32), (64, 128)]


def draw_fp8(rng: random.Random) -> dict:
    case = draw_int8(rng)
    case.update(
        k=draw_k(rng, high=700, zero=rng.random() < 0.03),
        block=rng.choice(FP8_BLOCKS),
        path=rng.choice(["dispatch", "dispatch", "in_registers", "converting"]),
    )
    if case["block"] == (1, 1):  # a scale per weight: keep it small
        case["n"], case["k"] = min(case["n"], 70), min(case["k"], 70)
    return case


def fp8_inputs(case: dict):
    g = generator(case, 1)
    n, k, (bn, bk) = case["n"], case["k"], case["block"]
    x = activations(case, k, case["dtype"])
    # clamped: a checkpoint's weights are finite (torch may cast overflow to NaN, which packing refuses)
    w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-n // bn), -(-k // bk), generator=g) * 1e-2 + 1e-3
    bias = torch.randn(n, generator=g).to(case["bias"]) if case["bias"] else None
    return x, w, scale, bias


PATHS = {"in_registers": fp8_gemm.NEVER, "converting": 1}  # a convert_from_rows that sends every M down it


def fp8_run(case, tensors):
    x, w, scale, bias = tensors
    block = case["block"]
    packed = kernforge.convert_weight_packed_fp8(w, scale, block)
    chosen = fp8_gemm.convert_from_rows
    if case["path"] != "dispatch":
        fp8_gemm.convert_from_rows = lambda dtype: PATHS[case["path"]]
    try:
        out = kernforge.fp8_scaled_mm(x, packed, scale, block, bias, out_dtype=case["dtype"])
    finally:
        fp8_gemm.convert_from_rows = chosen
    return {"out": out}


def fp8_reference(case, tensors):
    x, w, scale, bias = tensors
    n, k, (bn, bk) = case["n"], case["k"], case["block"]
    expanded = scale.double().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return {"out": with_ref_max(case, with_bias(x.double() @ (w.double() * expanded).T, bias))}


FP8_SCALED_MM = threaded_target(
    "fp8_scaled_mm",
    draw_fp8,
    fp8_inputs,
    fp8_run,
    fp8_reference,
    # fp32 accumulation over K terms adds ~K * 2^-24 of the largest partial sum (test_gemm_fp8.py)
    lambda case: relative_tolerance(case, SCALED[case["dtype"]], case["k"] * 2.0**-24),
)


# --------------------------------------------------------------------------- int4

INT4_FORMATS = ["pack_int4", "awq", "gptq", "pack_quantized", "pack_quantized_symmetric"]
AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def draw_int4(rng: random.Random) -> dict:
    fmt = rng.choice(INT4_FORMATS)
    quantum = 8 if fmt != "pack_int4" else 4  # checkpoints pack 8 nibbles a word
    group = rng.choice([quantum, 32, 64, 64, 128, 128, None])  # None: one group over K
    groups = rng.choice([1, 1, 2, 3, 4]) if group is not None else 1
    if group is None:
        group = quantum * rng.randint(1, 80)
    n = draw_n(rng, high=200)
    if fmt != "pack_int4":
        n = max(8, n - n % 8)
    return {
        "seed": rng.getrandbits(31),
        "lead": draw_m(rng),
        "n": n,
        "k": group * groups,
        "group": group,
        "format": fmt,
        "symmetric": rng.random() < 0.3 or fmt == "pack_quantized_symmetric",
        "dtype": rng.choice(FLOAT_DTYPES),
        "bias": rng.choice([None, None, torch.float32, torch.bfloat16]),
        "layout": rng.choice(["contiguous", "contiguous", "padded", "strided"]),
        "scales_dtype": rng.choice([torch.float32, torch.float16, torch.bfloat16]),
        "scale": rng.choice([1.0, 1.0, 50.0]),
        "weight_object": rng.random() < 0.3,  # a PackedInt4Weight alone, not (w, w_zeros, w_scales)
    }


def words(nibbles: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """uint8 [R, 8 C] -> int32 [R, C]: element 8c + j in nibble order[j] of word c."""
    r, c = nibbles.shape[0], nibbles.shape[1] // 8
    grouped = nibbles.view(r, c, 8).to(torch.int64)
    packed = torch.zeros(r, c, dtype=torch.int64)
    for j in range(8):
        packed |= grouped[:, :, j] << (4 * order[j])
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def int4_inputs(case: dict):
    """(x, the op's weight arguments, codes [N, K], zeros [G, N], scales fp32 [G, N], bias)."""
    g = generator(case, 1)
    n, k, group, fmt = case["n"], case["k"], case["group"], case["format"]
    groups = k // group
    x = activations(case, k, case["dtype"], scale=case["scale"])
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    if fmt == "gptq":
        zeros = torch.randint(1, 17, (groups, n), generator=g, dtype=torch.uint8)  # stored z - 1: up to 16
    else:
        zeros = torch.randint(0, 16 if fmt != "pack_int4" else 17, (groups, n), generator=g, dtype=torch.uint8)
    if case["symmetric"]:
        zeros = torch.full((groups, n), 8, dtype=torch.uint8)
    scales = (torch.rand(groups, n, generator=g) * 1e-2 + 1e-3).to(case["scales_dtype"])
    bias = torch.randn(n, generator=g).to(case["bias"]) if case["bias"] else None
    qzeros = None
    if fmt == "pack_int4":
        packed = int4_gemm.pack_int4(codes, zeros, scales)
    elif fmt == "awq":
        qweight = words(codes.t().contiguous(), AWQ_ORDER)  # [K, N/8]
        qzeros = None if case["symmetric"] else words(zeros, AWQ_ORDER)
        packed = kernforge.convert_weight_packed_scale_zp(qweight, qzeros, scales, int4_gemm.AWQ)
    elif fmt == "gptq":
        qweight = words(codes.contiguous()).t().contiguous()  # [K/8, N]: words along K
        qzeros = None if case["symmetric"] else words(zeros - 1)
        packed = kernforge.convert_weight_packed_scale_zp(qweight, qzeros, scales, int4_gemm.GPTQ)
    else:
        qweight = words(codes)  # [N, K/8]
        qzeros = None if case["symmetric"] else words(zeros).t().contiguous()  # [N/8, G]: words along N
        packed = kernforge.convert_weight_packed_scale_zp(
            qweight, qzeros, scales.t().contiguous(), int4_gemm.PACK_QUANTIZED
        )
    if isinstance(packed, tuple) and case["weight_object"]:
        packed = int4_gemm.PackedInt4Weight.from_tensors(*packed)
    return x, packed, codes, zeros, scales.float(), bias


def int4_dequantized(codes, zeros, scales, group):
    values = codes.double() - zeros.t().double().repeat_interleave(group, dim=1)
    return values * scales.t().double().repeat_interleave(group, dim=1)


def int4_target(name: str) -> Target:
    op = getattr(kernforge, name)
    w4a8 = name == "int4_scaled_mm_cpu"

    def run(case, tensors):
        x, packed, _, _, _, bias = tensors
        weight = (packed,) if isinstance(packed, int4_gemm.PackedInt4Weight) else tuple(packed)
        out = op(x, *weight, bias=bias)
        assert out.dtype == case["dtype"], f"returned {out.dtype}"
        return {"out": out}

    def reference(case, tensors):
        x, _, codes, zeros, scales, bias = tensors
        if w4a8:  # x quantized per token, as the op does
            q, q_scale = per_token_quant(x)
            a = (q.double() - 128) * q_scale.double()[..., None]
        else:
            a = x.double()
        ref = with_bias(a @ int4_dequantized(codes, zeros, scales, case["group"]).T, bias)
        return {"out": with_ref_max(case, ref)}

    return threaded_target(
        name, draw_int4, int4_inputs, run, reference, lambda case: relative_tolerance(case, QUANTIZED[case["dtype"]])
    )


def draw_quantize_int4(rng: random.Random) -> dict:
    n, k4 = draw_n(rng, high=150), rng.choice([1, 2, 8, 16, 32, 33, 64, 96, 128])
    k = 4 * k4
    divisors = [d for d in range(4, k + 1, 4) if k % d == 0]
    return {
        "seed": rng.getrandbits(31),
        "lead": draw_m(rng),
        "n": n,
        "k": k,
        "group": rng.choice([None, None, *divisors]),
        "symmetric": rng.random() < 0.4,
        "weight_dtype": rng.choice([torch.float32, torch.bfloat16, torch.float16]),
        "dtype": rng.choice(FLOAT_DTYPES),
        "constant_rows": rng.random() < 0.2,  # constant groups: GPTQ's [-1, 1] range, exact zeros
        "layout": "contiguous",
    }


def quantize_inputs(case: dict):
    g = generator(case, 1)
    w = torch.randn(case["n"], case["k"], generator=g)
    if case["constant_rows"] and case["n"]:
        w[0] = 0
        w[-1] = 2.5
    return activations(case, case["k"], case["dtype"]), w.to(case["weight_dtype"])


def quantize_run(case, tensors):
    """Properties of the rounding (every w within half a step of its dequantized value; codes, zero
    points and group size as documented) and the W4A16 GEMM of the packed weight against its values."""
    x, w = tensors
    packed = kernforge.quantize_int4(w, case["group"], case["symmetric"])
    codes, zeros, scales = int4_gemm.unpack_int4(packed)
    group = packed.group_size
    values = int4_dequantized(codes, zeros, scales, group)
    step = scales.t().double().repeat_interleave(group, dim=1)
    zero_ok = (zeros == 8).all() if case["symmetric"] else (zeros <= 15).all()
    expected = x.double() @ values.T
    scale = expected.abs().max().item() if expected.numel() else 0.0
    out = kernforge.int4_w4a16_linear(x, packed).double()
    error = (out - expected).abs().max().item() if expected.numel() else 0.0
    return {
        "within_half_step": (values - w.double()).abs() <= step / 2 * (1 + 1e-6) + 1e-7,
        "codes_and_zeros_in_range": torch.tensor(bool((codes <= 15).all() and zero_ok)),
        "group_size": torch.tensor(group),
        "product_within_tolerance": torch.tensor(error <= QUANTIZED[case["dtype"]] * scale + 1e-6),
    }


def quantize_reference(case, tensors):
    _, w = tensors
    return {
        "within_half_step": torch.ones(w.shape, dtype=torch.bool),
        "codes_and_zeros_in_range": torch.tensor(True),
        "group_size": torch.tensor(case["group"] or int4_gemm.default_group_size(case["k"])),
        "product_within_tolerance": torch.tensor(True),
    }


QUANTIZE_INT4 = threaded_target(
    "quantize_int4", draw_quantize_int4, quantize_inputs, quantize_run, quantize_reference, lambda case: (0.0, 0.0)
)


# --------------------------------------------------------------------------- GGUF

GGUF_TYPES = list(gguf_gemm.TYPES)
# byte offsets of each type's fp16 fields (d, m / dmin): set to small finite values
HALF_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(qtype: str, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Random bytes for every field of ``n`` rows of ``qtype`` blocks, the fp16 scales finite and small."""
    bt = gguf_gemm.BLOCK_TYPES[qtype]
    raw = torch.randint(0, 256, (n, k // bt.block, bt.size), generator=g, dtype=torch.uint8)
    for start in HALF_FIELDS[qtype]:
        half = (torch.rand(n, k // bt.block, generator=g) * 0.02 + 1e-3).to(torch.float16)
        raw[..., start : start + 2] = half.view(torch.uint8).view(n, k // bt.block, 2)
    return raw.reshape(n, -1)


def llama_cpp_values(raw: torch.Tensor, qtype: str, n: int, k: int) -> torch.Tensor:
    """llama.cpp's own dequantization (the gguf package's ``quants.dequantize``), fp32 [n, k]."""
    values = gguf_quants.dequantize(raw.numpy(), gguf_py.GGMLQuantizationType[qtype])
    return torch.from_numpy(values.reshape(n, k).copy())


def draw_gguf(rng: random.Random) -> dict:
    parts = [rng.choice(GGUF_TYPES) for _ in range(rng.choice([1, 1, 1, 2, 3]))]
    block = max(gguf_gemm.BLOCK_TYPES[t].block for t in parts)
    case = {
        "seed": rng.getrandbits(31),
        "lead": draw_m(rng),
        "parts": [(t, draw_n(rng, high=140)) for t in parts],
        "k": block * rng.choice([1, 1, 2, 3, 5] if block == 256 else [1, 2, 3, 5, 8, 16, 33]),
        "dtype": rng.choice(FLOAT_DTYPES),
        "bias": rng.random() < 0.4,
        "layout": rng.choice(["contiguous", "contiguous", "padded", "strided"]),
        "scale": rng.choice([1.0, 1.0, 1e-3, 100.0]),
        "zero_block": rng.random() < 0.15,  # a block of zero activations: scale 0, no division by it
    }
    if case["dtype"] == torch.float16:  # Q6_K weights reach 85: x of 100 would overflow fp16's sums
        case["scale"] = min(case["scale"], 1.0)
    return case


def gguf_inputs(case: dict):
    g = generator(case, 1)
    k = case["k"]
    raws = [random_blocks(t, n, k, g) for t, n in case["parts"]]
    x = activations(case, k, case["dtype"], scale=case["scale"], zeros=32 if case["zero_block"] else 0)
    total = sum(n for _, n in case["parts"])
    bias = torch.randn(total, generator=g) if case["bias"] else None
    return x, raws, bias


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as gguf_linear multiplies it, float64: per block of 32, ``q = rint(x * (127 / amax))`` (a true
    fp32 division), times ``amax / 127`` (llama.cpp's q8_0 of the activations)."""
    k = x.shape[-1]
    blocks = x.float().reshape(-1, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inverse)
    return (q.double() * (amax / 127.0).double()).reshape(*x.shape)


def gguf_run(case, tensors):
    x, raws, bias = tensors
    parts = [kernforge.pack_gguf(raw, t, n, case["k"]) for raw, (t, n) in zip(raws, case["parts"])]
    out = kernforge.gguf_linear(x, parts if len(parts) > 1 else parts[0], bias)
    assert out.dtype == case["dtype"], f"returned {out.dtype}"
    return {"out": out}


def gguf_reference(case, tensors):
    x, raws, bias = tensors
    k = case["k"]
    weight = torch.cat([llama_cpp_values(raw, t, n, k) for raw, (t, n) in zip(raws, case["parts"])])
    return {"out": with_ref_max(case, with_bias(quantized_activations(x) @ weight.double().T, bias))}


GGUF_LINEAR = threaded_target(
    "gguf_linear",
    draw_gguf,
    gguf_inputs,
    gguf_run,
    gguf_reference,
    lambda case: relative_tolerance(case, QUANTIZED[case["dtype"]]),
)


def draw_gguf_rows(rng: random.Random) -> dict:
    qtype = rng.choice(GGUF_TYPES)
    block = gguf_gemm.BLOCK_TYPES[qtype].block
    return {
        "seed": rng.getrandbits(31),
        "qtype": qtype,
        "n": draw_n(rng, high=200),
        "k": block * rng.choice([1, 2, 3]),
        "rows": rng.choice([None, "some", "some", "none"]),
        "ids_shape": rng.choice([[7], [0], [3, 5], [1], [2, 2, 3]]),
        "flat": rng.random() < 0.2,  # pack_gguf takes the file's flat bytes too
        "dtype": torch.float32,
    }


def gguf_rows_inputs(case: dict):
    g = generator(case, 1)
    n, k = case["n"], case["k"]
    raw = random_blocks(case["qtype"], n, k, g)
    if case["rows"] == "some":
        rows = torch.randint(0, n, (size(random.Random(case["seed"]), 30, zero=False),), generator=g)
    elif case["rows"] == "none":
        rows = torch.zeros(0, dtype=torch.int64)
    else:
        rows = None
    ids = torch.randint(0, n, case["ids_shape"], generator=g)
    return raw, rows, ids


def dequantize_run(case, tensors):
    raw, rows, _ = tensors
    return {"values": kernforge.dequantize_rows(raw, case["qtype"], case["k"], rows)}


def dequantize_reference(case, tensors):
    raw, rows, _ = tensors
    values = llama_cpp_values(raw, case["qtype"], case["n"], case["k"])
    return {"values": values if rows is None else values[rows]}


DEQUANTIZE_ROWS = Target(
    "dequantize_rows", draw_gguf_rows, gguf_rows_inputs, dequantize_run, dequantize_reference, lambda case: (0.0, 0.0)
)


def embedding_run(case, tensors):
    raw, _, ids = tensors
    data = raw.reshape(-1) if case["flat"] else raw
    packed = kernforge.pack_gguf(data, case["qtype"], case["n"], case["k"])
    return {"values": kernforge.embedding_rows(packed, ids)}


def embedding_reference(case, tensors):
    raw, _, ids = tensors
    return {"values": llama_cpp_values(raw, case["qtype"], case["n"], case["k"])[ids]}


EMBEDDING_ROWS = Target(
    "embedding_rows", draw_gguf_rows, gguf_rows_inputs, embedding_run, embedding_reference, lambda case: (0.0, 0.0)
)


# --------------------------------------------------------------------------- bmm


def draw_bmm(rng: random.Random) -> dict:
    b_kind = rng.choice(["bf16", "bf16", "fp8", "packed"])
    scale = None if b_kind == "packed" else rng.choice([None, "float", "tensor"])
    if b_kind == "fp8" and scale is None:
        scale = "tensor"  # sgl-kernel's fp8 bmm takes a scale
    return {
        "seed": rng.getrandbits(31),
        "batch": rng.choice([0, 1, 1, 2, 3, 5]),
        "m": size(rng, 40),
        "n": draw_n(rng, high=140, zero=rng.random() < 0.03),
        "k": draw_k(rng, high=600, zero=rng.random() < 0.03),
        "dtype": rng.choice(FLOAT_DTYPES),
        "b_kind": b_kind,
        "b_layout": rng.choice(["contiguous", "transposed"]),  # [B, N, K] any strides: packed per call
        "a_layout": rng.choice(["contiguous", "contiguous", "gaps"]),
        "scale": scale,
        "scale_value": rng.choice([0.37, 2.5, 0.125]),
        "out_layout": rng.choice(["contiguous", "padded"]),
    }


def bmm_inputs(case: dict):
    g = generator(case)
    batch, m, n, k = case["batch"], case["m"], case["n"], case["k"]
    a = torch.randn(batch, m, k, generator=g).to(case["dtype"])
    if case["a_layout"] == "gaps":  # rows and batch entries apart
        backing = torch.full((m, batch, k + 3), float("nan"), dtype=case["dtype"])
        backing[..., :k] = a.transpose(0, 1)
        a = backing[..., :k].transpose(0, 1)
    b = torch.randn(batch, n, k, generator=g)
    b = b.to(torch.float8_e4m3fn) if case["b_kind"] == "fp8" else b.to(torch.bfloat16)
    if case["b_layout"] == "transposed":
        b = b.transpose(1, 2).contiguous().transpose(1, 2)
    return a, b


def bmm_run(case, tensors):
    a, b = tensors
    batch, m, n = case["batch"], case["m"], case["n"]
    pad = 3 if case["out_layout"] == "padded" else 0
    backing = torch.full((batch, m, n + pad), float("nan"), dtype=case["dtype"])
    out = backing[..., :n]
    weights = [kernforge.convert_weight_packed(b_i) for b_i in b] if case["b_kind"] == "packed" else b
    scale = {None: None, "float": case["scale_value"], "tensor": torch.tensor(case["scale_value"])}[case["scale"]]
    assert kernforge.bmm(out, a, weights, scale) is out, "out was not returned"
    return {"out": out, "out_backing": backing}


def bmm_reference(case, tensors):
    a, b = tensors
    ref = a.double() @ b.double().transpose(1, 2)
    if case["scale"] is not None:
        ref = ref * float(torch.tensor(case["scale_value"]))  # the scale as fp32
    n = case["n"]
    pad = 3 if case["out_layout"] == "padded" else 0
    backing = torch.full((case["batch"], case["m"], n + pad), float("nan"), dtype=torch.float64)
    backing[..., :n] = ref
    return {"out": ref, "out_backing": backing}


def bmm_tolerance(case):
    """bmm runs weight_packed_linear per entry: its tolerance, times the scale."""
    rtol, atol = BF16_GEMM[case["dtype"]]
    scale = case["scale_value"] if case["scale"] is not None else 1.0
    return (atol * max(case["k"], 1) ** 0.5 * scale, rtol)


BMM = threaded_target("bmm", draw_bmm, bmm_inputs, bmm_run, bmm_reference, bmm_tolerance)


FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


def draw_bmm_fp8(rng: random.Random) -> dict:
    return {
        "seed": rng.getrandbits(31),
        "batch": rng.choice([0, 1, 1, 2, 4]),
        "m": size(rng, 50),
        "n": draw_n(rng, high=100, zero=rng.random() < 0.03),
        "k": draw_k(rng, high=300, zero=rng.random() < 0.03),
        "a_dtype": rng.choice(FP8_DTYPES),
        "b_dtype": rng.choice(FP8_DTYPES),
        "dtype": rng.choice([torch.bfloat16, torch.float16]),
        "b_layout": rng.choice(["column_major", "column_major", "row_major"]),
        "a_layout": rng.choice(["contiguous", "transposed"]),
        "scale_shape": rng.choice([(), (1,)]),
        "out": rng.choice([None, "contiguous", "transposed"]),
        "backend": rng.choice(["cublas", "auto", "cudnn"]),
    }


def to_float8(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's tests' per-tensor quantization: (x * scale) saturated to fp8, and 1 / scale."""
    finfo = torch.finfo(dtype)
    scale = finfo.max / x.abs().max().clamp(min=1e-12) if x.numel() else torch.tensor(1.0)
    return (x * scale).clamp(min=finfo.min, max=finfo.max).to(dtype), scale.float().reciprocal()


def bmm_fp8_inputs(case: dict):
    g = generator(case)
    batch, m, n, k = case["batch"], case["m"], case["n"], case["k"]
    a, a_scale = to_float8(torch.randn(batch, m, k, generator=g), case["a_dtype"])
    b, b_scale = to_float8(torch.randn(batch, n, k, generator=g).transpose(1, 2), case["b_dtype"])
    if case["b_layout"] == "row_major":
        b = b.contiguous()
    if case["a_layout"] == "transposed":
        a = a.transpose(1, 2).contiguous().transpose(1, 2)
    return a, b, a_scale.reshape(case["scale_shape"]), b_scale.reshape(case["scale_shape"])


def bmm_fp8_run(case, tensors):
    a, b, a_scale, b_scale = tensors
    shape = (case["batch"], case["m"], case["n"])
    out = None
    if case["out"] == "contiguous":
        out = torch.full(shape, float("nan"), dtype=case["dtype"])
    elif case["out"] == "transposed":
        out = torch.full((shape[0], shape[2], shape[1]), float("nan"), dtype=case["dtype"]).transpose(1, 2)
    result = kernforge.bmm_fp8(a, b, a_scale, b_scale, case["dtype"], out, backend=case["backend"])
    assert out is None or result is out, "out was not returned"
    assert result.dtype == case["dtype"], f"returned {result.dtype}"
    return {"out": result}


def bmm_fp8_reference(case, tensors):
    a, b, a_scale, b_scale = tensors
    ref = (a.double() @ b.double()) * a_scale.double().reshape(()) * b_scale.double().reshape(())
    return {"out": with_ref_max(case, ref)}


BMM_FP8 = threaded_target(
    "bmm_fp8",
    draw_bmm_fp8,
    bmm_fp8_inputs,
    bmm_fp8_run,
    bmm_fp8_reference,
    lambda case: relative_tolerance(case, SCALED[case["dtype"]]),
)


TARGETS = [
    WEIGHT_PACKED_LINEAR,
    PER_TOKEN_QUANT,
    INT8_SCALED_MM,
    INT8_SCALED_MM_WITH_QUANT,
    FP8_SCALED_MM,
    int4_target("int4_w4a16_linear"),
    int4_target("int4_scaled_mm_cpu"),
    QUANTIZE_INT4,
    GGUF_LINEAR,
    DEQUANTIZE_ROWS,
    EMBEDDING_ROWS,
    BMM,
    BMM_FP8,
]
