"""Rotary position embedding (RoPE) with FlashInfer's names, signatures and semantics.

Each token's q and k heads are rotated by angles set by the token's position. Pairs are
``(i, i + rotary_dim/2)`` in the neox style (``interleave=False``, ``is_neox=True``) and
``(2i, 2i + 1)`` interleaved; only the first ``rotary_dim`` elements of a head turn, the rest
keep their values (and are copied by the out-of-place ops). Pair ``i`` turns by
``pos * freq_i`` with ``freq_i = rope_theta ** (-2i / rotary_dim) / rope_scale``; the llama31
ops blend scaled and unscaled frequencies by wavelength (Llama 3.1, FlashInfer's formula); the
``cos_sin_cache`` ops read ``cos | sin`` halves from row ``pos`` of a float32
``[max_position, rotary_dim]`` cache instead. Frequencies are formed in double and rounded to
fp32 once; the angle is ``float(pos) * freq`` in fp32 (as FlashInfer), its cos/sin fp32; the
rotation is fp32 for every q/k dtype.

Positions: ``pos_ids`` / ``positions`` int32 or int64 ``[nnz]``; the ragged ops take
``indptr`` ``[batch + 1]`` (from 0 to nnz, non-decreasing) and ``offsets`` ``[batch]`` of one
dtype, token ``t`` of request ``b`` being at ``offsets[b] + t - indptr[b]``. Positions outside
the cache and a bad ``indptr`` raise ValueError, found by the kernel before it writes anything.

The in-place ops write through views: q and k may be slices of a packed qkv tensor (any token
and head strides; the last dimension must be contiguous). The out-of-place ops return
``(q_rope, k_rope)`` allocated with ``torch.empty_like``, as FlashInfer does.

For other families' ops (MLA's projections rotate q_pe out of place and k_pe in place, from one
cache): :func:`cos_sin_angles` checks a cache and its positions once (:func:`checked_positions`
the positions alone) and :func:`rotate_heads` runs the kernel on ``[nnz, heads, head_dim]`` views.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernforge.jit.module import DType, Entry, Module, Struct
from kernforge.ops._common import BoundCall, _overlaps, check_no_overlap, num_threads, same_dtype, variant_for_input
from kernforge.ops._registry import Traced, kernel_op, model_kernels

_I = "int64_t"
# q/k: rows of head_dim elements at token and head strides, read at q / k and written at q_out /
# k_out (the same addresses in place). Positions: pos_ids, else the ragged indptr + offsets.
# Angles: rows of cos_sin_cache, else frequencies from the rope_* parameters. Filled by name per
# call (_run); a field a form does not use stays 0.
ROPE_ARGS = Struct(
    "kf_rope_args",
    (
        ("q", _I),
        ("q_s0", _I),
        ("q_s1", _I),
        ("num_q_heads", _I),
        ("k", _I),
        ("k_s0", _I),
        ("k_s1", _I),
        ("num_k_heads", _I),
        ("q_out", _I),
        ("q_out_s0", _I),
        ("q_out_s1", _I),
        ("k_out", _I),
        ("k_out_s0", _I),
        ("k_out_s1", _I),
        ("nnz", _I),
        ("head_dim", _I),
        ("rotary_dim", _I),
        ("interleave", _I),
        ("pos_ids", _I),
        ("pos_ids_64", _I),
        ("indptr", _I),
        ("offsets", _I),
        ("batch", _I),
        ("segments_64", _I),
        ("cos_sin_cache", _I),
        ("cache_rows", _I),
        ("cache_stride", _I),
        ("rope_scale", "double"),
        ("rope_theta", "double"),
        ("llama31", _I),
        ("low_freq_factor", "double"),
        ("high_freq_factor", "double"),
        ("old_context_len", "double"),
        ("num_threads", _I),
    ),
)
ROPE = Module(
    "rope",
    "rope.cpp.jinja",
    params={"dtype": DType()},
    structs=[ROPE_ARGS],
    entries=[Entry("run", "const kf_rope_args* args", returns="int64_t")],
)

# Kernel errors: (kind << 32) | index (kf::rope::ErrorKind).
_POSITION_OUT_OF_RANGE, _BAD_INDPTR = 1, 2


# --------------------------------------------------------------------------- FlashInfer's ops


def _like_q_and_k(q, k, *args, **kwargs):  # the out-of-place custom ops' outputs
    return torch.empty_like(q), torch.empty_like(k)


def _like_query_and_key(positions, query, key, *args, **kwargs):
    return torch.empty_like(query), torch.empty_like(key)


_ROTATES = Traced("(Tensor, Tensor)", fake=_like_q_and_k)
_ROTATES_IN_PLACE = Traced(writes=("q", "k"))


@kernel_op(ROPE, traced=Traced(writes=("query", "key")))
def apply_rope_with_cos_sin_cache_inplace(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """In place on ``query`` ``[nnz, num_q_heads * head_size]`` and ``key`` ``[nnz, num_k_heads *
    head_size]``, with cos/sin from ``cos_sin_cache[positions]`` (float32 ``[max_position,
    rotary_dim]``: cos in the first half, sin in the second)."""
    _with_cos_sin_cache(
        apply_rope_with_cos_sin_cache_inplace.kernels, positions, query, key, head_size, cos_sin_cache, is_neox, True
    )


@kernel_op(ROPE, traced=Traced("(Tensor, Tensor)", fake=_like_query_and_key))
def apply_rope_with_cos_sin_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out of place: returns ``(query_out, key_out)``."""
    return _with_cos_sin_cache(
        apply_rope_with_cos_sin_cache.kernels, positions, query, key, head_size, cos_sin_cache, is_neox, False
    )


@kernel_op(ROPE, traced=_ROTATES_IN_PLACE)
def apply_rope_pos_ids_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    pos_ids: torch.Tensor,
    rotary_dim: int | None = None,
    interleave: bool = False,
    rope_scale: float = 1,
    rope_theta: float = 1e4,
) -> None:
    """In place on ``q`` ``[nnz, num_q_heads, head_dim]`` and ``k`` ``[nnz, num_k_heads, head_dim]``."""
    _with_pos_ids(
        apply_rope_pos_ids_inplace.kernels,
        q,
        k,
        pos_ids,
        rotary_dim,
        interleave,
        _frequencies(rope_scale, rope_theta),
        True,
    )


@kernel_op(ROPE, traced=_ROTATES)
def apply_rope_pos_ids(
    q: torch.Tensor,
    k: torch.Tensor,
    pos_ids: torch.Tensor,
    rotary_dim: int | None = None,
    interleave: bool = False,
    rope_scale: float = 1,
    rope_theta: float = 1e4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out of place: returns ``(q_rope, k_rope)``."""
    return _with_pos_ids(
        apply_rope_pos_ids.kernels, q, k, pos_ids, rotary_dim, interleave, _frequencies(rope_scale, rope_theta), False
    )


@kernel_op(ROPE, traced=_ROTATES_IN_PLACE)
def apply_llama31_rope_pos_ids_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    pos_ids: torch.Tensor,
    rotary_dim: int | None = None,
    interleave: bool = False,
    rope_scale: float = 8,
    rope_theta: float = 5e5,
    low_freq_factor: float = 1,
    high_freq_factor: float = 4,
    old_context_len: int = 8192,
) -> None:
    """Llama 3.1 RoPE, in place."""
    _with_pos_ids(
        apply_llama31_rope_pos_ids_inplace.kernels,
        q,
        k,
        pos_ids,
        rotary_dim,
        interleave,
        _llama31_frequencies(rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len),
        True,
    )


@kernel_op(ROPE, traced=_ROTATES)
def apply_llama31_rope_pos_ids(
    q: torch.Tensor,
    k: torch.Tensor,
    pos_ids: torch.Tensor,
    rotary_dim: int | None = None,
    interleave: bool = False,
    rope_scale: float = 8,
    rope_theta: float = 5e5,
    low_freq_factor: float = 1,
    high_freq_factor: float = 4,
    old_context_len: int = 8192,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 3.1 RoPE, out of place: returns ``(q_rope, k_rope)``."""
    return _with_pos_ids(
        apply_llama31_rope_pos_ids.kernels,
        q,
        k,
        pos_ids,
        rotary_dim,
        interleave,
        _llama31_frequencies(rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len),
        False,
    )


@kernel_op(ROPE, traced=_ROTATES_IN_PLACE)
def apply_rope_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    indptr: torch.Tensor,
    offsets: torch.Tensor,
    rotary_dim: int | None = None,
    interleave: bool = False,
    rope_scale: float = 1,
    rope_theta: float = 1e4,
) -> None:
    """Ragged batch, in place: request ``b`` holds tokens ``indptr[b]:indptr[b+1]`` from position ``offsets[b]``."""
    _with_segments(
        apply_rope_inplace.kernels,
        q,
        k,
        indptr,
        offsets,
        rotary_dim,
        interleave,
        _frequencies(rope_scale, rope_theta),
        True,
    )


@kernel_op(ROPE, traced=_ROTATES)
def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    indptr: torch.Tensor,
    offsets: torch.Tensor,
    rotary_dim: int | None = None,
    interleave: bool = False,
    rope_scale: float = 1,
    rope_theta: float = 1e4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged batch, out of place: returns ``(q_rope, k_rope)``."""
    return _with_segments(
        apply_rope.kernels, q, k, indptr, offsets, rotary_dim, interleave, _frequencies(rope_scale, rope_theta), False
    )


@kernel_op(ROPE, traced=_ROTATES_IN_PLACE)
def apply_llama31_rope_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    indptr: torch.Tensor,
    offsets: torch.Tensor,
    rotary_dim: int | None = None,
    interleave: bool = False,
    rope_scale: float = 8,
    rope_theta: float = 5e5,
    low_freq_factor: float = 1,
    high_freq_factor: float = 4,
    old_context_len: int = 8192,
) -> None:
    """Llama 3.1 RoPE on a ragged batch, in place."""
    _with_segments(
        apply_llama31_rope_inplace.kernels,
        q,
        k,
        indptr,
        offsets,
        rotary_dim,
        interleave,
        _llama31_frequencies(rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len),
        True,
    )


@kernel_op(ROPE, traced=_ROTATES)
def apply_llama31_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    indptr: torch.Tensor,
    offsets: torch.Tensor,
    rotary_dim: int | None = None,
    interleave: bool = False,
    rope_scale: float = 8,
    rope_theta: float = 5e5,
    low_freq_factor: float = 1,
    high_freq_factor: float = 4,
    old_context_len: int = 8192,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 3.1 RoPE on a ragged batch, out of place: returns ``(q_rope, k_rope)``."""
    return _with_segments(
        apply_llama31_rope.kernels,
        q,
        k,
        indptr,
        offsets,
        rotary_dim,
        interleave,
        _llama31_frequencies(rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len),
        False,
    )


# --------------------------------------------------------------------------- for other families


@dataclass(frozen=True)
class CosSinAngles:
    """Angles from a cos/sin cache, checked once (:func:`cos_sin_angles`): what :func:`rotate_heads` reads."""

    cache: torch.Tensor  # float32 [rows, rotary_dim] (cos | sin halves), rows row_stride elements apart
    rotary_dim: int
    rows: int
    row_stride: int
    positions: torch.Tensor  # int32 or int64 [nnz], contiguous: token t turns by cache row positions[t]
    positions_64: int  # 1 if positions are int64


def checked_positions(positions, nnz: int | None = None, name: str = "positions") -> torch.Tensor:
    """``positions`` as the RoPE kernel reads them: a 1-D int32 or int64 CPU tensor (of ``nnz``
    entries if given), contiguous (a strided one is copied); TypeError or ValueError naming ``name``
    otherwise. Their range is the kernel's to check (against the cache's rows, before it writes)."""
    return _index_tensor(positions, name, nnz)[0]


def cos_sin_angles(positions, cos_sin_cache, nnz: int | None = None) -> CosSinAngles:
    """The angles of the ``cos_sin_cache`` ops for :func:`rotate_heads`, checked as those ops check
    them: ``cos_sin_cache`` float32 ``[max_position, rotary_dim]`` (even rotary_dim; a strided last
    dimension is copied), then ``positions`` as :func:`checked_positions`."""
    cache, rotary_dim, rows, row_stride = _checked_cache(cos_sin_cache)
    positions, positions_64 = _index_tensor(positions, "positions", nnz)
    return CosSinAngles(cache, rotary_dim, rows, row_stride, positions, positions_64)


def rotate_heads(
    q: torch.Tensor,
    q_out: torch.Tensor,
    k: torch.Tensor,
    k_out: torch.Tensor,
    angles: CosSinAngles,
    interleave: bool = False,
) -> None:
    """One RoPE kernel call on heads held as views, for ops of other families (MLA's projections):
    ``q_out = rope(q)`` and ``k_out = rope(k)``, each ``[nnz, heads, head_dim]`` at any token and head
    strides with a contiguous last dimension, an output either its input (in place) or memory of its
    own. The first ``angles.rotary_dim`` elements of each head turn (neox halves, or interleaved
    pairs), the rest are copied; a position beyond the cache raises ValueError before anything is
    written (the ``cos_sin_cache`` ops are this call on FlashInfer's argument forms)."""
    variant = variant_for_input(apply_rope_with_cos_sin_cache.kernels, q, "q")
    same_dtype(k, "k", q, "q")
    qg, kg = _heads(q, "q"), _heads(k, "k")
    _same_tokens(qg, kg, "q", "k")
    qog = qg if q_out is q else _output_heads(q_out, "q_out", qg, q)
    kog = kg if k_out is k else _output_heads(k_out, "k_out", kg, q)
    _check_writable(qog, "q_out")
    _check_writable(kog, "k_out")
    if angles.positions.shape[0] != qg[0]:
        raise ValueError(f"angles hold {angles.positions.shape[0]} positions for {qg[0]} tokens of q")
    if angles.rotary_dim > qg[2]:
        raise ValueError(f"the cache's rotary_dim ({angles.rotary_dim}) exceeds q's head_dim ({qg[2]})")
    fields = _cache_fields(angles.cache, angles.rows, angles.row_stride, angles.positions, angles.positions_64)
    status = _run(variant, q, qg, k, kg, (q_out, qog, k_out, kog), angles.rotary_dim, interleave, fields)
    if status:
        _raise_kernel_error(status, positions=angles.positions, cache_rows=angles.rows)


def _output_heads(out, name: str, geometry, q):
    """The geometry of an output with memory of its own, for heads of ``geometry`` (q's dtype)."""
    same_dtype(out, name, q, "q")
    out_geometry = _heads(out, name)
    if out_geometry[:3] != geometry[:3]:
        raise ValueError(f"{name} must have shape {geometry[:3]} (its input's), got {out_geometry[:3]}")
    return out_geometry


# --------------------------------------------------------------------------- the three forms


def _with_cos_sin_cache(kernels, positions, query, key, head_size, cos_sin_cache, is_neox, in_place):
    call, outputs = _cos_sin_cache_call(kernels, positions, query, key, head_size, cos_sin_cache, is_neox, in_place)
    call()
    return None if in_place else (outputs[0], outputs[2])


def bound_rope_with_cos_sin_cache_inplace(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> BoundCall:
    """``apply_rope_with_cos_sin_cache_inplace(...)`` checked once, as a call of no arguments that
    rotates the same tensors by the values ``positions`` holds when it runs (a prepared decode step
    writes each step's positions into it)."""
    if isinstance(positions, torch.Tensor) and not positions.is_contiguous():
        raise ValueError("positions must be contiguous: the bound call reads the values it holds when it runs")
    kernels = apply_rope_with_cos_sin_cache_inplace.kernels
    return _cos_sin_cache_call(kernels, positions, query, key, head_size, cos_sin_cache, is_neox, True)[0]


def _cos_sin_cache_call(kernels, positions, query, key, head_size, cos_sin_cache, is_neox, in_place):
    """(the checked kernel call, raising on a bad position; the outputs and their geometries)."""
    cache, rotary_dim, cache_rows, cache_stride = _checked_cache(cos_sin_cache)  # FlashInfer checks it first
    variant = variant_for_input(kernels, query, "query")
    same_dtype(key, "key", query, "query")
    if isinstance(head_size, bool) or not isinstance(head_size, int) or head_size < 1:
        raise ValueError(f"head_size must be a positive int, got {head_size!r}")
    if rotary_dim > head_size:
        raise ValueError(
            f"cos_sin_cache's rotary_dim ({rotary_dim}, its last dimension) exceeds head_size ({head_size})"
        )
    qg, kg = _packed_heads(query, head_size, "query"), _packed_heads(key, head_size, "key")
    _same_tokens(qg, kg, "query", "key")
    positions, positions_64 = _index_tensor(positions, "positions", qg[0])
    outputs = _outputs(
        query, qg, key, kg, in_place, ("query", "key"), lambda t, name: _packed_heads(t, head_size, name)
    )
    angles = _cache_fields(cache, cache_rows, cache_stride, positions, positions_64)
    run = _call(variant, query, qg, key, kg, outputs, rotary_dim, not is_neox, angles)

    def call() -> None:
        status = run()
        if status:
            _raise_kernel_error(status, positions=positions, cache_rows=cache_rows)

    # held with the tensors its addresses point into (the cache and positions may be copies)
    return BoundCall(call, cache, positions, query, key, outputs[0], outputs[2]), outputs


def _with_pos_ids(kernels, q, k, pos_ids, rotary_dim, interleave, frequencies, in_place):
    variant, qg, kg, rotary_dim = _checked_qk(kernels, q, k, rotary_dim)
    pos_ids, pos_ids_64 = _index_tensor(pos_ids, "pos_ids", qg[0])
    outputs = _outputs(q, qg, k, kg, in_place, ("q", "k"), _heads)
    frequencies["pos_ids"], frequencies["pos_ids_64"] = pos_ids.data_ptr(), pos_ids_64
    _run(variant, q, qg, k, kg, outputs, rotary_dim, interleave, frequencies)
    return None if in_place else (outputs[0], outputs[2])


def _with_segments(kernels, q, k, indptr, offsets, rotary_dim, interleave, frequencies, in_place):
    variant, qg, kg, rotary_dim = _checked_qk(kernels, q, k, rotary_dim)
    offsets, segments_64 = _index_tensor(offsets, "offsets")
    batch = offsets.shape[0]
    indptr, indptr_64 = _index_tensor(indptr, "indptr", batch + 1)
    if indptr_64 != segments_64:
        raise TypeError(f"indptr ({indptr.dtype}) and offsets ({offsets.dtype}) must have the same dtype")
    outputs = _outputs(q, qg, k, kg, in_place, ("q", "k"), _heads)
    frequencies.update(indptr=indptr.data_ptr(), offsets=offsets.data_ptr(), batch=batch, segments_64=segments_64)
    status = _run(variant, q, qg, k, kg, outputs, rotary_dim, interleave, frequencies)
    if status:
        _raise_kernel_error(status, indptr=indptr, nnz=qg[0])
    return None if in_place else (outputs[0], outputs[2])


def _run(variant, q, qg, k, kg, outputs, rotary_dim, interleave, source: dict) -> int:
    """One kernel call; returns its status (0, or an error for _raise_kernel_error). ``source``: the
    fields of ROPE_ARGS that say where the positions and the angles come from (the others are q's and
    k's, set here; a field left out is 0)."""
    return _call(variant, q, qg, k, kg, outputs, rotary_dim, interleave, source)()


def _call(variant, q, qg, k, kg, outputs, rotary_dim, interleave, source: dict) -> Callable[[], int]:
    """:func:`_run`'s kernel call, its argument struct filled, not yet made."""
    q_out, qog, k_out, kog = outputs
    kernel = variant.kernel()
    return functools.partial(
        kernel.run,
        kernel.new(
            "kf_rope_args",
            {
                "q": q.data_ptr(),
                "q_s0": qg[3],
                "q_s1": qg[4],
                "num_q_heads": qg[1],
                "k": k.data_ptr(),
                "k_s0": kg[3],
                "k_s1": kg[4],
                "num_k_heads": kg[1],
                "q_out": q_out.data_ptr(),
                "q_out_s0": qog[3],
                "q_out_s1": qog[4],
                "k_out": k_out.data_ptr(),
                "k_out_s0": kog[3],
                "k_out_s1": kog[4],
                "nnz": qg[0],
                "head_dim": qg[2],
                "rotary_dim": rotary_dim,
                "interleave": 1 if interleave else 0,
                "num_threads": num_threads(),
                **source,
            },
        ),
    )


def _cache_fields(cache, rows: int, row_stride: int, positions, positions_64: int) -> dict:
    """ROPE_ARGS' angles from cache rows picked by ``positions`` (the frequencies, unused then, 1)."""
    return {
        "pos_ids": positions.data_ptr(),
        "pos_ids_64": positions_64,
        "cos_sin_cache": cache.data_ptr(),
        "cache_rows": rows,
        "cache_stride": row_stride,
        "rope_scale": 1.0,
        "rope_theta": 1.0,
    }


def _raise_kernel_error(status, *, positions=None, cache_rows=0, indptr=None, nnz=0):
    kind, index = status >> 32, status & 0xFFFFFFFF
    if kind == _POSITION_OUT_OF_RANGE:
        raise ValueError(
            f"positions[{index}] = {int(positions[index])} is out of range for cos_sin_cache, "
            f"which has {cache_rows} rows (positions must be in [0, {cache_rows}))"
        )
    if kind == _BAD_INDPTR:
        raise ValueError(
            f"indptr must start at 0, never decrease and end at nnz = {nnz} (q's first dimension); "
            f"indptr[{index}] = {int(indptr[index])}"
        )
    raise RuntimeError(f"rope kernel returned unknown status {status:#x}")


# --------------------------------------------------------------------------- arguments


def _frequencies(rope_scale, rope_theta) -> dict:
    """ROPE_ARGS' frequency fields for plain RoPE (a fresh dict: the form adds its positions)."""
    return {"rope_scale": float(rope_scale), "rope_theta": float(rope_theta)}


def _llama31_frequencies(rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len) -> dict:
    if high_freq_factor == low_freq_factor:  # the blend divides by their difference
        raise ValueError(f"high_freq_factor and low_freq_factor must differ, both are {high_freq_factor}")
    return {
        "rope_scale": float(rope_scale),
        "rope_theta": float(rope_theta),
        "llama31": 1,
        "low_freq_factor": float(low_freq_factor),
        "high_freq_factor": float(high_freq_factor),
        "old_context_len": float(old_context_len),
    }


def _checked_qk(kernels, q, k, rotary_dim):
    """Variant, geometries and rotary_dim of the pos_ids and ragged forms' q and k."""
    variant = variant_for_input(kernels, q, "q")
    same_dtype(k, "k", q, "q")
    qg, kg = _heads(q, "q"), _heads(k, "k")
    _same_tokens(qg, kg, "q", "k")
    return variant, qg, kg, _checked_rotary_dim(rotary_dim, qg[2])


def _checked_rotary_dim(rotary_dim, head_dim: int) -> int:
    if rotary_dim is None:
        if head_dim % 2:  # FlashInfer takes q.size(-1), and rotates pairs
            raise ValueError(
                f"rotary_dim=None rotates the whole head, but head_dim {head_dim} is odd: pass an "
                f"even rotary_dim <= {head_dim}"
            )
        rotary_dim = head_dim
    else:
        try:
            rotary_dim = operator.index(rotary_dim)
        except TypeError:
            raise TypeError(f"rotary_dim must be an int or None, got {type(rotary_dim).__name__}") from None
    if rotary_dim % 2 or not 2 <= rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim must be even and in [2, head_dim = {head_dim}], got {rotary_dim}")
    return rotary_dim


def _same_tokens(qg, kg, q_name: str, k_name: str) -> None:
    if qg[0] != kg[0]:
        raise ValueError(f"{q_name} and {k_name} must have the same number of tokens, got {qg[0]} and {kg[0]}")
    if qg[2] != kg[2]:
        raise ValueError(f"{q_name} and {k_name} must have the same head dim, got {qg[2]} and {kg[2]}")


# A head geometry: (nnz, heads, head_dim, token stride, head stride), strides in elements.


def _heads(t: torch.Tensor, name: str) -> tuple[int, int, int, int, int]:
    """The geometry of a [nnz, num_heads, head_dim] tensor (any token and head strides)."""
    shape = t.shape
    if len(shape) != 3:
        raise ValueError(f"{name} must be 3-D [nnz, num_heads, head_dim], got shape {tuple(shape)}")
    s0, s1, s2 = t.stride()
    if s2 != 1 and shape[2] > 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {(s0, s1, s2)}")
    return shape[0], shape[1], shape[2], s0, s1


def _packed_heads(t: torch.Tensor, head_size: int, name: str) -> tuple[int, int, int, int, int]:
    """The geometry of ``t`` seen as FlashInfer sees it, ``t.view(nnz, -1, head_size)``: usually
    [nnz, num_heads * head_size] (a slice of a packed qkv tensor works), without making the view."""
    shape = t.shape
    if len(shape) == 2 and shape[1] % head_size == 0:
        s0, s1 = t.stride()
        if s1 != 1 and shape[1] > 1:
            raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {(s0, s1)}")
        return shape[0], shape[1] // head_size, head_size, s0, head_size
    if len(shape) == 3 and shape[2] == head_size:
        return _heads(t, name)
    try:
        view = t.view(shape[0] if len(shape) else 0, -1, head_size)
    except RuntimeError as exc:
        raise ValueError(
            f"{name} of shape {tuple(shape)} cannot be viewed as [nnz, num_heads, head_size = {head_size}]: {exc}"
        ) from None
    return _heads(view, name)


def _check_writable(g, name: str) -> None:
    """In-place rows must not share memory: two threads (or heads) would rotate it twice."""
    nnz, heads, head_dim, s0, s1 = g
    if (heads <= 1 or s1 >= head_dim) and (nnz <= 1 or s0 >= s1 * (heads - 1) + head_dim):
        return  # token-major rows one after another: the layouts engines use
    if nnz * heads and _overlaps((nnz, heads, head_dim), (s0, s1, 1)):
        raise ValueError(
            f"{name}'s heads overlap (shape {(nnz, heads, head_dim)}, strides {(s0, s1, 1)}): "
            "each element needs memory of its own to be rotated in place"
        )


def _outputs(q, qg, k, kg, in_place, names, geometry):
    """(q_out, its geometry, k_out, its geometry): the inputs themselves in place, else new tensors
    (``geometry(tensor, name)`` reads theirs)."""
    if in_place:
        _check_writable(qg, names[0])
        _check_writable(kg, names[1])
        check_no_overlap(k, names[1], q, names[0])  # an element of both would turn twice
        return q, qg, k, kg
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    return q_out, geometry(q_out, names[0]), k_out, geometry(k_out, names[1])


def _index_tensor(t, name: str, length: int | None = None) -> tuple[torch.Tensor, int]:
    """``t`` as a contiguous 1-D int32/int64 CPU tensor (of ``length`` entries if given), and 1 if int64."""
    try:
        dtype = t.dtype
    except AttributeError:
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}") from None
    if dtype is torch.int64:
        is_64 = 1
    elif dtype is torch.int32:
        is_64 = 0
    else:
        raise TypeError(f"{name} must have dtype torch.int32 or torch.int64, got {dtype}")
    if not t.is_cpu:
        raise ValueError(f"{name} is on device {t.device}; kernforge kernels run on the CPU")
    shape = t.shape
    if len(shape) != 1 or (length is not None and shape[0] != length):
        expected = f"({length},)" if length is not None else "1-D"
        raise ValueError(f"{name} must have shape {expected}, got {tuple(shape)}")
    if shape[0] > 1 and t.stride(0) != 1:
        t = t.contiguous()
    return t, is_64


def _checked_cache(cache):
    """(cache, rotary_dim, rows, row stride) of a float32 [max_position, rotary_dim] cos/sin cache."""
    try:
        dtype = cache.dtype
    except AttributeError:
        raise TypeError(f"cos_sin_cache must be a torch.Tensor, got {type(cache).__name__}") from None
    if dtype is not torch.float32:
        raise ValueError("cos_sin_cache should be float32")  # FlashInfer's words
    if not cache.is_cpu:
        raise ValueError(f"cos_sin_cache is on device {cache.device}; kernforge kernels run on the CPU")
    shape = cache.shape
    if len(shape) != 2:
        raise ValueError(f"cos_sin_cache must be 2-D [max_position, rotary_dim], got shape {tuple(shape)}")
    rotary_dim = shape[1]
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"cos_sin_cache's rotary_dim (its last dimension) must be even and >= 2, got {rotary_dim}")
    row_stride, elem_stride = cache.stride()
    if elem_stride != 1:
        cache = cache.contiguous()
        row_stride = rotary_dim
    return cache, rotary_dim, shape[0], row_stride


@model_kernels
def _for_model(spec, kv_cache_dtypes, quant) -> list[dict]:
    # the transformers integration rotates from a cos/sin cache; engines by position ids
    return [
        {"op": name, "dtype": spec.dtype}
        for name in ("apply_rope_with_cos_sin_cache_inplace", "apply_rope_pos_ids_inplace")
    ]
