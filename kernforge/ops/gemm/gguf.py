"""GEMM on llama.cpp's block-quantized weights: the tensors of a GGUF file (Q4_0, Q4_1, Q8_0, Q4_K,
Q5_K, Q6_K, as ``ggml-common.h`` defines their blocks) repacked once for kernforge's kernels without
changing a value.

Every one of these types is, per group of 16 or 32 K elements, ``weight = scale * code + offset``
with an unsigned integer ``code``:

========  ======  =====  ===========================  ===================================  ========
type      group   code   scale                        offset                               stored
========  ======  =====  ===========================  ===================================  ========
Q4_0      32      0..15  ``d``                        ``-8 d`` (zero 8)                    nibbles
Q4_1      32      0..15  ``d``                        ``m``                                nibbles
Q8_0      32      0..255 ``d``                        ``-128 d`` (zero 128; code q + 128)  bytes
Q4_K      32      0..15  ``d * sc[j]``                ``-dmin * m[j]``                     nibbles
Q5_K      32      0..31  ``d * sc[j]``                ``-dmin * m[j]``                     nibbles + 2
Q6_K      16      0..63  ``d * sc[j]``                ``-32 d sc[j]`` (zero 32)            nibbles + 2
========  ======  =====  ===========================  ===================================  ========

The file's values are kept as it stores them: fp16 ``d``, ``m`` and ``dmin`` per block or super-block
(256 elements), the K-quants' sub-scales ``sc[j]`` and ``m[j]`` (6-bit; Q6_K's int8) as bytes per
group; the kernel forms each group's scale and offset, products exact in fp32 (``d`` has 11
significant bits, ``sc`` at most 8), so :func:`dequantize` (``scale * code + offset`` rounded once to
fp32) equals llama.cpp's own dequantization (``gguf.quants.dequantize``) bit for bit. Types whose
offset is a whole number of scales keep no offsets (the kernel subtracts ``zero`` times the
activations' sum in int32).

* :func:`pack_gguf(data, qtype, n, k)` -> :class:`PackedGGUFWeight`: a GGUF tensor's bytes (``[n, row
  bytes]`` uint8, as the file stores a 2-D tensor of ``n`` rows of ``k``) repacked.
* :func:`gguf_linear(x, w, bias=None)`: ``x [..., K]`` (bf16, fp16, fp32) times the weight -> ``[..., N]``
  in ``x``'s dtype. ``x`` is quantized per block of 32 to int8 inside the call (``scale = amax / 127``,
  as llama.cpp quantizes activations to q8_0), each group's integer product is exact in int32, and
  ``a_scale * (scale * dot + offset * sum(q))`` accumulates in fp32.
* :func:`dequantize_rows(data, qtype, k, rows)`: some rows of a tensor as fp32 (an embedding lookup).

Layout (``LAYOUT_VERSION`` 1): N in panels of 64 columns, K in quads. 4-bit codes as
``kernforge.ops.gemm.int4`` packs them (``[panels, K / 4, 128]``); 5- and 6-bit codes the same for their
low nibbles, plus ``high`` ``[panels, K / 4, 64]``: bits ``2 (j / 16)`` of byte ``4 (j % 16) + i`` hold
column ``j``'s two high bits at K ``4 q + i``; 8-bit codes ``[panels, K / 4, 256]``, column ``j``'s 4 K
bytes at byte ``4 j``. Per-block values ``[panels, blocks, 64]``, per-group ones ``[panels, G, 64]``
(columns past N: 0).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from kernforge.jit.module import ALL_TIERS, DType, Entry, Enum, Module, Struct
from kernforge.ops._common import BoundCall, num_threads
from kernforge.ops._registry import DTYPE_NAMES, export, kernel_op
from kernforge.ops.gemm import int4
from kernforge.ops.gemm._common import check_cpu_tensor, checked_fp32_bias, matrix_rows, packed_weight

LAYOUT_VERSION = 1
PANEL_WIDTH, QUAD = int4.PANEL_WIDTH, int4.QUAD  # int4's panels and quads: the 4-bit codes share its layout
ACTIVATION_BLOCK = 32  # K elements per activation scale (llama.cpp's q8_0 block)
SUM_BLOCK = 16  # K elements per stored sum of quantized activations (the smallest group)
PACK_ROWS = 4096  # rows decoded and packed at a time (a whole number of panels): bounds a tensor's temporaries
FLOAT_OFFSETS = -1  # the kernel's zero parameter where offsets are stored


@dataclass(frozen=True)
class BlockType:
    """How one GGUF type's blocks read: ``block`` K elements in ``size`` bytes; ``group`` K elements per
        scale; codes ``bits`` wide, stored as nibbles (4 bits), nibbles and a plane of two high bits (5 and 6)
    or bytes (8); ``zero`` the integer zero point, or
        ``FLOAT_OFFSETS``. Scales are the file's fp16 ``d`` per ``super_groups`` groups (a K-quant's 256
        elements), times each group's integer ``sub_scales`` (``u8`` 6-bit, ``s8``, or ``none``); offsets the
        same with the file's fp16 ``m`` (Q4_1) or ``-dmin`` and ``sub_offsets`` (K-quants' 6-bit ``m``)."""

    name: str
    block: int
    size: int
    group: int
    bits: int
    zero: int
    super_groups: int = 1
    sub_scales: str = "none"
    sub_offsets: bool = False

    @property
    def storage_bits(self) -> int:
        """4: nibbles; 6: nibbles and a plane of two high bits (5- and 6-bit codes); 8: bytes."""
        return 4 if self.bits == 4 else 6 if self.bits <= 6 else 8


BLOCK_TYPES = {
    t.name: t
    for t in (
        BlockType("Q4_0", 32, 18, 32, 4, 8),
        BlockType("Q4_1", 32, 20, 32, 4, FLOAT_OFFSETS),
        BlockType("Q8_0", 32, 34, 32, 8, 128),
        BlockType("Q4_K", 256, 144, 32, 4, FLOAT_OFFSETS, 8, "u8", True),
        BlockType("Q5_K", 256, 176, 32, 5, FLOAT_OFFSETS, 8, "u8", True),
        BlockType("Q6_K", 256, 210, 16, 6, 32, 16, "s8"),
    )
}
TYPES = tuple(BLOCK_TYPES)

_I64 = "int64_t"
GGUF_GEMM_ARGS = Struct(
    "kf_gguf_gemm",
    tuple(
        (name, _I64)
        for name in (
            "x",  # [m, k] rows, ldx elements apart
            "ldx",
            "packed",  # the codes (see the module's docstring)
            "high",  # 5- and 6-bit codes' high bits: uint8 [panels, k / 4, 64], or 0
            "scales",  # fp16 [panels, super-blocks, 64]
            "offsets",  # fp16 [panels, super-blocks, 64], or 0 with an integer zero
            "sub_scales",  # uint8 / int8 [panels, groups, 64], or 0
            "sub_offsets",  # uint8 [panels, groups, 64], or 0
            "bias",  # fp32 [n] or 0
            "out",  # [m, n] rows, ldo elements apart
            "ldo",
            "m",
            "n",
            "k",
            "quantize",  # 1: quantize x into q first; 0: q already holds it (a later part of one call)
            "q",  # uint8 [m, k] scratch: x quantized (int8 + 128)
            "q_scale",  # fp32 [m, k / 32] scratch
            "q_sums",  # int32 [m, k / 16] scratch
            "num_threads",
        )
    ),
)
GEMM_GGUF = Module(
    "gemm_gguf",
    "gemm_gguf.cpp.jinja",
    params={"dtype": DType(), "qtype": Enum(choices=TYPES)},
    structs=[GGUF_GEMM_ARGS],
    entries=[Entry("linear", "const kf_gguf_gemm* args", returns="int64_t")],
    tiers=ALL_TIERS,
)
STATUS = {2: "K must be a multiple of the weight's block (32 or 256 elements)"}


@packed_weight(saved_as="kernforge.ops.gemm_gguf")
class PackedGGUFWeight:
    """A GGUF weight ``[n, k]`` of type ``qtype``, packed for :func:`gguf_linear`; survives
    ``torch.save``/``torch.load``."""

    packed: torch.Tensor  # uint8 codes, their low nibbles for 5- and 6-bit types (module docstring)
    high: torch.Tensor | None  # uint8 [panels, k / 4, 64]: 5- and 6-bit codes' high bits, else None
    scales: torch.Tensor  # fp16 [panels, k / (group_size * super_groups), 64]: the file's d
    offsets: torch.Tensor | None  # fp16 like scales (m, or -dmin); None where the type has an integer zero
    sub_scales: torch.Tensor | None  # uint8 / int8 [panels, k / group_size, 64] (K-quants), else None
    sub_offsets: torch.Tensor | None  # uint8 like sub_scales (Q4_K, Q5_K), else None
    qtype: str
    n: int
    k: int
    layout_version: int = LAYOUT_VERSION

    @property
    def block_type(self) -> BlockType:
        return BLOCK_TYPES[self.qtype]

    @property
    def group_size(self) -> int:
        return self.block_type.group

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the weight holds (what it weighs in memory, and reads per token)."""
        return [t for t in (getattr(self, name) for name in _TENSOR_FIELDS) if t is not None]


# PackedGGUFWeight's tensors, all panel-major along their first dimension
_TENSOR_FIELDS = ("packed", "high", "scales", "offsets", "sub_scales", "sub_offsets")


class Blocks(NamedTuple):
    """A tensor's blocks, decoded as they are stored: ``codes`` uint8 ``[rows, k]``; per super-block the
    file's fp16 ``d`` and ``base`` (``m`` or ``-dmin``; None with an integer zero) as fp32 ``[rows, S]``;
    per group the integer ``sub_scales`` and ``sub_offsets`` ``[rows, G]`` (None where the type has none)."""

    codes: torch.Tensor
    d: torch.Tensor
    base: torch.Tensor | None
    sub_scales: torch.Tensor | None
    sub_offsets: torch.Tensor | None

    @classmethod
    def of(cls, fields: Iterable[torch.Tensor | None]) -> Blocks:
        """The five fields in order (codes and d are never None: every type stores them)."""
        codes, d, base, sub_scales, sub_offsets = fields
        assert codes is not None and d is not None, "every block type stores codes and d"
        return cls(codes, d, base, sub_scales, sub_offsets)

    def scales_and_offsets(self, bt: BlockType) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``[rows, G]`` each: the weight is ``scale * code + offset`` per group (products exact in
        fp32: ``d`` has 11 significant bits, a sub-scale at most 8)."""
        d = self.d.repeat_interleave(bt.super_groups, dim=1)
        scales = d if self.sub_scales is None else d * self.sub_scales.to(torch.float32)
        if self.base is None:
            return scales, -bt.zero * scales
        base = self.base.repeat_interleave(bt.super_groups, dim=1)
        return scales, base if self.sub_offsets is None else base * self.sub_offsets.to(torch.float32)


# --------------------------------------------------------------------------- llama.cpp's blocks


def block_type(qtype: object) -> BlockType:
    """The :class:`BlockType` of ``qtype`` (a name such as ``"Q4_K"`` or a ``gguf.GGMLQuantizationType``)."""
    name = getattr(qtype, "name", qtype)
    if name not in BLOCK_TYPES:
        raise ValueError(f"qtype: GGUF tensor type {name!r} is not taken; kernforge reads {', '.join(TYPES)}")
    return BLOCK_TYPES[name]


def read_blocks(data: torch.Tensor, qtype: object, k: int) -> Blocks:
    """``data`` uint8 ``[rows, row bytes]`` of a ``qtype`` tensor with ``k`` elements per row, decoded
    (:class:`Blocks`), every value as llama.cpp's ``ggml-common.h`` lays it out."""
    bt = block_type(qtype)
    check_cpu_tensor(data, "data")
    if data.dtype is not torch.uint8:
        raise TypeError(f"data has dtype {data.dtype}; expected torch.uint8 (a GGUF tensor's bytes)")
    if k % bt.block:
        raise ValueError(f"k = {k}: a {bt.name} row holds whole blocks of {bt.block} elements; {k} does not split")
    rows = data.shape[0] if data.dim() else 0
    row_bytes = k // bt.block * bt.size
    if data.dim() != 2 or data.shape[1] != row_bytes:
        raise ValueError(
            f"data must be [rows, {row_bytes}] ({k // bt.block} {bt.name} blocks a row), got {tuple(data.shape)}"
        )
    blocks = k // bt.block  # a row's
    decoded = _DECODERS[bt.name](data.contiguous().view(rows * blocks, bt.size))
    return Blocks.of(None if t is None else t.reshape(rows, blocks * t.shape[1]) for t in decoded)  # no rows: no -1


def decode_blocks(data: torch.Tensor, qtype: object, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes uint8 [rows, k], scales fp32 [rows, k / group], offsets fp32 [rows, k / group])`` of a
    ``qtype`` tensor's bytes ``data [rows, row bytes]``: the weight is ``scales * codes + offsets`` per
    group, exactly llama.cpp's values."""
    blocks = read_blocks(data, qtype, k)
    return (blocks.codes, *blocks.scales_and_offsets(block_type(qtype)))


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte ``start`` of each block, as fp32 [blocks, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles_split(qs: torch.Tensor) -> torch.Tensor:
    """bytes [..., c] -> codes [..., 2 c]: the low nibbles, then the high ones (ggml's order within a run)."""
    return torch.cat((qs & 0xF, qs >> 4), dim=-1)


_Decoded = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def _q4_0(blocks: torch.Tensor) -> _Decoded:
    return _nibbles_split(blocks[:, 2:]), _half(blocks, 0), None, None, None


def _q4_1(blocks: torch.Tensor) -> _Decoded:
    return _nibbles_split(blocks[:, 4:]), _half(blocks, 0), _half(blocks, 2), None, None


def _q8_0(blocks: torch.Tensor) -> _Decoded:
    return blocks[:, 2:] ^ 0x80, _half(blocks, 0), None, None, None  # int8 q's bits ^ 0x80: q + 128


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's get_scale_min_k4 for all 8 sub-blocks: 12 bytes -> (sc [b, 8], m [b, 8]) uint8, 6 bits each."""
    d, m, both = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (both & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mn = torch.cat((m & 0x3F, (both >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc, mn


def _k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K's 128 bytes -> 256 4-bit values: each 32 bytes hold sub-block 2i (low nibbles) and 2i + 1."""
    return _nibbles_split(qs.reshape(-1, 4, 32)).reshape(-1, 256)


def _q4_k(blocks: torch.Tensor) -> _Decoded:
    sc, mn = _k_scales(blocks[:, 4:16])
    return _k_low_nibbles(blocks[:, 16:]), _half(blocks, 0), -_half(blocks, 2), sc, mn


def _q5_k(blocks: torch.Tensor) -> _Decoded:
    sc, mn = _k_scales(blocks[:, 4:16])
    qh = blocks[:, 16:48]  # bit j of byte l: the fifth bit of sub-block j's element l
    high = torch.stack([(qh >> j) & 1 for j in range(8)], dim=1).reshape(-1, 256)
    codes = _k_low_nibbles(blocks[:, 48:]) | (high << 4)
    return codes, _half(blocks, 0), -_half(blocks, 2), sc, mn


def _q6_k(blocks: torch.Tensor) -> _Decoded:
    ql, qh = blocks[:, 0:128].reshape(-1, 2, 64), blocks[:, 128:192].reshape(-1, 2, 1, 32)
    low = torch.cat((ql & 0xF, ql >> 4), dim=-1).reshape(-1, 2, 4, 32)  # per half: l, l + 32, +64, +96
    high = torch.cat([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], dim=2)
    codes = (low | (high << 4)).reshape(-1, 256)
    return codes, _half(blocks, 208), None, blocks[:, 192:208].view(torch.int8), None


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def _values(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group: int) -> torch.Tensor:
    """``scale * code + offset`` per group, exact in float64, rounded once to fp32 (llama.cpp's values)."""
    rows, k = codes.shape
    values = codes.view(rows, k // group, group).double() * scales[..., None].double() + offsets[..., None].double()
    return values.reshape(rows, k).to(torch.float32)


def dequantize_rows(data: torch.Tensor, qtype: object, k: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``rows`` (int64 indices; all if None) of a ``qtype`` tensor ``data [n, row bytes]`` as fp32
    ``[len(rows), k]``: ``scale * code + offset``, exactly llama.cpp's values.

    A row index outside ``[0, n)`` raises ValueError (torch's indexing would wrap a negative one)."""
    if rows is not None:
        check_cpu_tensor(data, "data")
        _check_row_ids(rows, "rows", data.shape[0] if data.dim() else 0)
    codes, scales, offsets = decode_blocks(data if rows is None else data[rows], qtype, k)
    return _values(codes, scales, offsets, block_type(qtype).group)


export("dequantize_rows", dequantize_rows)


# --------------------------------------------------------------------------- packing


def pack_gguf(data: torch.Tensor, qtype: object, n: int, k: int) -> PackedGGUFWeight:
    """A ``qtype`` tensor of ``n`` rows of ``k`` (``data``: its bytes, ``[n, row bytes]`` uint8 or flat)
    packed for :func:`gguf_linear`."""
    bt = block_type(qtype)
    if n < 1 or k < 1:
        raise ValueError(f"n and k must be positive, got {n}, {k}")
    check_cpu_tensor(data, "data")
    if data.dim() == 1 and data.numel() % n == 0:
        data = data.view(n, -1)
    if data.dim() != 2 or data.shape[0] != n:
        raise ValueError(f"data must hold the weight's n = {n} rows, got shape {tuple(data.shape)}")
    if n <= PACK_ROWS:
        return pack_blocks(read_blocks(data, bt.name, k), bt.name)
    pieces = (pack_blocks(read_blocks(data[r : r + PACK_ROWS], bt.name, k), bt.name) for r in range(0, n, PACK_ROWS))
    return _stacked_panels(pieces, n)


def _stacked_panels(pieces: Iterable[PackedGGUFWeight], n: int) -> PackedGGUFWeight:
    """Weights packed from consecutive runs of rows (all but the last whole panels), as one: each piece
    copied into tensors allocated once (a large tensor's temporaries are one run's, not the whole
    tensor's)."""
    first: PackedGGUFWeight | None = None
    panel = 0
    out: dict[str, torch.Tensor | None] = {}
    for piece in pieces:
        if first is None:
            first = piece
            panels = -(-n // PANEL_WIDTH)
            for name in _TENSOR_FIELDS:
                t = getattr(piece, name)
                out[name] = None if t is None else t.new_empty((panels, *t.shape[1:]))
        count = piece.packed.shape[0]
        for name in _TENSOR_FIELDS:
            target = out[name]
            if target is not None:
                target[panel : panel + count] = getattr(piece, name)
        panel += count
    assert first is not None
    return PackedGGUFWeight(**out, qtype=first.qtype, n=n, k=first.k)  # type: ignore[arg-type]


def pack_blocks(blocks: Blocks, qtype: object) -> PackedGGUFWeight:
    """Decoded blocks (:func:`read_blocks`, :func:`unpack_blocks`) packed for :func:`gguf_linear`: the
    codes in panels, d and m as the file's fp16, the sub-scales as their bytes (nothing rounded)."""
    bt = block_type(qtype)
    n, k = blocks.codes.shape
    codes = blocks.codes
    packed = _pack_bytes(codes) if bt.storage_bits == 8 else int4.pack_nibbles(codes & 0xF)
    high = _pack_high_bits(codes >> 4) if bt.storage_bits == 6 else None

    def panels(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        return None if t is None else _panel_major(t, dtype)

    sub_dtype = torch.int8 if bt.sub_scales == "s8" else torch.uint8
    return PackedGGUFWeight(
        packed,
        high,
        _panel_major(blocks.d, torch.float16),
        panels(blocks.base, torch.float16),
        panels(blocks.sub_scales, sub_dtype),
        panels(blocks.sub_offsets, torch.uint8),
        bt.name,
        int(n),
        int(k),
    )


def concatenated(weights: list[PackedGGUFWeight]) -> PackedGGUFWeight:
    """One weight whose output is ``weights``' outputs side by side (q|k|v, gate|up), all of one type."""
    if len({w.qtype for w in weights}) != 1 or len({w.k for w in weights}) != 1:
        raise ValueError("weights concatenated along N share their type and K")
    if all(w.n % PANEL_WIDTH == 0 for w in weights[:-1]):  # whole panels: the packed tensors concatenate
        return _stacked_panels(weights, sum(w.n for w in weights))
    parts = [unpack_blocks(w) for w in weights]
    fused = Blocks.of(None if field[0] is None else torch.cat(field) for field in zip(*parts))
    return pack_blocks(fused, weights[0].qtype)


def embedding_rows(w: PackedGGUFWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (int64, any shape) of the weight, fp32 ``[*ids.shape, K]``, read from the packed
    layout (a tied embedding and lm_head share one packed copy; only the looked-up rows are decoded).

    An id outside ``[0, n)`` raises ValueError (the packed panels' padding rows and torch's wrapping
    of negative indices would read rows the weight does not have)."""
    (w,) = _checked_parts(w)
    _check_row_ids(ids, "ids", w.n)
    flat = ids.reshape(-1).long()
    panel, column = flat // PANEL_WIDTH, flat % PANEL_WIDTH
    quads = torch.arange(w.k // QUAD)[None, :, None]
    if w.block_type.storage_bits == 8:
        codes = w.packed[panel[:, None, None], quads, (column * QUAD)[:, None, None] + torch.arange(QUAD)]
    else:  # int4's chunk layout: byte 64 c + 4 (j % 16) + i, low or high nibble
        chunk, within = column // int4.CHUNK, column % int4.CHUNK
        start = chunk * 64 + (within % 16) * QUAD
        words = w.packed[panel[:, None, None], quads, start[:, None, None] + torch.arange(QUAD)]
        codes = torch.where((within >= 16)[:, None, None], words >> 4, words & 0xF)
    if w.high is not None:  # byte 4 (j % 16) + i, bits 2 (j / 16)
        high = w.high[panel[:, None, None], quads, ((column % 16) * QUAD)[:, None, None] + torch.arange(QUAD)]
        codes = codes | (((high >> (2 * (column // 16))[:, None, None]) & 3) << 4)

    def rows(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[panel, :, column]

    blocks = Blocks.of((codes.reshape(-1, w.k), *(rows(t) for t in _factors(w))))
    values = _values(blocks.codes, *blocks.scales_and_offsets(w.block_type), w.group_size)
    return values.reshape(*ids.shape, w.k)


def _pack_bytes(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [N, K] -> [panels, K / 4, 256]: column j of a panel, K 4q..4q+3, at bytes 4 j of quad q."""
    k = codes.shape[1]
    padded = int4.padded_to_panels(codes)
    panels = padded.shape[0] // PANEL_WIDTH
    return (
        padded.view(panels, PANEL_WIDTH, k // QUAD, QUAD)
        .permute(0, 2, 1, 3)
        .reshape(panels, k // QUAD, -1)
        .contiguous()
    )


_HIGH_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]  # a high-plane byte's four 2-bit fields


def _pack_high_bits(high: torch.Tensor) -> torch.Tensor:
    """Two-bit values [N, K] -> uint8 [panels, K / 4, 64]: column j of a panel, K 4q + i, at bits
    2 (j / 16) of byte 4 (j % 16) + i of quad q (a vector of 16 columns' words takes one field)."""
    k = high.shape[1]
    padded = int4.padded_to_panels(high)
    panels = padded.shape[0] // PANEL_WIDTH
    fields = padded.view(panels, 4, 16, k // QUAD, QUAD).permute(0, 3, 1, 2, 4).reshape(panels, k // QUAD, 4, 64)
    return (fields << _HIGH_SHIFTS).sum(dim=2, dtype=torch.uint8)  # the fields' bits are disjoint


def _unpack_high_bits(plane: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """:func:`_pack_high_bits` undone: uint8 [n, k]."""
    panels = plane.shape[0]
    fields = (plane[:, :, None, :] >> _HIGH_SHIFTS) & 3  # [panel, quad, field, 64]
    return fields.view(panels, k // QUAD, 4, 16, QUAD).permute(0, 2, 3, 1, 4).reshape(-1, k)[:n]


def _panel_major(per_row: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, C] -> ``dtype`` [panels, C, 64], columns past N zero."""
    count = per_row.shape[1]
    padded = int4.padded_to_panels(per_row, dtype)
    return padded.view(-1, PANEL_WIDTH, count).permute(0, 2, 1).contiguous()


def _row_major(panel_major: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """:func:`_panel_major` undone, fp32 (or the integers as they are) ``[n, C]``."""
    if panel_major is None:
        return None
    rows = panel_major.permute(0, 2, 1).reshape(-1, panel_major.shape[1])[:n]
    return rows.float() if rows.is_floating_point() else rows


def _factors(w: PackedGGUFWeight) -> tuple[torch.Tensor | None, ...]:
    """The packed (d, base, sub_scales, sub_offsets), in the panel-major layout."""
    return w.scales, w.offsets, w.sub_scales, w.sub_offsets


def unpack_blocks(w: PackedGGUFWeight) -> Blocks:
    """:func:`pack_blocks` undone."""
    n, k = w.n, w.k
    if w.block_type.storage_bits == 8:
        panels = w.packed.shape[0]
        codes = w.packed.view(panels, k // QUAD, PANEL_WIDTH, QUAD).permute(0, 2, 1, 3).reshape(-1, k)[:n]
    else:
        codes = int4.unpack_nibbles(w.packed, n, k)
    if w.high is not None:
        codes = codes | (_unpack_high_bits(w.high, n, k) << 4)
    return Blocks.of((codes, *(_row_major(t, n) for t in _factors(w))))


def unpack_gguf(w: PackedGGUFWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes uint8 [N, K], scales fp32 [N, G], offsets fp32 [N, G])``: the weight is ``scales * codes +
    offsets`` per group (offsets ``-zero * scales`` where the type keeps none)."""
    blocks = unpack_blocks(w)
    return (blocks.codes, *blocks.scales_and_offsets(w.block_type))


def dequantize(w: PackedGGUFWeight) -> torch.Tensor:
    """The weight ``[N, K]`` fp32 a packed one stands for (llama.cpp's dequantization, bit for bit)."""
    return _values(*unpack_gguf(w), w.group_size)


export("pack_gguf", pack_gguf)
export("embedding_rows", embedding_rows)


# --------------------------------------------------------------------------- the op


@kernel_op(GEMM_GGUF, qtype="Q4_0")
def gguf_linear(
    x: torch.Tensor, w: PackedGGUFWeight | Sequence[PackedGGUFWeight], bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [..., K]`` (bf16, fp16, fp32) times the GGUF weight ``w`` (``[N, K]``, from :func:`pack_gguf`),
    ``+ bias`` (fp32 ``[N]``) -> ``[..., N]`` in ``x``'s dtype; ``x`` quantized per block of 32 to int8.
    ``w`` may be a sequence of weights with one K (a fused q|k|v whose parts have different types, as a
    Q4_K_M file's do): their outputs side by side, each part at its own type. A layer that multiplies
    by one weight many times prepares it once: :class:`GGUFLinearRunner`."""
    return GGUFLinearRunner(w, bias)(x)


class GGUFLinearRunner:
    """:func:`gguf_linear` by one weight (its parts) and bias, checked and laid out once, so that a call
    does only what depends on ``x``: its checks, the output, the kernel arguments that change (what a
    model's layer does once per token; the rest of a call's arguments live in per-thread structs)."""

    def __init__(self, w: PackedGGUFWeight | Sequence[PackedGGUFWeight], bias: torch.Tensor | None = None):
        self.parts = _checked_parts(w)
        self.k, self.n = self.parts[0].k, sum(part.n for part in self.parts)
        self.bias = checked_fp32_bias(bias, self.n)
        self._columns = [sum(part.n for part in self.parts[:i]) for i in range(len(self.parts))]
        self._variants: dict[torch.dtype, list[Any]] = {}
        self._local = threading.local()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        check_cpu_tensor(x, "x")
        if x.dtype not in DTYPE_NAMES:
            raise TypeError(f"x has dtype {x.dtype}; expected torch.bfloat16, torch.float16 or torch.float32")
        if x.dim() == 2 and x.shape[1] == self.k and x.is_contiguous():  # a layer's rows: nothing to work out
            m, x2, ldx = x.shape[0], x, self.k
        else:
            m, _, x2, ldx = matrix_rows(x, "x", self.k, "w's K")
        out = torch.empty((*x.shape[:-1], self.n), dtype=x.dtype)
        if m:
            self._run(x2, ldx, out, m)
        return out

    def _run(self, x2: torch.Tensor, ldx: int, out: torch.Tensor, m: int) -> None:
        q, q_scale, q_sums = _scratch(m, self.k)
        x_address, out_address, size, threads = x2.data_ptr(), out.data_ptr(), out.element_size(), num_threads()
        for (entry, args), column in zip(self._calls(x2.dtype), self._columns):
            args.x, args.ldx, args.out, args.m = x_address, ldx, out_address + column * size, m
            args.q, args.q_scale, args.q_sums, args.num_threads = q, q_scale, q_sums, threads
            status = entry(args)
            if status:
                raise ValueError(STATUS.get(status, f"GGUF GEMM failed with status {status}"))

    def bound(self, x: torch.Tensor, out: torch.Tensor) -> BoundCall:
        """``out = self(x)`` checked once, as a call of no arguments that multiplies whatever ``x`` holds
        when it runs (a prepared decode step's). ``x [M, K]`` and ``out [M, N]`` contiguous, one dtype.
        The call has scratch of its own: a later, larger call on this thread may move the shared one."""
        check_cpu_tensor(x, "x")
        check_cpu_tensor(out, "out")
        if x.dtype not in DTYPE_NAMES or out.dtype is not x.dtype:
            raise TypeError(f"x and out must share a dtype of bf16, fp16 or fp32, got {x.dtype} and {out.dtype}")
        if x.dim() != 2 or x.shape[1] != self.k or not x.is_contiguous():
            raise ValueError(f"x must be a contiguous [M, {self.k}], got shape {tuple(x.shape)}")
        m = x.shape[0]
        if out.shape != (m, self.n) or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous [{m}, {self.n}], got shape {tuple(out.shape)}")
        scratch = (
            torch.empty(m * self.k, dtype=torch.uint8),
            torch.empty(m * self.k // ACTIVATION_BLOCK, dtype=torch.float32),
            torch.empty(m * self.k // SUM_BLOCK, dtype=torch.int32),
        )
        q, q_scale, q_sums = (t.data_ptr() for t in scratch)
        fixed = {"x": x.data_ptr(), "ldx": self.k, "m": m, "q": q, "q_scale": q_scale, "q_sums": q_sums}
        self._calls(x.dtype)  # the variants for x's dtype
        calls = []
        for variant, part, column in zip(self._variants[x.dtype], self.parts, self._columns):
            kernel, out_address = variant.kernel(), out.data_ptr() + column * out.element_size()
            fields = {**self._weight_fields(part, column), **fixed, "out": out_address, "num_threads": num_threads()}
            calls.append((kernel.linear, kernel.new("kf_gguf_gemm", fields)))

        def call() -> None:
            for entry, args in calls:
                status = entry(args)
                if status:
                    raise ValueError(STATUS.get(status, f"GGUF GEMM failed with status {status}"))

        return BoundCall(call, x, out, *scratch)

    def _calls(self, dtype: torch.dtype) -> list[tuple[Any, Any]]:
        """This thread's (entry, argument struct) per part for ``dtype``, the weight's fields set; built
        again where the tier in use changed (each kernel has its own struct type)."""
        if dtype not in self._variants:
            self._variants[dtype] = [GEMM_GGUF.variant(dtype=DTYPE_NAMES[dtype], qtype=p.qtype) for p in self.parts]
        kernels = [variant.kernel() for variant in self._variants[dtype]]
        held = getattr(self._local, "calls", None)
        if held is None or held[0] is not dtype or any(a is not b for a, b in zip(held[1], kernels)):
            calls = [
                (kernel.linear, kernel.new("kf_gguf_gemm", self._weight_fields(part, column)))
                for kernel, part, column in zip(kernels, self.parts, self._columns)
            ]
            self._local.calls = held = (dtype, kernels, calls)
        return held[2]

    def _weight_fields(self, part: PackedGGUFWeight, column: int) -> dict[str, int]:
        return {
            "packed": part.packed.data_ptr(),
            "high": _address(part.high),
            "scales": part.scales.data_ptr(),
            "offsets": _address(part.offsets),
            "sub_scales": _address(part.sub_scales),
            "sub_offsets": _address(part.sub_offsets),
            "bias": 0 if self.bias is None else self.bias.data_ptr() + 4 * column,
            "ldo": self.n,
            "n": part.n,
            "k": part.k,
            "quantize": int(column == 0),  # the parts of one call share x's quantization: the first makes it
        }


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _checked_parts(w: object) -> list[PackedGGUFWeight]:
    parts: list[PackedGGUFWeight] = []
    for part in list(w) if isinstance(w, (list, tuple)) else [w]:
        if not isinstance(part, PackedGGUFWeight):
            raise TypeError(
                f"w must be a PackedGGUFWeight (from pack_gguf) or a list of them, got {type(part).__name__}"
            )
        parts.append(part)
        if part.layout_version != LAYOUT_VERSION:
            raise ValueError(
                f"w has layout version {part.layout_version}; this kernforge reads {LAYOUT_VERSION}: pack it again"
            )
        _check_layout(part)
    if not parts or len({part.k for part in parts}) != 1:
        raise ValueError(f"w's parts must share K, got {[part.k for part in parts]}")
    return parts


def _check_layout(w: PackedGGUFWeight) -> None:
    """The tensors of a packed weight as :func:`pack_blocks` makes them for its ``qtype``, ``n`` and
    ``k``: contiguous CPU tensors of the layout's dtypes and shapes (a hand-made or truncated one
    would have the kernel read past them)."""
    bt = block_type(w.qtype)
    if w.n < 1 or w.k < 1 or w.k % bt.block:
        raise ValueError(f"w is a [{w.n}, {w.k}] {bt.name} weight: n and k must be positive, k whole blocks")
    panels = -(-w.n // PANEL_WIDTH)
    sub = {"u8": torch.uint8, "s8": torch.int8}.get(bt.sub_scales)
    expected = {
        "packed": (torch.uint8, (panels, w.k // QUAD, (2 if bt.storage_bits == 8 else 1) * PANEL_WIDTH * QUAD // 2)),
        "high": (torch.uint8, (panels, w.k // QUAD, PANEL_WIDTH)) if bt.storage_bits == 6 else None,
        "scales": (torch.float16, (panels, w.k // (bt.group * bt.super_groups), PANEL_WIDTH)),
        "offsets": None,
        "sub_scales": None if sub is None else (sub, (panels, w.k // bt.group, PANEL_WIDTH)),
        "sub_offsets": (torch.uint8, (panels, w.k // bt.group, PANEL_WIDTH)) if bt.sub_offsets else None,
    }
    if bt.zero == FLOAT_OFFSETS:
        expected["offsets"] = expected["scales"]
    for field, layout in expected.items():
        t = getattr(w, field)
        if layout is None:
            if t is not None:
                raise ValueError(f"w.{field} must be None for a {bt.name} weight")
            continue
        dtype, shape = layout
        if not isinstance(t, torch.Tensor) or t.dtype is not dtype or not t.is_cpu or t.shape != shape:
            got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"w.{field} must be a CPU {dtype} tensor of shape {shape} for a [{w.n}, {w.k}] {bt.name} weight, "
                f"got {got}"
            )
        if not t.is_contiguous():
            raise ValueError(f"w.{field} must be contiguous (as pack_gguf makes it)")


def _check_row_ids(ids: torch.Tensor, name: str, n: int) -> None:
    """Row indices of a weight of ``n`` rows: an integer CPU tensor with every value in [0, n)."""
    check_cpu_tensor(ids, name)
    if ids.is_floating_point() or ids.is_complex() or ids.dtype is torch.bool:
        raise TypeError(f"{name} has dtype {ids.dtype}; expected an integer tensor (int64 row indices)")
    if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < n:
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise ValueError(f"{name} holds {bad}, outside the weight's rows [0, {n})")


_SCRATCH = threading.local()  # per thread: the quantized activations' buffers, grown to the largest call


def _scratch(m: int, k: int) -> tuple[int, int, int]:
    """Addresses of this thread's buffers for ``m`` rows of ``k``: q (uint8 [m, k]), their scales (fp32
    [m, k / 32]) and sums (int32 [m, k / 16]); kept between calls (a prefill's rows once grown)."""
    held = getattr(_SCRATCH, "buffers", None)
    if held is None or held[0].numel() < m * k:
        elements = max(m * k, 2 * held[0].numel() if held is not None else 0)
        held = _SCRATCH.buffers = (
            torch.empty(elements, dtype=torch.uint8),
            torch.empty(elements // ACTIVATION_BLOCK, dtype=torch.float32),
            torch.empty(elements // SUM_BLOCK, dtype=torch.int32),
        )
        _SCRATCH.addresses = tuple(t.data_ptr() for t in held)
    return _SCRATCH.addresses


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`gguf_linear` multiplies ``x [M, K]`` as: ``(q int8 [M, K], scale fp32 [M, K / 32])``,
    ``q = rint(x * (127 / amax))`` per block of 32 (the reference the tests hold the kernel to)."""
    blocks = x.to(torch.float32).reshape(x.shape[0], -1, ACTIVATION_BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    return torch.round(blocks * inverse).to(torch.int8).reshape(x.shape), (amax / 127.0).squeeze(-1)
