"""RoPE ops against a float32 PyTorch reference written from the math.

Ops (FlashInfer's API): ``apply_rope_pos_ids(_inplace)``, ``apply_llama31_rope_pos_ids(_inplace)``,
``apply_rope(_inplace)`` and ``apply_llama31_rope(_inplace)`` (ragged batches: indptr + offsets),
``apply_rope_with_cos_sin_cache(_inplace)``. Both styles (neox halves, interleaved pairs), partial
rotary dims (the rest unchanged, copied out of place), q and k with different head counts, q and
k as strided views of a packed qkv tensor (in-place writes go through the views and nothing else
changes), int32 and int64 positions, every dtype, every tier.

The reference rotates pair i by ``float(pos) * freq_i`` (fp32 product, FlashInfer's contract) with
``freq_i = theta ** (-2i / rotary_dim) / rope_scale`` formed in float64 (Llama 3.1: Meta's
piecewise wavelength rule), its cos/sin in float64.
"""

import math

import pytest
import torch

import kernforge
from kernforge.ops import rope

from op_helpers import DTYPE_IDS, DTYPES, seeded

PAD = 3  # packed rows end in a few elements that belong to nobody


# --------------------------------------------------------------------------- reference


def ref_frequencies(rotary_dim, rope_scale=1.0, rope_theta=1e4, llama31=None):
    """float32 [rotary_dim / 2]; llama31 = (low_freq_factor, high_freq_factor, old_context_len)."""
    base = rope_theta ** (-2 * torch.arange(rotary_dim // 2, dtype=torch.float64) / rotary_dim)
    if llama31 is None:
        return (base / rope_scale).float()
    low, high, old_context_len = llama31
    wavelength = 2 * math.pi / base
    smooth = (old_context_len / wavelength - low) / (high - low)
    blended = (1 - smooth) * base / rope_scale + smooth * base
    freq = torch.where(
        wavelength < old_context_len / high,
        base,
        torch.where(wavelength > old_context_len / low, base / rope_scale, blended),
    )
    return freq.float()


def ref_cos_sin(positions, freq):
    """cos, sin float32 [nnz, rotary_dim / 2] of the fp32 angles float(pos) * freq."""
    angle = positions.to(torch.float32)[:, None] * freq[None, :]
    return angle.double().cos().float(), angle.double().sin().float()


def ref_rotate(x, cos, sin, rotary_dim, interleave):
    """x [nnz, heads, head_dim] -> float32, its first rotary_dim elements of each head rotated."""
    x = x.float()
    c, s = cos[:, None, :], sin[:, None, :]
    if interleave:
        x1, x2 = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
        rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        half = rotary_dim // 2
        x1, x2 = x[..., :half], x[..., half:rotary_dim]
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


def ref_cache(max_position, rotary_dim, theta=1e4):
    """A float32 [max_position, rotary_dim] cos | sin cache, as the engines build it."""
    freq = theta ** (-2 * torch.arange(rotary_dim // 2, dtype=torch.float64) / rotary_dim)
    angle = torch.arange(max_position, dtype=torch.float64)[:, None] * freq
    return torch.cat((angle.cos(), angle.sin()), dim=-1).float()


# --------------------------------------------------------------------------- inputs


def make_qk(nnz, num_q_heads, num_k_heads, head_dim, dtype, layout, g):
    """(q, k, backing): q [nnz, Hq, D] and k [nnz, Hk, D] in ``layout``, backed by ``backing``.

    packed: slices of one [nnz, (Hq + 2 Hk) D + PAD] qkv tensor (v and the pad belong to nobody);
    heads_major: [H, nnz, D + PAD] buffers seen as [nnz, H, D] (token stride < head stride);
    contig: plain tensors (backing None)."""
    if layout == "packed":
        width = (num_q_heads + 2 * num_k_heads) * head_dim
        qkv = torch.randn(nnz, width + PAD, generator=g).to(dtype)
        q_end, k_end = num_q_heads * head_dim, (num_q_heads + num_k_heads) * head_dim
        q = qkv[:, :q_end].view(nnz, num_q_heads, head_dim)
        k = qkv[:, q_end:k_end].view(nnz, num_k_heads, head_dim)
        return q, k, qkv
    if layout == "heads_major":
        q_buf = torch.randn(num_q_heads, nnz, head_dim + PAD, generator=g).to(dtype)
        k_buf = torch.randn(num_k_heads, nnz, head_dim + PAD, generator=g).to(dtype)
        return q_buf[..., :head_dim].transpose(0, 1), k_buf[..., :head_dim].transpose(0, 1), (q_buf, k_buf)
    assert layout == "contig", layout
    q = torch.randn(nnz, num_q_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(nnz, num_k_heads, head_dim, generator=g).to(dtype)
    return q, k, None


def snapshot(backing):
    if backing is None:
        return None
    return tuple(b.clone() for b in (backing if isinstance(backing, tuple) else (backing,)))


def written_mask(backing, views):
    """Bool masks over ``backing``'s tensors: True where one of ``views`` lies."""
    tensors = backing if isinstance(backing, tuple) else (backing,)
    masks = tuple(torch.zeros(t.shape, dtype=torch.bool) for t in tensors)
    for view in views:
        for t, mask in zip(tensors, masks):
            if view.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                mask.view(-1)[_flat_indices(view, t)] = True
    return masks


def _flat_indices(view, base):
    offset = (view.data_ptr() - base.data_ptr()) // view.element_size()
    index = torch.full(view.shape, offset, dtype=torch.int64)
    for dim, (size, stride) in enumerate(zip(view.shape, view.stride())):
        shape = [1] * view.dim()
        shape[dim] = size
        index = index + (torch.arange(size) * stride).view(shape)
    return index.flatten()


def assert_only_views_written(backing, before, views, ctx):
    for t, old, mask in zip(
        backing if isinstance(backing, tuple) else (backing,), before, written_mask(backing, views)
    ):
        assert torch.equal(t[~mask], old[~mask]), f"{ctx}: bytes outside q and k changed"


def positions_for(nnz, g, dtype=torch.int32, high=40000):
    return torch.randint(0, high, (nnz,), generator=g, dtype=torch.int64).to(dtype)


def check_result(result, q, k, q_in, k_in, expected_q, expected_k, rotary_dim, in_place, dtype, ctx, assert_close_ref):
    """The op's return value and outputs: None and q/k rotated in place, or new (q_rope, k_rope)
    with the inputs unchanged; the tail past rotary_dim bit-exact either way."""
    if in_place:
        assert result is None, f"{ctx}: in-place op returned {type(result).__name__}"
        q_out, k_out = q, k
    else:
        assert isinstance(result, tuple) and len(result) == 2, ctx
        q_out, k_out = result
        assert q_out.shape == q.shape and k_out.shape == k.shape, ctx
        assert q_out.dtype == dtype and k_out.dtype == dtype, ctx
        assert torch.equal(q, q_in) and torch.equal(k, k_in), f"{ctx}: out-of-place op changed its inputs"
    assert_close_ref(q_out, expected_q, dtype, f"{ctx}: q")
    assert_close_ref(k_out, expected_k, dtype, f"{ctx}: k")
    assert torch.equal(q_out[..., rotary_dim:], q_in[..., rotary_dim:]), f"{ctx}: q past rotary_dim changed"
    assert torch.equal(k_out[..., rotary_dim:], k_in[..., rotary_dim:]), f"{ctx}: k past rotary_dim changed"


# --------------------------------------------------------------------------- pos_ids


# (in place, layout): in-place writes go through strided views; out of place reads them.
MODES = {
    "inplace_packed": (True, "packed"),
    "inplace_heads_major": (True, "heads_major"),
    "out_packed": (False, "packed"),
    "out_contig": (False, "contig"),
}
HEAD_DIMS = [64, 80, 128, 256]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"D{d}")
@pytest.mark.parametrize("interleave", [False, True], ids=["neox", "interleave"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_pos_ids(dtype, interleave, head_dim, partial, mode, tier, assert_close_ref):
    in_place, layout = MODES[mode]
    g = seeded("pos_ids", dtype, interleave, head_dim, partial, mode)
    nnz, num_q_heads, num_k_heads = 37, 4, 2
    rotary_dim = head_dim // 2 + 8 if partial else None  # 40, 48, 72, 136: not a power of two
    rot = rotary_dim or head_dim
    q, k, backing = make_qk(nnz, num_q_heads, num_k_heads, head_dim, dtype, layout, g)
    pos_ids = positions_for(nnz, g)
    q_in, k_in, before = q.clone(), k.clone(), snapshot(backing)
    cos, sin = ref_cos_sin(pos_ids, ref_frequencies(rot))
    op = kernforge.apply_rope_pos_ids_inplace if in_place else kernforge.apply_rope_pos_ids
    result = op(q, k, pos_ids, rotary_dim=rotary_dim, interleave=interleave)
    ctx = f"pos_ids {mode} dtype={dtype} interleave={interleave} D={head_dim} rot={rot} tier={tier}"
    check_result(
        result,
        q,
        k,
        q_in,
        k_in,
        ref_rotate(q_in, cos, sin, rot, interleave),
        ref_rotate(k_in, cos, sin, rot, interleave),
        rot,
        in_place,
        dtype,
        ctx,
        assert_close_ref,
    )
    if backing is not None:
        assert_only_views_written(backing, before, (q, k) if in_place else (), ctx)


@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64], ids=["pos32", "pos64"])
@pytest.mark.parametrize("heads", [(1, 1), (8, 1), (2, 6), (5, 0)], ids=lambda h: f"Hq{h[0]}Hk{h[1]}")
@pytest.mark.parametrize("nnz", [0, 1, 1000])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_pos_ids_sizes(dtype, nnz, heads, pos_dtype, tier, assert_close_ref):
    """Token counts (1000 splits across threads), head counts (MQA, more k than q heads, no k),
    both position dtypes, scaled frequencies and a non-default theta."""
    num_q_heads, num_k_heads = heads
    g = seeded("sizes", dtype, nnz, heads, pos_dtype)
    q, k, _ = make_qk(nnz, num_q_heads, num_k_heads, 128, dtype, "contig", g)
    pos_ids = positions_for(nnz, g, pos_dtype)
    cos, sin = ref_cos_sin(pos_ids, ref_frequencies(128, rope_scale=2.5, rope_theta=5e5))
    expected_q, expected_k = ref_rotate(q, cos, sin, 128, False), ref_rotate(k, cos, sin, 128, False)
    saved = kernforge.ops._common._threads_override
    kernforge.set_num_threads(3)  # more threads than this machine may have: the split is still right
    try:
        assert kernforge.apply_rope_pos_ids_inplace(q, k, pos_ids, rope_scale=2.5, rope_theta=5e5) is None
    finally:
        kernforge.set_num_threads(saved)
    ctx = f"sizes dtype={dtype} nnz={nnz} heads={heads} {pos_dtype} tier={tier}"
    assert_close_ref(q, expected_q, dtype, f"{ctx}: q")
    assert_close_ref(k, expected_k, dtype, f"{ctx}: k")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_pos_ids_far_positions(dtype, tier, assert_close_ref):
    """Angles of a million radians: the range reduction keeps sin/cos within fp32 tolerance."""
    g = seeded("far", dtype)
    q, k, _ = make_qk(64, 2, 1, 64, dtype, "contig", g)
    pos_ids = torch.cat([torch.tensor([0, 1, 2**20, 2**24 - 1]), positions_for(60, g, torch.int64, 2**22)])
    cos, sin = ref_cos_sin(pos_ids, ref_frequencies(64))
    q_rope, k_rope = kernforge.apply_rope_pos_ids(q, k, pos_ids)
    assert_close_ref(q_rope, ref_rotate(q, cos, sin, 64, False), dtype, f"far positions tier={tier}")
    assert_close_ref(k_rope, ref_rotate(k, cos, sin, 64, False), dtype, f"far positions tier={tier}")


def test_every_position_of_the_last_65536_below_2_to_the_24(tier):
    """Angles (frequency 1) of every position in [2^24 - 2^16, 2^24): where x / pi lies just past a
    half-integer, its fp32 estimate rounds to the wrong k, which left r near +-pi (sin 1e-5 off) until
    the remainder was reduced once more (kernforge/rope.h sincos; the fuzzer's case in CI)."""
    pos_ids = torch.arange(2**24 - 2**16, 2**24)
    q = torch.randn(len(pos_ids), 1, 2, generator=seeded("near pi", torch.float32))
    angle = pos_ids.double()  # rotary_dim 2: the one frequency is 1, whatever theta
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    q_rope, _ = kernforge.apply_rope_pos_ids(q, q.clone(), pos_ids, rotary_dim=2, interleave=True)
    error = (q_rope.double() - ref_rotate(q.double(), cos, sin, 2, True).double()).abs().max()
    assert error <= 1e-6 * q.abs().max(), f"tier={tier}: {error}"


def test_defaults_match_flashinfer():
    """rotary_dim=None rotates the whole head; FlashInfer's defaults: rope_scale=1, rope_theta=1e4;
    Llama 3.1: rope_scale=8, rope_theta=5e5, low 1, high 4, old_context_len 8192."""
    g = seeded("defaults")
    q, k, _ = make_qk(9, 2, 2, 64, torch.float32, "contig", g)
    pos_ids = positions_for(9, g)
    cos, sin = ref_cos_sin(pos_ids, ref_frequencies(64))
    q_rope, _ = kernforge.apply_rope_pos_ids(q, k, pos_ids)
    torch.testing.assert_close(q_rope, ref_rotate(q, cos, sin, 64, False), atol=1e-5, rtol=1e-5)
    cos, sin = ref_cos_sin(pos_ids, ref_frequencies(64, 8.0, 5e5, llama31=(1.0, 4.0, 8192.0)))
    q_rope, _ = kernforge.apply_llama31_rope_pos_ids(q, k, pos_ids)
    torch.testing.assert_close(q_rope, ref_rotate(q, cos, sin, 64, False), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- any head_dim


# (head_dim, rotary_dim): odd head dims with an unrotated tail, and odd rotary halves (1, 3, 13, 17)
# whose vectors end partway (neox: at half and at rotary_dim; interleaved: pairs across a tail).
ANY_HEAD_DIMS = [(13, 12), (33, 32), (33, 2), (55, 6), (55, 26), (200, 34), (511, 510), (1, None)]
FORMS = ["pos_ids", "pos_ids_inplace", "ragged", "llama31_inplace", "cache", "cache_inplace"]


def _rope_any_dim(form, q, k, rotary_dim, interleave, g):
    """Runs ``form`` on q and k; returns (result, cos, sin) with the reference's angles."""
    nnz = q.shape[0]
    if form.startswith("cache"):
        cache = ref_cache(4096, rotary_dim)
        positions = positions_for(nnz, g, torch.int64, high=4096)
        op = (
            kernforge.apply_rope_with_cos_sin_cache_inplace
            if form == "cache_inplace"
            else kernforge.apply_rope_with_cos_sin_cache
        )
        head_dim = q.shape[-1]
        result = op(positions, q.flatten(1), k.flatten(1), head_dim, cache, is_neox=not interleave)
        result = result and tuple(r.view(nnz, -1, head_dim) for r in result)
        half = rotary_dim // 2
        return result, cache[positions, :half], cache[positions, half:]
    if form == "ragged":
        indptr, offsets = torch.tensor([0, 2, nnz], dtype=torch.int32), torch.tensor([5, 300], dtype=torch.int32)
        positions = torch.cat([torch.arange(2) + 5, torch.arange(nnz - 2) + 300])
        return (
            kernforge.apply_rope(q, k, indptr, offsets, rotary_dim=rotary_dim, interleave=interleave),
            *ref_cos_sin(positions, ref_frequencies(rotary_dim)),
        )
    pos_ids = positions_for(nnz, g)
    if form == "llama31_inplace":
        kernforge.apply_llama31_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=rotary_dim, interleave=interleave)
        freq = ref_frequencies(rotary_dim, 8.0, 5e5, llama31=(1.0, 4.0, 8192.0))
        return None, *ref_cos_sin(pos_ids, freq)
    op = kernforge.apply_rope_pos_ids_inplace if form == "pos_ids_inplace" else kernforge.apply_rope_pos_ids
    return op(q, k, pos_ids, rotary_dim=rotary_dim, interleave=interleave), *ref_cos_sin(
        pos_ids, ref_frequencies(rotary_dim)
    )


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("interleave", [False, True], ids=["neox", "interleave"])
@pytest.mark.parametrize("dims", ANY_HEAD_DIMS, ids=lambda d: f"D{d[0]}r{d[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_any_head_dim(dtype, dims, interleave, form, tier, assert_close_ref):
    """Every form at head dims that are not vector multiples, with an even rotary_dim <= head_dim:
    the rotated part against the reference, the tail bit-exact, nothing past the heads written
    (q and k packed in one qkv row). head_dim 1 has no even rotary_dim: a ValueError naming it."""
    head_dim, rotary_dim = dims
    g = seeded("any_dim", dtype, dims, interleave, form)
    q, k, backing = make_qk(9, 3, 2, head_dim, dtype, "packed", g)
    if rotary_dim is None:
        with pytest.raises(ValueError, match="rotary_dim"):
            kernforge.apply_rope_pos_ids(q, k, positions_for(9, g), interleave=interleave)
        return
    q_in, k_in, before = q.clone(), k.clone(), snapshot(backing)
    result, cos, sin = _rope_any_dim(form, q, k, rotary_dim, interleave, g)
    in_place = form.endswith("inplace")
    ctx = f"{form} dtype={dtype} interleave={interleave} D={head_dim} rot={rotary_dim} tier={tier}"
    check_result(
        result,
        q,
        k,
        q_in,
        k_in,
        ref_rotate(q_in, cos, sin, rotary_dim, interleave),
        ref_rotate(k_in, cos, sin, rotary_dim, interleave),
        rotary_dim,
        in_place,
        dtype,
        ctx,
        assert_close_ref,
    )
    assert_only_views_written(backing, before, (q, k) if in_place else (), ctx)


# --------------------------------------------------------------------------- Llama 3.1


LLAMA31_PARAMS = {
    "defaults": dict(rope_scale=8.0, rope_theta=5e5, low_freq_factor=1.0, high_freq_factor=4.0, old_context_len=8192),
    "llama32": dict(rope_scale=32.0, rope_theta=5e5, low_freq_factor=1.0, high_freq_factor=4.0, old_context_len=8192),
    "other": dict(rope_scale=4.0, rope_theta=1e4, low_freq_factor=2.0, high_freq_factor=8.0, old_context_len=2048),
}


@pytest.mark.parametrize("params", list(LLAMA31_PARAMS))
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("interleave", [False, True], ids=["neox", "interleave"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_llama31_pos_ids(dtype, interleave, in_place, params, tier, assert_close_ref):
    """The wavelengths of theta 5e5 over 128 dims fall in all three bands (kept, blended, scaled)."""
    kw = LLAMA31_PARAMS[params]
    g = seeded("llama31", dtype, interleave, in_place, params)
    q, k, backing = make_qk(37, 4, 1, 128, dtype, "packed", g)
    pos_ids = positions_for(37, g, torch.int64, 131072)
    q_in, k_in, before = q.clone(), k.clone(), snapshot(backing)
    freq = ref_frequencies(
        128,
        kw["rope_scale"],
        kw["rope_theta"],
        llama31=(kw["low_freq_factor"], kw["high_freq_factor"], kw["old_context_len"]),
    )
    cos, sin = ref_cos_sin(pos_ids, freq)
    op = kernforge.apply_llama31_rope_pos_ids_inplace if in_place else kernforge.apply_llama31_rope_pos_ids
    result = op(q, k, pos_ids, interleave=interleave, **kw)
    ctx = f"llama31 {params} dtype={dtype} interleave={interleave} in_place={in_place} tier={tier}"
    check_result(
        result,
        q,
        k,
        q_in,
        k_in,
        ref_rotate(q_in, cos, sin, 128, interleave),
        ref_rotate(k_in, cos, sin, 128, interleave),
        128,
        in_place,
        dtype,
        ctx,
        assert_close_ref,
    )
    assert_only_views_written(backing, before, (q, k) if in_place else (), ctx)


# --------------------------------------------------------------------------- ragged: indptr + offsets


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["idx32", "idx64"])
@pytest.mark.parametrize("llama31", [False, True], ids=["rope", "llama31"])
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_ragged(dtype, in_place, llama31, index_dtype, tier, assert_close_ref):
    """Requests of 5, 0, 1, 17 and 0 tokens starting at their own offsets; interleaved, partial."""
    g = seeded("ragged", dtype, in_place, llama31, index_dtype)
    lengths, offsets = [5, 0, 1, 17, 0], [3, 100, 0, 4090, 7]
    indptr = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=index_dtype)
    nnz = int(indptr[-1])
    positions = torch.cat([torch.arange(n) + o for n, o in zip(lengths, offsets)])
    q, k, backing = make_qk(nnz, 3, 2, 64, dtype, "packed", g)
    q_in, k_in, before = q.clone(), k.clone(), snapshot(backing)
    offsets = torch.tensor(offsets, dtype=index_dtype)
    if llama31:
        kw = dict(rope_scale=8.0, rope_theta=5e5, low_freq_factor=1.0, high_freq_factor=4.0, old_context_len=8192)
        freq = ref_frequencies(48, 8.0, 5e5, llama31=(1.0, 4.0, 8192.0))
        op = kernforge.apply_llama31_rope_inplace if in_place else kernforge.apply_llama31_rope
    else:
        kw, freq = dict(rope_theta=1e4), ref_frequencies(48)
        op = kernforge.apply_rope_inplace if in_place else kernforge.apply_rope
    cos, sin = ref_cos_sin(positions, freq)
    result = op(q, k, indptr, offsets, rotary_dim=48, interleave=True, **kw)
    ctx = f"ragged dtype={dtype} in_place={in_place} llama31={llama31} tier={tier}"
    check_result(
        result,
        q,
        k,
        q_in,
        k_in,
        ref_rotate(q_in, cos, sin, 48, True),
        ref_rotate(k_in, cos, sin, 48, True),
        48,
        in_place,
        dtype,
        ctx,
        assert_close_ref,
    )
    assert_only_views_written(backing, before, (q, k) if in_place else (), ctx)


# --------------------------------------------------------------------------- cos_sin_cache


# (head_size, rotary_dim)
CACHE_SHAPES = [(64, 64), (80, 80), (128, 128), (128, 64), (256, 256), (256, 96)]


@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32], ids=["pos64", "pos32"])
@pytest.mark.parametrize("sizes", CACHE_SHAPES, ids=lambda s: f"D{s[0]}r{s[1]}")
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleave"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cos_sin_cache(dtype, is_neox, in_place, sizes, pos_dtype, tier, assert_close_ref):
    """query/key [nnz, heads * head_size] sliced from a packed qkv tensor, as SGLang and vLLM pass them."""
    head_size, rotary_dim = sizes
    g = seeded("cache", dtype, is_neox, in_place, sizes, pos_dtype)
    nnz, num_q_heads, num_k_heads = 37, 4, 2
    cache = ref_cache(4096, rotary_dim)
    q3, k3, qkv = make_qk(nnz, num_q_heads, num_k_heads, head_size, dtype, "packed", g)
    query, key = q3.flatten(1), k3.flatten(1)  # [nnz, H * head_size] views into qkv
    positions = torch.cat([torch.tensor([0, 4095]), positions_for(nnz - 2, g, high=4096)]).to(pos_dtype)
    q_in, k_in, before = q3.clone(), k3.clone(), snapshot(qkv)
    half = rotary_dim // 2
    cos, sin = cache[positions.long(), :half], cache[positions.long(), half:]
    op = kernforge.apply_rope_with_cos_sin_cache_inplace if in_place else kernforge.apply_rope_with_cos_sin_cache
    result = op(positions, query, key, head_size, cache, is_neox=is_neox)
    if not in_place:
        assert result[0].shape == query.shape and result[1].shape == key.shape
        result = tuple(r.view(nnz, -1, head_size) for r in result)
    ctx = f"cache dtype={dtype} neox={is_neox} in_place={in_place} sizes={sizes} tier={tier}"
    check_result(
        result,
        q3,
        k3,
        q_in,
        k_in,
        ref_rotate(q_in, cos, sin, rotary_dim, not is_neox),
        ref_rotate(k_in, cos, sin, rotary_dim, not is_neox),
        rotary_dim,
        in_place,
        dtype,
        ctx,
        assert_close_ref,
    )
    assert_only_views_written(qkv, before, (q3, k3) if in_place else (), ctx)


def test_cos_sin_cache_3d_and_strided_cache(assert_close_ref):
    """query given as [nnz, heads, head_size] (FlashInfer views it so too); a cache whose rows are
    a strided slice of a wider buffer."""
    g = seeded("cache3d")
    wide = torch.zeros(512, 64 + 7)
    wide[:, :64] = ref_cache(512, 64)
    cache = wide[:, :64]
    q, k, _ = make_qk(11, 3, 1, 64, torch.bfloat16, "contig", g)
    positions = positions_for(11, g, torch.int64, 512)
    cos, sin = cache[positions, :32], cache[positions, 32:]
    expected_q, expected_k = ref_rotate(q, cos, sin, 64, False), ref_rotate(k, cos, sin, 64, False)
    kernforge.apply_rope_with_cos_sin_cache_inplace(positions, q, k, 64, cache)
    assert_close_ref(q, expected_q, torch.bfloat16)
    assert_close_ref(k, expected_k, torch.bfloat16)


@pytest.mark.parametrize("interleave", [False, True], ids=["neox", "interleave"])
def test_rotate_heads_for_other_families(interleave, tier, assert_close_ref):
    """rope.rotate_heads, what MLA's projections call: q from strided rows rotated into another
    tensor's strided rows (partial rotary_dim: the rest copied), k in place, nothing else written."""
    g = seeded("rotate_heads", interleave)
    nnz, heads, head_dim, rotary_dim = 5, 3, 48, 32
    cache = ref_cache(64, rotary_dim)
    positions = positions_for(nnz, g, torch.int64, 64)
    angles = rope.cos_sin_angles(positions, cache, nnz)
    q_rows = torch.randn(nnz, heads, head_dim + 16, generator=g).to(torch.bfloat16)
    out_rows = torch.zeros(nnz, heads, head_dim + 8, dtype=torch.bfloat16)
    k_rows = torch.randn(nnz, 1, head_dim + 4, generator=g).to(torch.bfloat16)
    q, q_out, k = q_rows[..., 16:], out_rows[..., 8:], k_rows[..., 4:]
    q_in, k_in, rest = q.clone(), k.clone(), (q_rows.clone(), k_rows[..., :4].clone())
    rope.rotate_heads(q, q_out, k, k, angles, interleave)
    half = rotary_dim // 2
    cos, sin = cache[positions, :half], cache[positions, half:]
    assert_close_ref(q_out, ref_rotate(q_in, cos, sin, rotary_dim, interleave), torch.bfloat16)
    assert_close_ref(k, ref_rotate(k_in, cos, sin, rotary_dim, interleave), torch.bfloat16)
    assert torch.equal(q_rows, rest[0]) and torch.equal(k_rows[..., :4], rest[1])
    assert not out_rows[..., :8].any()


def test_rotate_heads_refuses_before_writing():
    cache, q, k = ref_cache(8, 16), torch.randn(3, 2, 16), torch.randn(3, 1, 16)
    angles = rope.cos_sin_angles(torch.tensor([0, 1, 2]), cache, 3)
    with pytest.raises(ValueError, match=r"q_out must have shape \(3, 2, 16\)"):
        rope.rotate_heads(q, torch.empty(3, 2, 8), k, k, angles)
    with pytest.raises(TypeError, match="q_out has dtype"):
        rope.rotate_heads(q, torch.empty(3, 2, 16, dtype=torch.bfloat16), k, k, angles)
    with pytest.raises(ValueError, match="2 positions for 3 tokens"):
        rope.rotate_heads(q, q, k, k, rope.cos_sin_angles(torch.tensor([0, 1]), cache))
    with pytest.raises(ValueError, match=r"rotary_dim \(16\) exceeds q's head_dim \(8\)"):
        rope.rotate_heads(q[..., :8], q[..., :8], k[..., :8], k[..., :8], angles)
    k_before = k.clone()
    far = rope.cos_sin_angles(torch.tensor([0, 8, 1]), cache, 3)
    with pytest.raises(ValueError, match=r"positions\[1\] = 8 is out of range"):
        rope.rotate_heads(q, torch.zeros_like(q), k, k, far)
    assert torch.equal(k, k_before)
    with pytest.raises(TypeError, match="positions must have dtype"):
        rope.checked_positions(torch.tensor([0.0]))


# --------------------------------------------------------------------------- errors


def _qk(nnz=4, hq=2, hk=1, d=64, dtype=torch.float32):
    return torch.randn(nnz, hq, d, dtype=dtype), torch.randn(nnz, hk, d, dtype=dtype)


def _pos(nnz=4, dtype=torch.int32):
    return torch.arange(nnz, dtype=dtype)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: kernforge.apply_rope_pos_ids(*_qk(dtype=torch.float64), _pos()), TypeError, r"\bq\b.*float64"),
        (
            lambda: kernforge.apply_rope_pos_ids(_qk()[0], _qk(dtype=torch.bfloat16)[1], _pos()),
            TypeError,
            r"\bk\b.*dtype",
        ),
        (lambda: kernforge.apply_rope_pos_ids(torch.randn(4, 128), _qk()[1], _pos()), ValueError, r"\bq\b.*3-D"),
        (lambda: kernforge.apply_rope_pos_ids(_qk()[0], _qk(nnz=5)[1], _pos()), ValueError, "number of tokens"),
        (lambda: kernforge.apply_rope_pos_ids(_qk()[0], _qk(d=32)[1], _pos()), ValueError, "head dim"),
        (lambda: kernforge.apply_rope_pos_ids(*_qk(), _pos(), rotary_dim=33), ValueError, "rotary_dim"),
        (lambda: kernforge.apply_rope_pos_ids(*_qk(), _pos(), rotary_dim=66), ValueError, "rotary_dim"),
        (lambda: kernforge.apply_rope_pos_ids(*_qk(), _pos(), rotary_dim=0), ValueError, "rotary_dim"),
        (lambda: kernforge.apply_rope_pos_ids(*_qk(), _pos(), rotary_dim=32.0), TypeError, "rotary_dim"),
        (lambda: kernforge.apply_rope_pos_ids(*_qk(), _pos().float()), TypeError, "pos_ids"),
        (lambda: kernforge.apply_rope_pos_ids(*_qk(), _pos(5)), ValueError, "pos_ids"),
        (lambda: kernforge.apply_rope_pos_ids(*_qk(), [0, 1, 2, 3]), TypeError, "pos_ids"),
        (lambda: kernforge.apply_rope_pos_ids(*_qk(), _pos().to("meta")), ValueError, "pos_ids.*device"),
        (lambda: kernforge.apply_rope_pos_ids(*_qk(d=63), _pos()), ValueError, "rotary_dim=None.*head_dim 63 is odd"),
        (
            lambda: kernforge.apply_rope_pos_ids(*_qk(d=63), _pos(), rotary_dim=63),
            ValueError,
            "rotary_dim must be even",
        ),
        (
            lambda: kernforge.apply_llama31_rope_pos_ids(*_qk(), _pos(), low_freq_factor=2, high_freq_factor=2),
            ValueError,
            "high_freq_factor",
        ),
        (
            lambda: kernforge.apply_rope(*_qk(), torch.tensor([0, 4]), torch.tensor([0], dtype=torch.int32)),
            TypeError,
            "same dtype",
        ),
        (lambda: kernforge.apply_rope(*_qk(), torch.tensor([0, 2, 4]), torch.tensor([0])), ValueError, "indptr"),
        (
            lambda: kernforge.apply_rope_pos_ids_inplace(torch.randn(4, 1, 64).expand(4, 2, 64), _qk()[1], _pos()),
            ValueError,
            r"\bq\b.*overlap",
        ),
        (
            lambda: kernforge.apply_rope_pos_ids_inplace(torch.randn(4, 2, 128)[..., ::2], _qk()[1], _pos()),
            ValueError,
            r"\bq\b.*contiguous",
        ),
        (
            lambda: kernforge.apply_rope_with_cos_sin_cache(
                _pos(), torch.randn(4, 128), torch.randn(4, 64), 64, ref_cache(8, 64).half()
            ),
            ValueError,
            "^cos_sin_cache should be float32$",
        ),
        (
            lambda: kernforge.apply_rope_with_cos_sin_cache(
                _pos(), torch.randn(4, 128), torch.randn(4, 64), 64, ref_cache(8, 64)[None]
            ),
            ValueError,
            "cos_sin_cache.*2-D",
        ),
        (
            lambda: kernforge.apply_rope_with_cos_sin_cache(
                _pos(), torch.randn(4, 128), torch.randn(4, 64), 64, ref_cache(8, 128)
            ),
            ValueError,
            "head_size",
        ),
        (
            lambda: kernforge.apply_rope_with_cos_sin_cache(
                _pos(), torch.randn(4, 100), torch.randn(4, 64), 64, ref_cache(8, 64)
            ),
            ValueError,
            r"\bquery\b",
        ),
        (
            lambda: kernforge.apply_rope_with_cos_sin_cache(
                _pos(), torch.randn(4, 128), torch.randn(3, 64), 64, ref_cache(8, 64)
            ),
            ValueError,
            "number of tokens",
        ),
        (
            lambda: kernforge.apply_rope_with_cos_sin_cache(
                _pos(), torch.randn(4, 128), torch.randn(4, 64), 0, ref_cache(8, 64)
            ),
            ValueError,
            "head_size",
        ),
        (
            lambda: kernforge.apply_rope_with_cos_sin_cache(_pos(), torch.randn(4, 128), None, 64, ref_cache(8, 64)),
            TypeError,
            r"\bkey\b",
        ),
    ],
)
def test_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("bad", [-1, 8, 2**31 + 3], ids=["negative", "max_position", "huge"])
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "inplace"])
def test_positions_outside_the_cache(bad, in_place, tier):
    """Checked by the kernel before it writes anything: in place, q and k keep their values."""
    query, key = torch.randn(5, 128), torch.randn(5, 64)
    positions = torch.tensor([0, 1, 2, bad, 3], dtype=torch.int64)
    before = query.clone(), key.clone()
    op = kernforge.apply_rope_with_cos_sin_cache_inplace if in_place else kernforge.apply_rope_with_cos_sin_cache
    with pytest.raises(ValueError, match=rf"positions\[3\] = {bad} is out of range.* 8 rows"):
        op(positions, query, key, 64, ref_cache(8, 64))
    assert torch.equal(query, before[0]) and torch.equal(key, before[1])


@pytest.mark.parametrize(
    "indptr, index",
    [([1, 2, 4], 0), ([0, 3, 2, 4], 2), ([0, 2, 3], 2), ([0, 2, 5], 2)],
    ids=["start", "decreasing", "short", "long"],
)
def test_bad_indptr(indptr, index, tier):
    q, k = _qk()
    before = q.clone(), k.clone()
    indptr = torch.tensor(indptr, dtype=torch.int32)
    offsets = torch.zeros(len(indptr) - 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"indptr\[{index}\]"):
        kernforge.apply_rope_inplace(q, k, indptr, offsets)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])
