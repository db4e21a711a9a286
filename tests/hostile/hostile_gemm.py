"""The table's cases for the GEMM family: the packers, the linear ops (bf16, int8, fp8, int4, GGUF),
bmm and bmm_fp8, and the GGUF row readers (dequantize_rows, embedding_rows)."""

from __future__ import annotations

import dataclasses

import torch
from hostile_checks import nan_rows, result
from hostile_harness import CaseList, Runs, Setup, gen, i64, overlapping, randn, with_value

import kernforge

BF16, F32, E4M3 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
NAN = float("nan")
N, K = 20, 64  # a weight [N, K]: N off the 32/64-column panels


def _w(dtype=BF16, n=N, k=K):
    return randn(n, k, dtype=dtype, seed=21)


def _packed_w(n=N, k=K):
    return kernforge.convert_weight_packed(_w(n=n, k=k))


def _int8_w():
    w = (randn(N, K, seed=22) * 40).clamp(-127, 127).to(torch.int8)
    return w, torch.rand(N, generator=gen(23)) * 0.01 + 1e-3


def _fp8_w():
    return _w(F32).to(E4M3), torch.full((1, 1), 0.5)


def _int4_checkpoint():
    """An AWQ checkpoint weight [N = 16, K = 64]: qweight int32 [K, N / 8], qzeros [G, N / 8], scales [G, N]."""
    g = gen(24)
    qweight = torch.randint(-(2**31), 2**31 - 1, (K, 2), generator=g, dtype=torch.int64).to(torch.int32)
    qzeros = torch.randint(-(2**31), 2**31 - 1, (2, 2), generator=g, dtype=torch.int64).to(torch.int32)
    return qweight, qzeros, (torch.rand(2, 16, generator=g) * 0.01 + 1e-3).half()


def _int4_w():
    return kernforge.quantize_int4(_w(n=N, k=K), group_size=32)


def _q4_0(n=N, k=K, seed=25):
    """Random Q4_0 blocks (18 bytes per 32: an fp16 scale, 16 bytes of nibbles), the scales small."""
    g = gen(seed)
    raw = torch.randint(0, 256, (n, k // 32, 18), generator=g, dtype=torch.uint8)
    raw[..., 0:2] = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().view(torch.uint8).view(n, k // 32, 2)
    return raw.reshape(n, -1)


def _gguf_w(n=N, k=K):
    return kernforge.pack_gguf(_q4_0(n, k), "Q4_0", n, k)


def _x(m=3, k=K, dtype=BF16, seed=26):
    return randn(m, k, dtype=dtype, seed=seed)


def _with_field(weight, **changes):
    return dataclasses.replace(weight, **changes)


def _nan_row(name: str, row: int = 1, get=None):
    return (
        "nan",
        f"NaN in {name} row {row}",
        lambda a: {name: with_value(a[name], (row, 5), NAN)},
        nan_rows(get or result(), [row], f"row {row} NaN, others unchanged"),
    )


# --------------------------------------------------------------------------- packers


def convert_weight_packed_cases() -> CaseList:
    c = CaseList("convert_weight_packed", lambda: Setup(kernforge.convert_weight_packed, weight=_w()))
    c.dtype("weight", F32).dtype("weight", torch.int8)
    c.meta("weight")
    c.refuse("shape", "weight 1-D", lambda a: {"weight": a["weight"][0]}, "weight")
    c.refuse("shape", "weight 3-D", lambda a: {"weight": a["weight"][None]}, "weight")
    c.add(
        "nan",
        "NaN in the weight, kept",
        lambda a: {"weight": with_value(a["weight"], (3, 4), NAN)},
        Runs(_packed_nan, "packed as is"),
    )
    c.guard("weight")
    c.guard("weight", setup=lambda: Setup(kernforge.convert_weight_packed, weight=_w(n=33, k=35)))
    return c


def _packed_nan(res, args, plain):
    assert torch.isnan(res.packed.float()).sum() == 1


def convert_int8_cases() -> CaseList:
    def setup():
        w, s = _int8_w()
        return Setup(kernforge.convert_weight_packed_int8, weight=w, weight_scale=s)

    c = CaseList("convert_weight_packed_int8", setup)
    c.dtype("weight", F32).dtype("weight_scale", torch.int32)
    c.meta("weight").meta("weight_scale")
    c.refuse("shape", "weight 1-D", lambda a: {"weight": a["weight"][0]}, "weight")
    c.refuse("shape", "weight_scale [N - 1]", lambda a: {"weight_scale": a["weight_scale"][:-1]}, "weight_scale")
    c.add(
        "nan",
        "NaN in weight_scale, kept",
        lambda a: {"weight_scale": with_value(a["weight_scale"], 3, NAN)},
        Runs(
            lambda res, args, plain: _assert(torch.isnan(res.scale).sum() == 1), "stored as is: channel 3's output NaN"
        ),
    )
    c.guard("weight", "weight_scale")
    return c


def convert_fp8_cases() -> CaseList:
    def setup():
        w, s = _fp8_w()
        return Setup(kernforge.convert_weight_packed_fp8, weight=w, weight_scale=s, block_size=(128, 128))

    c = CaseList("convert_weight_packed_fp8", setup)
    c.dtype("weight", BF16).dtype("weight_scale", torch.float64)
    c.meta("weight").meta("weight_scale")
    c.refuse("shape", "weight 3-D", lambda a: {"weight": a["weight"][None]}, "weight")
    c.refuse("shape", "weight_scale [2, 1] for one block", lambda a: {"weight_scale": torch.ones(2, 1)}, "weight_scale")
    c.refuse("shape", "block_size (0, 128)", lambda a: {"block_size": (0, 128)}, "block_size")
    c.refuse(
        "nan",
        "NaN in the fp8 weight",
        lambda a: {"weight": with_value(a["weight"].view(torch.uint8), (1, 2), 0x7F).view(E4M3)},
        "weight",
    )
    c.guard("weight", "weight_scale")
    return c


def convert_scale_zp_cases() -> CaseList:
    def setup():
        qweight, qzeros, scales = _int4_checkpoint()
        return Setup(
            kernforge.convert_weight_packed_scale_zp, qweight=qweight, qzeros=qzeros, scales=scales, quant_method_4bit=0
        )

    c = CaseList("convert_weight_packed_scale_zp", setup)
    c.dtype("qweight", torch.int64).dtype("qzeros", F32).dtype("scales", torch.int32)
    c.meta("qweight").meta("qzeros").meta("scales")
    c.refuse("shape", "qzeros 3 groups", lambda a: {"qzeros": torch.zeros(3, 2, dtype=torch.int32)}, "qzeros")
    c.refuse("shape", "scales [2, 15]", lambda a: {"scales": a["scales"][:, :15]}, "scales")
    c.refuse("index", "quant_method_4bit 7", lambda a: {"quant_method_4bit": 7}, "quant_method_4bit")
    c.guard("qweight", "qzeros", "scales")
    return c


def quantize_int4_cases() -> CaseList:
    c = CaseList("quantize_int4", lambda: Setup(kernforge.quantize_int4, weight=_w(), group_size=32))
    c.dtype("weight", torch.int32)
    c.meta("weight")
    c.refuse("shape", "weight 1-D", lambda a: {"weight": a["weight"][0]}, "weight")
    c.refuse("shape", "group_size 24 (not dividing K)", lambda a: {"group_size": 24}, "group_size")
    c.refuse("nan", "NaN in the weight", lambda a: {"weight": with_value(a["weight"], (2, 3), NAN)}, "weight")
    c.guard("weight")
    return c


def pack_gguf_cases() -> CaseList:
    c = CaseList("pack_gguf", lambda: Setup(kernforge.pack_gguf, data=_q4_0(), qtype="Q4_0", n=N, k=K))
    c.dtype("data", torch.int32)
    c.meta("data")
    c.refuse("shape", "data a row short", lambda a: {"data": a["data"][:-1]}, "data")
    c.refuse("shape", "data a byte short per row", lambda a: {"data": a["data"][:, :-1]}, "data")
    c.refuse("shape", "k 60 (not whole blocks)", lambda a: {"k": 60}, "k")
    c.refuse("shape", "qtype Q2_K (unknown)", lambda a: {"qtype": "Q2_K"}, "qtype")
    c.guard("data")
    return c


def dequantize_rows_cases() -> CaseList:
    c = CaseList(
        "dequantize_rows",
        lambda: Setup(kernforge.dequantize_rows, data=_q4_0(), qtype="Q4_0", k=K, rows=i64(N - 1, 0, 7)),
    )
    c.dtype("data", F32).dtype("rows", F32)
    c.meta("data").meta("rows")
    c.refuse("shape", "k 96 (data holds 64)", lambda a: {"k": 96}, "data")
    c.refuse("index", "rows -1", lambda a: {"rows": i64(0, -1)}, "rows")
    c.refuse("index", "rows = n", lambda a: {"rows": i64(0, N)}, "rows")
    c.guard("data", "rows")
    return c


def embedding_rows_cases() -> CaseList:
    c = CaseList("embedding_rows", lambda: Setup(kernforge.embedding_rows, w=_gguf_w(), ids=i64(N - 1, 0, 7, 7)))
    c.dtype("ids", F32)
    c.meta("ids")
    c.refuse("shape", "w not a PackedGGUFWeight", lambda a: {"w": _w()}, "w", TypeError)
    c.refuse("index", "ids -1", lambda a: {"ids": i64(0, -1)}, "ids")
    c.refuse("index", "ids = n (inside the last panel's padding)", lambda a: {"ids": i64(0, N)}, "ids")
    c.refuse("index", "ids past the last panel", lambda a: {"ids": i64(0, 64)}, "ids")
    c.add(
        "shape",
        "ids 2-D",
        lambda a: {"ids": a["ids"].view(2, 2)},
        Runs(lambda res, args, plain: _assert(res.shape == (2, 2, K)), "rows [*ids.shape, K]"),
    )
    c.guard("w", "ids")
    return c


def _assert(ok):
    assert ok


# --------------------------------------------------------------------------- linear ops


def weight_packed_linear_cases() -> CaseList:
    def setup():
        return Setup(
            kernforge.weight_packed_linear,
            x=_x(),
            packed=_packed_w(),
            bias=randn(N, dtype=BF16, seed=2),
            out=torch.empty(3, N, dtype=BF16),
        )

    c = CaseList("weight_packed_linear", setup)
    c.dtype("x", torch.int32).dtype("bias", F32).dtype("out", F32)
    c.meta("x").meta("bias").meta("out")
    c.refuse("shape", "x K 63", lambda a: {"x": a["x"][:, :63]}, "x")
    c.refuse("shape", "bias [N + 1]", lambda a: {"bias": randn(N + 1, dtype=BF16)}, "bias")
    c.refuse("shape", "out [3, N - 1]", lambda a: {"out": torch.empty(3, N - 1, dtype=BF16)}, "out")
    c.refuse(
        "shape", "out rows expanded (overlap)", lambda a: {"out": torch.empty(1, N, dtype=BF16).expand(3, N)}, "out"
    )
    c.refuse(
        "shape",
        "packed truncated",
        lambda a: {"packed": _with_field(a["packed"], packed=a["packed"].packed[:, :10])},
        "packed",
    )
    c.refuse("shape", "packed not a PackedWeight", lambda a: {"packed": _w()}, "packed", TypeError)
    c.refuse("alias", "out overlaps x", lambda a: overlapping(a, "x", "out", (3, N), K), "out")
    c.refuse(
        "alias",
        "out overlaps the packed weight",
        lambda a: {"out": a["packed"].packed.view(-1)[: 3 * N].view(3, N)},
        "out",
    )
    c.add(*_nan_row("x"))
    c.guard("x", "packed", "bias", "out")
    c.guard(
        "x", "packed", setup=lambda: Setup(kernforge.weight_packed_linear, x=_x(5, 35, F32), packed=_packed_w(33, 35))
    )
    return c


def int8_cases() -> CaseList:
    def setup():
        a_q, a_scale = kernforge.per_token_quant_int8(_x())
        return Setup(
            kernforge.int8_scaled_mm,
            a_q=a_q,
            packed=kernforge.convert_weight_packed_int8(*_int8_w()),
            a_scale=a_scale,
            bias=torch.zeros(N),
        )

    c = CaseList("int8_scaled_mm", setup)
    c.dtype("a_q", torch.int8).dtype("a_scale", BF16).dtype("bias", torch.int64)
    c.refuse("dtype", "out_dtype int32", lambda a: {"out_dtype": torch.int32}, "out_dtype", TypeError)
    c.meta("a_q").meta("a_scale")
    c.refuse("shape", "a_q K 63", lambda a: {"a_q": a["a_q"][:, :63]}, "a_q")
    c.refuse("shape", "a_scale 2 of 3 rows", lambda a: {"a_scale": a["a_scale"][:2]}, "a_scale")
    c.refuse(
        "shape",
        "packed compensation short",
        lambda a: {"packed": _with_field(a["packed"], compensation=a["packed"].compensation[:-1])},
        "packed",
    )
    c.add(
        "nan",
        "NaN in a_scale row 1",
        lambda a: {"a_scale": with_value(a["a_scale"], 1, NAN)},
        nan_rows(result(), [1], "row 1 NaN, others unchanged"),
    )
    c.guard("a_q", "a_scale", "bias", "packed")
    return c


def int8_with_quant_cases() -> CaseList:
    def setup():
        return Setup(
            kernforge.int8_scaled_mm_with_quant,
            x=_x(),
            packed=kernforge.convert_weight_packed_int8(*_int8_w()),
            bias=torch.zeros(N),
        )

    c = CaseList("int8_scaled_mm_with_quant", setup)
    c.dtype("x", torch.int32).dtype("bias", torch.int64)
    c.refuse("dtype", "out_dtype float16 for bf16 x", lambda a: {"out_dtype": torch.float16}, "out_dtype", TypeError)
    c.meta("x").meta("bias")
    c.refuse("shape", "x K 65", lambda a: {"x": _x(3, K + 1)}, "x")
    c.refuse("shape", "bias [N - 1]", lambda a: {"bias": torch.zeros(N - 1)}, "bias")
    c.add(*_nan_row("x"))
    c.guard("x", "packed", "bias")
    return c


def per_token_quant_cases() -> CaseList:
    c = CaseList("per_token_quant_int8", lambda: Setup(kernforge.per_token_quant_int8, x=_x()))
    c.dtype("x", torch.int32).dtype("x", torch.float64)
    c.meta("x")
    c.refuse("shape", "x 0-dim", lambda a: {"x": torch.tensor(1.0, dtype=BF16)}, "x")
    c.add(
        "nan",
        "NaN in x row 1",
        lambda a: {"x": with_value(a["x"], (1, 5), NAN)},
        nan_rows(result(1), [1], "row 1's scale NaN, others unchanged", others=(lambda r, a: r[0][[0, 2]],)),
    )
    c.guard("x")
    c.guard("x", setup=lambda: Setup(kernforge.per_token_quant_int8, x=_x(5, 37, F32)))
    return c


def fp8_scaled_mm_cases() -> CaseList:
    def setup():
        w, s = _fp8_w()
        return Setup(
            kernforge.fp8_scaled_mm,
            x=_x(),
            packed=kernforge.convert_weight_packed_fp8(w, s),
            weight_scale=s,
            bias=torch.zeros(N),
        )

    c = CaseList("fp8_scaled_mm", setup)
    c.dtype("x", torch.int32).dtype("weight_scale", torch.float64)
    c.refuse("dtype", "out_dtype float32 for bf16 x", lambda a: {"out_dtype": F32}, "out_dtype", TypeError)
    c.meta("x").meta("weight_scale")
    c.refuse("shape", "x K 63", lambda a: {"x": a["x"][:, :63]}, "x")
    c.refuse("shape", "weight_scale [2, 2]", lambda a: {"weight_scale": torch.ones(2, 2)}, "weight_scale")
    c.refuse("shape", "bias [N + 1]", lambda a: {"bias": torch.zeros(N + 1)}, "bias")
    c.refuse("shape", "packed not a PackedFp8Weight", lambda a: {"packed": _w()}, "packed", TypeError)
    c.add(*_nan_row("x"))
    c.guard("x", "packed", "weight_scale", "bias")
    return c


def int4_cases(name: str) -> CaseList:
    op = getattr(kernforge, name)

    def setup():
        w = _int4_w()
        return Setup(op, x=_x(), w=w.packed, w_zeros=w.zeros, w_scales=w.scales, bias=torch.zeros(N))

    c = CaseList(name, setup)
    c.dtype("x", torch.int32).dtype("w", torch.int8).dtype("w_scales", torch.float16)
    c.meta("x").meta("w_zeros").meta("w_scales")
    c.refuse("shape", "x K 63", lambda a: {"x": a["x"][:, :63]}, "x")
    c.refuse("shape", "bias [N - 1]", lambda a: {"bias": torch.zeros(N - 1)}, "bias")
    c.refuse(
        "shape",
        "w_scales for N + 64",
        lambda a: {"w_scales": torch.ones(2, N + 64), "w_zeros": torch.zeros(2, N + 64, dtype=torch.uint8)},
        "w_scales",
    )
    c.refuse("shape", "w_zeros without w_scales", lambda a: {"w_scales": None}, "w_scales", TypeError)
    c.refuse(
        "index", "w_zeros 17 (past 4 bits)", lambda a: {"w_zeros": with_value(a["w_zeros"], (1, 3), 17)}, "w_zeros"
    )
    c.add(*_nan_row("x"))
    c.guard("x", "w", "w_zeros", "w_scales", "bias")
    return c


def gguf_linear_cases() -> CaseList:
    c = CaseList("gguf_linear", lambda: Setup(kernforge.gguf_linear, x=_x(), w=_gguf_w(), bias=torch.zeros(N)))
    c.dtype("x", torch.int32).dtype("bias", torch.int64)
    c.meta("x").meta("bias")
    c.refuse("shape", "x K 63", lambda a: {"x": a["x"][:, :63]}, "x")
    c.refuse("shape", "bias [N + 1]", lambda a: {"bias": torch.zeros(N + 1)}, "bias")
    c.refuse("shape", "w parts of different K", lambda a: {"w": [a["w"], _gguf_w(8, 96)]}, "w")
    c.refuse("shape", "w truncated", lambda a: {"w": _with_field(a["w"], packed=a["w"].packed[:, :4])}, "w")
    c.refuse(
        "shape", "w.scales of another type", lambda a: {"w": _with_field(a["w"], scales=a["w"].scales.float())}, "w"
    )
    c.add(*_nan_row("x"))
    c.guard("x", "w", "bias")
    return c


# --------------------------------------------------------------------------- batched


def bmm_cases() -> CaseList:
    def setup():
        return Setup(
            kernforge.bmm,
            out=torch.empty(2, 3, N, dtype=BF16),
            a=randn(2, 3, K, dtype=BF16),
            b=randn(2, N, K, dtype=BF16, seed=3),
        )

    c = CaseList("bmm", setup)
    c.dtype("a", torch.int32).dtype("b", torch.float16).dtype("out", F32)
    c.meta("a").meta("b").meta("out")
    c.refuse("shape", "a 2-D", lambda a: {"a": a["a"][0]}, "a")
    c.refuse("shape", "b batch 3", lambda a: {"b": randn(3, N, K, dtype=BF16)}, "b")
    c.refuse("shape", "out [2, 3, N + 1]", lambda a: {"out": torch.empty(2, 3, N + 1, dtype=BF16)}, "out")
    c.refuse("shape", "scale of 2 elements", lambda a: {"scale": torch.ones(2)}, "scale")
    c.refuse(
        "shape",
        "out rows expanded (overlap)",
        lambda a: {"out": torch.empty(2, 1, N, dtype=BF16).expand(2, 3, N)},
        "out",
    )
    c.refuse("alias", "out overlaps a", lambda a: overlapping(a, "a", "out", (2, 3, N), K), "out")
    c.refuse("alias", "out overlaps b", lambda a: overlapping(a, "b", "out", (2, 3, N), 8), "out")
    c.add(
        "nan",
        "NaN in a batch 1 row 2",
        lambda a: {"a": with_value(a["a"], (1, 2, 0), NAN)},
        Runs(_nan_only(1, 2), "that row NaN, others unchanged"),
    )
    c.guard("a", "b", "out")
    return c


def _nan_only(batch, row):
    def check(res, args, plain):
        nan = torch.isnan(args["out"].float()).any(-1)
        expected = torch.zeros_like(nan)
        expected[batch, row] = True
        assert torch.equal(nan, expected), nan

    return check


def _fp8(*shape, seed):
    return (randn(*shape, seed=seed) * 4).to(E4M3)


def bmm_fp8_cases() -> CaseList:
    def setup():
        return Setup(
            kernforge.bmm_fp8,
            A=_fp8(2, 3, K, seed=1),
            B=_fp8(2, K, N, seed=2),
            A_scale=torch.tensor(0.5),
            B_scale=torch.tensor(0.25),
            dtype=BF16,
            out=torch.empty(2, 3, N, dtype=BF16),
        )

    c = CaseList("bmm_fp8", setup)
    c.dtype("A", BF16).dtype("B", torch.int8).dtype("A_scale", torch.float64)
    c.refuse(
        "dtype",
        "out float16 for dtype bf16",
        lambda a: {"out": torch.empty(2, 3, N, dtype=torch.float16)},
        "out",
        TypeError,
    )
    c.refuse("dtype", "dtype float32", lambda a: {"dtype": F32}, "dtype")  # FlashInfer's ValueError
    c.meta("A").meta("B").meta("B_scale").meta("out")
    c.refuse("shape", "A 2-D", lambda a: {"A": a["A"][0]}, "A")
    c.refuse("shape", "B K 63", lambda a: {"B": a["B"][:, :63]}, "B")
    c.refuse("shape", "B_scale 2 elements", lambda a: {"B_scale": torch.ones(2)}, "B_scale")
    c.refuse("shape", "out [2, 3, N - 1]", lambda a: {"out": torch.empty(2, 3, N - 1, dtype=BF16)}, "out")
    c.refuse(
        "shape",
        "out rows expanded (overlap)",
        lambda a: {"out": torch.empty(2, 1, N, dtype=BF16).expand(2, 3, N)},
        "out",
    )
    c.add(
        "shape",
        "out last dim strided",
        lambda a: {"out": torch.empty(2, 3, 2 * N, dtype=BF16)[..., ::2]},
        Runs(lambda res, args, plain: _assert(torch.equal(res, plain[0])), "allowed: same result"),
    )
    c.refuse(
        "alias",
        "out overlaps B",
        lambda a: {"out": a["B"].view(torch.uint8).view(-1)[: 2 * 3 * N * 2].view(BF16).view(2, 3, N)},
        "out",
    )
    c.add(
        "nan",
        "NaN in A_scale",
        lambda a: {"A_scale": torch.tensor(NAN)},
        Runs(lambda res, args, plain: _assert(torch.isnan(res.float()).all()), "every output NaN"),
    )
    c.guard("A", "B", "A_scale", "B_scale", "out")
    return c


def cases() -> list[CaseList]:
    return [
        convert_weight_packed_cases(),
        convert_int8_cases(),
        convert_fp8_cases(),
        convert_scale_zp_cases(),
        quantize_int4_cases(),
        pack_gguf_cases(),
        dequantize_rows_cases(),
        embedding_rows_cases(),
        weight_packed_linear_cases(),
        int8_cases(),
        int8_with_quant_cases(),
        per_token_quant_cases(),
        fp8_scaled_mm_cases(),
        int4_cases("int4_scaled_mm_cpu"),
        int4_cases("int4_w4a16_linear"),
        gguf_linear_cases(),
        bmm_cases(),
        bmm_fp8_cases(),
    ]
