"""int8 w8a8 linear layers with sgl-kernel's CPU semantics (``sgl-kernel/csrc/cpu/gemm_int8.cpp``).

* ``per_token_quant_int8(x)`` -> ``(x_q, x_scale)``: per row, ``scale = max(amax, 1e-7) / 127`` and
  ``x_q = round(x * (127 / amax)) + 128`` as uint8 (int8 values shifted by the zero point 128, which
  is what vpdpbusd multiplies), rounding half to even; ``x_scale`` is fp32 ``[...]`` (``[M]`` for a
  2-D ``x``, as sgl-kernel).
* ``convert_weight_packed_int8(weight, weight_scale)`` packs a symmetric int8 weight ``[N, K]`` with
  its fp32 per-channel scales ``[N]`` or ``[N, 1]``.
* ``int8_scaled_mm(a_q, packed, a_scale)`` = ``(a_q - 128) . W^T * a_scale[m] * w_scale[n] (+ bias)``,
  accumulated exactly in int32; ``int8_scaled_mm_with_quant(x, packed)`` quantizes ``x`` first, in
  the same kernel call.

The packed layout (``PackedInt8Weight.layout_version`` 1) is the one every tier's micro-kernel reads
(``kernforge/gemm/int8_kernel.h``): N in panels of ``panel_width`` columns, each panel K group by K
group, each group of 4 K one 32-bit word per column (VNNI-4: the lowest K in the low byte); N padded
with zero rows to whole panels, K with zero columns to whole groups. ``compensation[n] = 128 * sum_k
W[n, k]`` undoes the activations' zero point.
"""

from __future__ import annotations

import torch

from kernforge.jit.module import ALL_TIERS, DType, Entry, Module
from kernforge.ops._common import dtype_name, num_threads
from kernforge.ops._registry import DTYPE_NAMES, Traced, export, kernel_op, model_kernels
from kernforge.ops.gemm._common import (
    check_cpu_tensor,
    check_layout_version,
    check_packed,
    checked_fp32_bias,
    checked_weight,
    matrix_rows,
    packed_weight,
    raise_for_status,
)

LAYOUT_VERSION = 1
PANEL_WIDTH = 64  # columns of the product per packed panel: a multiple of every tier's NR
GROUP = 4  # K elements per packed 32-bit word
ZERO_POINT = 128

_GEMM_ARGS = (
    "int64_t packed, int64_t panel_width, int64_t compensation, int64_t w_scale, int64_t bias, "
    "int64_t out, int64_t ldo, int64_t m, int64_t n, int64_t k, int64_t num_threads"
)
GEMM_INT8 = Module(
    "gemm_int8",
    "gemm_int8.cpp.jinja",
    params={"dtype": DType()},
    entries=[
        Entry(
            "quantize",
            "int64_t q, int64_t ldq, int64_t scale, int64_t x, int64_t ldx, int64_t m, int64_t k, int64_t num_threads",
        ),
        Entry("scaled_mm", "int64_t a, int64_t lda, int64_t a_scale, " + _GEMM_ARGS, returns="int64_t"),
        Entry(
            "scaled_mm_with_quant", "int64_t x, int64_t ldx, int64_t q, int64_t scale, " + _GEMM_ARGS, returns="int64_t"
        ),
        Entry(
            "accumulate",
            "int64_t a, int64_t lda, int64_t packed, int64_t panel_width, int64_t compensation, "
            "int64_t out, int64_t ldo, int64_t m, int64_t n, int64_t k, int64_t num_threads",
            returns="int64_t",
        ),
    ],
    tiers=ALL_TIERS,  # the amx build multiplies in AMX tiles (gemm/amx_kernel.h)
)


@packed_weight(saved_as="kernforge.ops.gemm_int8")
class PackedInt8Weight:
    """An int8 weight ``[n, k]`` with per-channel scales, packed for :func:`int8_scaled_mm`;
    survives ``torch.save``/``torch.load``."""

    packed: torch.Tensor  # [n_panels, ceil(k / 4), panel_width, 4] int8
    compensation: torch.Tensor  # [n] int32: 128 * sum_k W[n, k]
    scale: torch.Tensor  # [n] fp32
    n: int
    k: int
    panel_width: int = PANEL_WIDTH
    layout_version: int = LAYOUT_VERSION


def convert_weight_packed_int8(weight: torch.Tensor, weight_scale: torch.Tensor) -> PackedInt8Weight:
    """Pack an int8 ``weight [N, K]`` and its per-channel ``weight_scale [N]`` or ``[N, 1]``."""
    n, k = checked_weight(weight, torch.int8, "convert_weight_packed_int8")
    check_cpu_tensor(weight_scale, "weight_scale")
    if not weight_scale.is_floating_point():
        raise TypeError(f"weight_scale has dtype {weight_scale.dtype}; expected a floating dtype (stored as float32)")
    if tuple(weight_scale.shape) not in ((n,), (n, 1)):
        raise ValueError(
            f"weight_scale must have shape ({n},) or ({n}, 1) to match weight's N, got {tuple(weight_scale.shape)}"
        )
    panels, groups, _, _ = packed_shape(n, k)
    padded = weight.new_zeros(panels * PANEL_WIDTH, groups * GROUP)
    padded[:n, :k] = weight
    packed = padded.view(panels, PANEL_WIDTH, groups, GROUP).permute(0, 2, 1, 3).contiguous()
    compensation = weight.sum(1, dtype=torch.int32) * ZERO_POINT
    scale = weight_scale.reshape(n).to(torch.float32, copy=True).contiguous()
    return PackedInt8Weight(packed, compensation, scale, int(n), int(k))


export("convert_weight_packed_int8", convert_weight_packed_int8)


@kernel_op(GEMM_INT8)
def per_token_quant_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` (fp32/bf16/fp16) -> ``(x_q [..., K] uint8, x_scale [...] fp32)``, sgl-kernel's
    per-token symmetric quantization with the zero point 128 (``x ~ (x_q - 128) * x_scale``)."""
    kernel = _float_input_kernel(per_token_quant_int8, x, "x")
    m, k, x2, ldx = matrix_rows(x, "x")
    q = torch.empty(x.shape, dtype=torch.uint8)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32)
    if m:
        kernel.quantize(q.data_ptr(), k, scale.data_ptr(), x2.data_ptr(), ldx, m, k, num_threads())
    return q, scale


@kernel_op(GEMM_INT8)
def int8_scaled_mm(
    a_q: torch.Tensor,
    packed: PackedInt8Weight,
    a_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``(a_q - 128) . W^T * a_scale * w_scale (+ bias)`` -> ``[..., N]`` in ``out_dtype`` (bf16, fp16 or
    fp32). ``a_q [..., K]`` uint8 and ``a_scale`` (``M`` fp32 values, ``[...]`` or ``[..., 1]``) as
    :func:`per_token_quant_int8` returns them; ``packed`` from :func:`convert_weight_packed_int8`."""
    kernel = _out_kernel(int8_scaled_mm, out_dtype)
    n, k = _checked_packed(packed)
    check_cpu_tensor(a_q, "a_q")
    if a_q.dtype is not torch.uint8:
        raise TypeError(
            f"a_q has dtype {a_q.dtype}; int8_scaled_mm takes torch.uint8 activations "
            "(int8 values + 128, as per_token_quant_int8 returns them)"
        )
    m, _, a2, lda = matrix_rows(a_q, "a_q", k, "packed's K")
    check_cpu_tensor(a_scale, "a_scale")
    if a_scale.dtype is not torch.float32:
        raise TypeError(f"a_scale has dtype {a_scale.dtype}; expected torch.float32")
    if a_scale.numel() != m:
        raise ValueError(f"a_scale must hold one scale per row of a_q ({m}), got shape {tuple(a_scale.shape)}")
    a_scale = a_scale.reshape(m).contiguous()
    bias = checked_fp32_bias(bias, n)
    out = torch.empty((*a_q.shape[:-1], n), dtype=out_dtype)
    if m == 0:
        return out
    status = kernel.scaled_mm(
        a2.data_ptr(), lda, a_scale.data_ptr(), *_weight_args(packed, bias), out.data_ptr(), n, m, n, k, num_threads()
    )
    raise_for_status(status, "int8 GEMM")
    return out


def _to_schema(x, packed, bias=None, out_dtype=None):
    check_layout_version(packed, LAYOUT_VERSION)  # the custom op rebuilds the dataclass at this version
    if out_dtype is not None and out_dtype is not x.dtype:
        raise TypeError(
            f"out_dtype is {out_dtype} but x has dtype {x.dtype}; int8_scaled_mm_with_quant (traced) writes x's dtype"
        )
    return (x, packed.packed, packed.compensation, packed.scale, packed.n, packed.k, packed.panel_width, bias), None


def _from_schema(x, packed, compensation, scale, n, k, panel_width, bias=None):
    return int8_scaled_mm_with_quant(x, PackedInt8Weight(packed, compensation, scale, n, k, panel_width), bias)


# The custom op takes the PackedInt8Weight as its tensors and ints (a schema holds no Python objects).
_TRACED = Traced(
    "Tensor",
    fake=lambda x, packed, compensation, scale, n, *args, **kwargs: x.new_empty((*x.shape[:-1], n)),
    arguments="Tensor x, Tensor packed, Tensor compensation, Tensor scale, int n, int k, int panel_width, "
    "Tensor? bias=None",
    from_schema=_from_schema,
    to_schema=_to_schema,
)


@kernel_op(GEMM_INT8, traced=_TRACED)
def int8_scaled_mm_with_quant(
    x: torch.Tensor, packed: PackedInt8Weight, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """:func:`per_token_quant_int8` of ``x [..., K]`` then :func:`int8_scaled_mm`, in one kernel call.
    ``out_dtype`` must be ``x``'s dtype (sgl-kernel's rule); None means ``x``'s dtype."""
    kernel = _float_input_kernel(int8_scaled_mm_with_quant, x, "x")
    if out_dtype is not None and out_dtype is not x.dtype:
        raise TypeError(
            f"out_dtype is {out_dtype} but x has dtype {x.dtype}; int8_scaled_mm_with_quant (traced) writes x's dtype"
        )
    n, k = _checked_packed(packed)
    m, _, x2, ldx = matrix_rows(x, "x", k, "packed's K")
    bias = checked_fp32_bias(bias, n)
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype)
    if m == 0:
        return out
    q = torch.empty(m, k, dtype=torch.uint8)
    scale = torch.empty(m, dtype=torch.float32)
    status = kernel.scaled_mm_with_quant(
        x2.data_ptr(),
        ldx,
        q.data_ptr(),
        scale.data_ptr(),
        *_weight_args(packed, bias),
        out.data_ptr(),
        n,
        m,
        n,
        k,
        num_threads(),
    )
    raise_for_status(status, "int8 GEMM")
    return out


def int8_accumulate(a_q: torch.Tensor, packed: PackedInt8Weight) -> torch.Tensor:
    """The exact int32 product ``(a_q - 128) . W^T`` before any scaling (``a_q [M, K]`` uint8): the
    accumulator :func:`int8_scaled_mm` dequantizes, for tests and callers that scale themselves."""
    n, k = _checked_packed(packed)
    check_cpu_tensor(a_q, "a_q")
    if a_q.dtype is not torch.uint8:
        raise TypeError(f"a_q has dtype {a_q.dtype}; expected torch.uint8")
    m, _, a2, lda = matrix_rows(a_q, "a_q", k, "packed's K")
    out = torch.empty((*a_q.shape[:-1], n), dtype=torch.int32)
    if m == 0:
        return out
    kernel = int8_scaled_mm.kernels.variant(torch.float32).kernel()
    status = kernel.accumulate(
        a2.data_ptr(),
        lda,
        packed.packed.data_ptr(),
        packed.panel_width,
        packed.compensation.data_ptr(),
        out.data_ptr(),
        n,
        m,
        n,
        k,
        num_threads(),
    )
    raise_for_status(status, "int8 GEMM")
    return out


# --------------------------------------------------------------------------- checks


def _float_input_kernel(op, x: object, name: str):
    check_cpu_tensor(x, name)
    if x.dtype not in DTYPE_NAMES:
        raise TypeError(f"{name} has dtype {x.dtype}; expected torch.float32, torch.bfloat16 or torch.float16")
    return op.kernels.variant(x.dtype).kernel()


def _out_kernel(op, out_dtype: object):
    if out_dtype not in DTYPE_NAMES:
        raise TypeError(f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32, got {out_dtype!r}")
    return op.kernels.variant(out_dtype).kernel()


def packed_shape(n: int, k: int, panel_width: int = PANEL_WIDTH) -> tuple[int, int, int, int]:
    """Shape of the packed tensor of a weight ``[n, k]``: panels, K groups, columns, GROUP."""
    return (-(-n // panel_width), -(-k // GROUP), panel_width, GROUP)


def _checked_packed(packed: object) -> tuple[int, int]:
    return check_packed(
        packed,
        PackedInt8Weight,
        "convert_weight_packed_int8",
        LAYOUT_VERSION,
        lambda p: [
            ("packed", torch.int8, packed_shape(p.n, p.k, p.panel_width)),
            ("compensation", torch.int32, (p.n,)),
            ("scale", torch.float32, (p.n,)),
        ],
    )


def _weight_args(packed: PackedInt8Weight, bias: torch.Tensor | None) -> tuple[int, ...]:
    """packed, panel_width, compensation, w_scale, bias as the kernel takes them."""
    return (
        packed.packed.data_ptr(),
        packed.panel_width,
        packed.compensation.data_ptr(),
        packed.scale.data_ptr(),
        0 if bias is None else bias.data_ptr(),
    )


@model_kernels
def _for_model(spec, kv_cache_dtypes, quant) -> list[dict]:
    return [{"module": "gemm_int8", "params": {"dtype": dtype_name(spec.dtype)}}] if quant == "int8" else []
