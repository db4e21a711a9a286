"""Fuzz targets: attention. The paged KV append (with get_seq_lens and get_batch_indices_positions, and
its bound form), the decode and prefill wrappers as plan/run sequences, the single-request ops, and the
cascade merges.

A wrapper case is a sequence: one wrapper plans a batch, runs it on several layers (caches of one page
table, each with its own q; for decode also through ``bound_run``, the prepared decode step's layer
loop), runs the first layer again (it must give the same bits: nothing of a run may leak into the
next), plans another batch (other lengths, page size, heads, mask, window; batches of 0 requests too)
and runs that. Page tables are shuffled, may name one page for several requests (prefix sharing; the
reading ops allow it), leave spare pages, and give requests of length 0 (where allowed), 1 and long
ones (split across threads: 1 to 3 of them). The caller's index tensors are scribbled over after
plan() (run() must use its own copies). Slots that no request reads (spare pages, the tails of last
pages) may hold NaN: a kernel that lets an unread slot into a result shows it.

The references are ``references.attention_reference`` (float64) per request, over the pages gathered
in page-table order; the tolerances are tests/attention's: out within the coarsest of the q, 16-bit KV
and out dtypes (fp32 1e-5, fp16 1e-3, bf16 1e-2; the absolute part times ``v_scale`` when it is above
1, as test_prefill.py), LSE to 1e-4 for decode and 1e-3 for prefill, cascade states' s to 1e-5.

Variants compile per (dtypes, head dims, GQA group for decode, tile for prefill) and take 5-20 s per
tier, so geometries are drawn from short lists (DECODE_GEOMETRIES, PREFILL_GEOMETRIES) that the
hand-written tests build too.
"""

from __future__ import annotations

import contextlib
import functools
import math
import random

import torch
from fuzzing import FuzzFailure, Target, generator, size

import kernforge
from kernforge.ops.attention.page import bound_append_paged_kv_cache
from kernforge.ops.attention.prefill import TILES

from references import attention_reference

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = (E4M3, E5M2)
ATTENTION_TOL = {FP32: 1e-5, FP16: 1e-3, BF16: 1e-2}  # tests/attention's, by the coarsest dtype
DECODE_LSE_TOL = (1e-4, 1e-4)  # test_decode.py
PREFILL_LSE_TOL = (1e-3, 1e-3)  # test_prefill.py
STATE_S_TOL = (1e-5, 1e-5)  # test_cascade.py: s is float32 whatever v's dtype
_PRECISION = [FP32, FP16, BF16]  # finer to coarser

# (q, KV, out dtype, head_dim, GQA group; 0: a group above 8, MQA's runtime-group variant).
DECODE_GEOMETRIES = [
    *((BF16, BF16, BF16, 128, group) for group in range(1, 9)),
    (BF16, BF16, BF16, 64, 2),
    (BF16, BF16, BF16, 64, 3),
    (BF16, BF16, BF16, 80, 5),
    (BF16, BF16, BF16, 13, 4),
    (BF16, BF16, BF16, 200, 8),
    (BF16, BF16, BF16, 256, 8),
    (BF16, BF16, FP32, 128, 0),
    (BF16, BF16, FP32, 48, 4),
    (FP16, FP16, FP16, 64, 1),
    (FP16, FP16, FP16, 72, 8),
    (FP16, FP16, FP16, 512, 2),
    (FP32, FP32, FP32, 128, 4),
    (FP32, FP32, FP32, 1, 1),
    (FP32, FP32, FP32, 264, 4),
    (BF16, E4M3, BF16, 128, 1),
    (BF16, E4M3, BF16, 128, 4),
    (BF16, E4M3, BF16, 33, 8),
    (BF16, E4M3, BF16, 96, 1),
    (BF16, E5M2, BF16, 128, 0),
    (FP16, E5M2, FP16, 128, 4),
    (FP16, E5M2, FP16, 55, 0),
]
# (q/out dtype, KV dtype, head_dim_qk, head_dim_vo): the prefill variants (group is no parameter).
PREFILL_GEOMETRIES = [
    (BF16, BF16, 128, 128),
    (BF16, BF16, 64, 64),
    (BF16, BF16, 72, 72),
    (BF16, BF16, 256, 256),
    (BF16, BF16, 1, 1),
    (BF16, E4M3, 128, 128),
    (BF16, E4M3, 55, 55),
    (FP16, FP16, 128, 128),
    (FP16, FP16, 64, 64),
    (FP16, FP16, 13, 13),
    (FP16, FP16, 200, 200),
    (FP16, E4M3, 128, 128),
    (FP16, E5M2, 64, 64),
    (FP32, FP32, 128, 128),
    (FP32, FP32, 33, 33),
]
# Ragged K/V may have a head_dim_vo of its own (MLA's unabsorbed prompt path).
RAGGED_GEOMETRIES = PREFILL_GEOMETRIES + [(BF16, BF16, 192, 128), (FP16, FP16, 192, 128), (BF16, BF16, 33, 17)]
TILE_GEOMETRY = (BF16, BF16, 64, 64)  # plan_with_tile: every tile of this one is built by test_prefill.py
PAGE_SIZES = [1, 1, 3, 5, 7, 13, 16, 16, 16, 64]

_WORKSPACE: list[torch.Tensor] = []


def workspace() -> torch.Tensor:
    if not _WORKSPACE:
        _WORKSPACE.append(torch.empty(64 << 20, dtype=torch.uint8))
    return _WORKSPACE[0]


@contextlib.contextmanager
def threads(n: int):
    """kernforge's thread count for the block (plan() cuts the work for it); restored after."""
    kernforge.set_num_threads(n)
    try:
        yield
    finally:
        kernforge.set_num_threads(None)


def one_torch_thread(fn):
    """``fn`` with torch's intra-op threads at one: the references' float64 ops on small tensors are
    10-100x faster so on a loaded machine (each op's thread wake-up costs more than its work)."""

    @functools.wraps(fn)
    def single(*args):
        saved = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args)
        finally:
            torch.set_num_threads(saved)

    return single


def target(name, draw, inputs, run, reference, tolerance) -> Target:
    """A Target whose inputs and reference run on one torch thread (``one_torch_thread``)."""
    return Target(name, draw, one_torch_thread(inputs), run, one_torch_thread(reference), tolerance)


def computed_in(*dtypes) -> torch.dtype:
    """The dtype whose tolerance applies: the coarsest of q, out and a 16-bit KV (fp8 widens exactly)."""
    return max((d for d in dtypes if d not in FP8), key=_PRECISION.index)


class ByName(dict):
    """A tolerance per output name, from ``pick(name)``: Target.tolerance's dict for outputs named at run time."""

    def __init__(self, pick):
        super().__init__()
        self.pick = pick

    def __missing__(self, name):
        return self.pick(name)


def out_tolerance(dtype, setting: dict) -> tuple[float, float]:
    """out's (atol, rtol) for a plan or single-op case: ``dtype``'s tolerance, atol times v_scale above
    1 (the values' size) and, in fp32, times the logits' size above 2 (q_magnitude·q_scale): an fp32
    logit carries a rounding in proportion to its size, which moves its softmax weight by as much,
    relatively. In 16 bits the output's own rounding dominates; their tolerance stays."""
    tol = ATTENTION_TOL[dtype]
    atol = tol * max(1.0, scale_float(setting.get("v_scale")))
    if dtype == FP32:
        atol *= max(1.0, setting.get("q_magnitude", 1.0) * scale_float(setting.get("q_scale")) / 2)
    return atol, tol


def attention_tolerance(dtype, lse_tol, plans):
    """Each plan's out within ``out_tolerance``, lse within lse_tol; output names start with "p<plan>"."""

    def pick(name):
        if name.endswith("lse"):
            return lse_tol
        return out_tolerance(dtype, plans[int(name.split(".")[0][1:])])

    return ByName(pick)


def as_float(x) -> float:
    return 1.0 if x is None else float(x)


def scale_arg(rng: random.Random, values, tensor_ok=True):
    """None, a float, or (a tuple marking) a one-element tensor: engines pass k_scale/v_scale so."""
    value = rng.choice(values)
    if value is None or not tensor_ok or rng.random() < 0.7:
        return value
    return ("tensor", value)


def scale_value(arg):
    """run()'s argument for a drawn scale."""
    if isinstance(arg, tuple):
        return torch.tensor([arg[1]])
    return arg


def scale_float(arg) -> float:
    return as_float(arg[1] if isinstance(arg, tuple) else arg)


# --------------------------------------------------------------------------- lengths and page tables


def kv_length(rng: random.Random, long: int = 2100) -> int:
    """0, 1, a size at a tile or page edge, or now and then a long request (split across threads)."""
    pick = rng.random()
    if pick < 0.1:
        return 0
    if pick < 0.25:
        return 1
    if pick < 0.88 or long <= 70:
        return size(rng, 70, zero=False)
    return rng.randint(71, long)


def indptr_of(counts) -> torch.Tensor:
    """int32 [len(counts) + 1]: 0 and the running sums of ``counts`` (an indptr over them)."""
    return torch.tensor([0, *torch.tensor(counts, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def page_table(
    lengths, page_size: int, spare: int, share: bool, g: torch.Generator, empty_last: int = 1, own_spare: int = 0
):
    """(indptr, indices, last_page_len, num_pages) of requests of ``lengths``: each request's pages drawn
    from a shuffled pool of used + ``spare`` pages; with ``share``, about a third of the entries name a
    random page of the pool instead (several requests, or one request twice, read one page). A request
    without pages gets ``empty_last`` as its last_page_len (unread). ``own_spare``: pages each request
    owns past those its length needs (MLA's table, which takes lengths, not last_page_len)."""
    counts = [-(-n // page_size) + own_spare for n in lengths]
    used = sum(counts)
    num_pages = max(used + spare, 1)
    indices = torch.randperm(num_pages, generator=g)[:used].to(torch.int32)
    if share and used:
        repeat = torch.rand(used, generator=g) < 0.35
        indices = torch.where(repeat, torch.randint(0, num_pages, (used,), generator=g, dtype=torch.int32), indices)
    indptr = indptr_of(counts)
    last = torch.tensor([(n - 1) % page_size + 1 if n else empty_last for n in lengths], dtype=torch.int32)
    return indptr, indices, last, num_pages


def read_slots(lengths, page_size, indptr, indices, num_pages) -> torch.Tensor:
    """bool [num_pages, page_size]: the slots some request reads."""
    read = torch.zeros(num_pages, page_size, dtype=torch.bool)
    for b, n in enumerate(lengths):
        pages = indices[int(indptr[b]) : int(indptr[b + 1])].long()
        tokens = torch.arange(n)
        read[pages[tokens // page_size], tokens % page_size] = True  # a page named twice: both marks stay
    return read


def kv_planes(num_pages, page_size, heads, head_dim, dtype, case, salt, unread=None, poison=False):
    """K and V as logical NHD planes [pages, page_size, heads, head_dim] of ``dtype``; with ``poison``
    the slots ``unread`` marks hold NaN."""
    shape = (num_pages, page_size, heads, head_dim)
    k = torch.randn(shape, generator=generator(case, salt))
    v = torch.randn(shape, generator=generator(case, salt + 1))
    if poison and unread is not None:
        k[unread] = math.nan
        v[unread] = math.nan
    return k.to(dtype), v.to(dtype)


def as_cache(k, v, form, layout, g):
    """The ``paged_kv_cache`` argument holding the NHD planes k, v: one [pages, 2, ...] tensor, a
    (k, v) pair, K and V with different strides (K rows padded and offset, V every other page of a
    buffer in the other layout), or for page size 1 the squeezed forms ([pages, 2, H, D]; a pair of
    [pages, H, D], V with padded rows)."""

    def plane(x):
        return x if layout == "NHD" else x.transpose(1, 2).contiguous()

    if form == "tensor":
        return torch.stack([plane(k), plane(v)], dim=1)
    if form == "tuple":
        return plane(k), plane(v)
    if form == "squeezed":
        return torch.stack([k[:, 0], v[:, 0]], dim=1)
    if form == "squeezed_tuple":
        v_buf = torch.randn(v[:, 0].shape[:-1] + (v.shape[-1] + 3,), generator=g).to(v.dtype)
        v_buf[..., : v.shape[-1]] = v[:, 0]
        return k[:, 0].contiguous(), v_buf[..., : v.shape[-1]]
    assert form == "strided", form
    pk = plane(k)
    k_buf = torch.randn(pk.shape[:-1] + (pk.shape[-1] + 5,), generator=g).to(k.dtype)
    k_view = k_buf[..., 1 : 1 + pk.shape[-1]]
    k_view.copy_(pk)
    other = v.transpose(1, 2) if layout == "NHD" else v
    v_buf = torch.randn((2 * v.shape[0], *other.shape[1:]), generator=g).to(v.dtype)
    v_buf[1::2] = other
    return k_view, v_buf[1::2].transpose(1, 2)


def cache_forms(page_size: int) -> list[str]:
    return ["tensor", "tuple", "strided"] + (["squeezed", "squeezed_tuple"] if page_size == 1 else [])


def gather(planes, indptr, indices, b, length):
    """Request b's first ``length`` rows of NHD ``planes``, its pages in page-table order."""
    pages = indices[int(indptr[b]) : int(indptr[b + 1])].long()
    return planes[pages].reshape(-1, *planes.shape[2:])[:length]


def requests_reference(q, qo_indptr, kv_of, head_dim_vo, masks=None, **kwargs):
    """float64 (out [rows, heads, head_dim_vo], lse) of a batch: request b's rows
    ``q[qo_indptr[b]:qo_indptr[b + 1]]`` over ``kv_of(b) = (k, v)``, with ``masks[b]`` if given."""
    heads = q.shape[1]
    outs = [torch.zeros(0, heads, head_dim_vo, dtype=torch.float64)]
    lses = [torch.zeros(0, heads, dtype=torch.float64)]
    for b in range(len(qo_indptr) - 1):
        rows = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
        k, v = kv_of(b)
        mask = None if masks is None else masks[b]
        out, lse = attention_reference(q[rows], k, v, mask=mask, **kwargs)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def garbage_tail(t: torch.Tensor, extra: int, g) -> torch.Tensor:
    """``t`` followed by ``extra`` garbage entries (a buffer preallocated for a larger batch)."""
    if not extra:
        return t.clone()
    return torch.cat([t, torch.randint(-5, 1 << 20, (extra,), generator=g, dtype=t.dtype)])


def scribble(*tensors: torch.Tensor) -> None:
    """Overwrite index tensors the caller handed to plan(): run() must not read them."""
    for t in tensors:
        t.fill_(-(1 << 20))


def check_same(first: dict, again: dict, what: str) -> None:
    """A layer run again on the same plan must give the same bits."""
    for name, t in first.items():
        if not torch.equal(bits(t), bits(again[name])):
            raise FuzzFailure(f"{what}: {name} differs from the first run of the same layer on the same plan")


def out_buffers(rows: int, heads: int, head_dim: int, dtype, given: bool):
    """(out, lse) for run(): None (run() allocates them), or NaN-filled views with gaps between rows."""
    if not given:
        return None, None
    out = torch.full((rows, heads + 1, head_dim), math.nan, dtype=dtype)[:, :heads]
    lse = torch.full((rows, heads + 3), math.nan)[:, :heads]
    return out, lse


def strided_q(values: torch.Tensor, strided: bool) -> torch.Tensor:
    """``values`` [rows, heads, D], or the same as the first heads of a wider (qkv-like) buffer."""
    if not strided:
        return values
    rows, heads, dim = values.shape
    buffer = torch.randn(rows, heads + 3, dim).to(values.dtype)
    buffer[:, :heads] = values
    return buffer[:, :heads]


# --------------------------------------------------------------------------- append (and its index helpers)


def draw_append(rng: random.Random) -> dict:
    batch = 1 if rng.random() < 0.3 else rng.randint(2, 7)
    page_size = rng.choice(PAGE_SIZES)
    return {
        "seed": rng.getrandbits(31),
        "seq_before": [kv_length(rng, 300) for _ in range(batch)],
        "appended": [rng.choice([0, 1, 1, size(rng, 40), rng.randint(0, 200)]) for _ in range(batch)],
        "page_size": page_size,
        "spare": rng.choice([0, 1, 3]),
        "heads": rng.choice([1, 2, 3, 8]),
        "head_dim": rng.choice([1, 16, 40, 64, 128, 129]),
        "dtype": rng.choice([FP32, BF16, FP16, E4M3, E5M2]),
        "layout": rng.choice(["NHD", "HND"]),
        "form": (form := rng.choice(["tensor", "tuple"] + (["tensor_page1", "tuple_page1"] if page_size == 1 else []))),
        "rows": rng.choice(["contiguous", "strided"]),  # append_key/append_value: rows in a wider buffer
        "bound": form.startswith("tensor") and rng.random() < 0.4,  # bound_append_paged_kv_cache: tensor caches
        "share_prefix": rng.random() < 0.3,  # requests share their first pages (none an append writes)
        "index_dtype": rng.choice([torch.int32, torch.int32, torch.int64]),
        "threads": rng.choice([1, 2, 3]),
    }


SENTINEL = -7.0  # exact in every cache dtype


def append_backing(case):
    """The storage of the cache, filled with the sentinel: (backing tensors, the cache argument)."""
    page_size, heads, dim, dtype = case["page_size"], case["heads"], case["head_dim"], case["dtype"]
    pages = case["num_pages"]
    plane = (pages, page_size, heads, dim) if case["layout"] == "NHD" else (pages, heads, page_size, dim)
    form = case["form"]
    if form == "tensor":
        backing = [torch.full((pages, 2, *plane[1:]), SENTINEL, dtype=dtype)]
    elif form == "tuple":  # K every other page of a larger buffer, V rows padded by 3
        backing = [
            torch.full((2 * pages + 1, *plane[1:]), SENTINEL, dtype=dtype),
            torch.full((*plane[:3], dim + 3), SENTINEL, dtype=dtype),
        ]
    elif form == "tensor_page1":
        backing = [torch.full((pages, 2, heads, dim), SENTINEL, dtype=dtype)]
    else:
        backing = [
            torch.full((pages, heads, dim), SENTINEL, dtype=dtype),
            torch.full((pages, heads, dim + 3), SENTINEL, dtype=dtype),
        ]
    return backing


def append_cache_views(case, backing):
    """(the paged_kv_cache argument, K as an NHD-ordered 4-D view, V likewise) over ``backing``."""
    form, layout, dim = case["form"], case["layout"], case["head_dim"]

    def nhd(x):  # a plane view in the layout -> [pages, page_size, heads, dim]
        return x if layout == "NHD" else x.transpose(1, 2)

    if form == "tensor":
        return backing[0], nhd(backing[0][:, 0]), nhd(backing[0][:, 1])
    if form == "tuple":
        k, v = backing[0][1::2], backing[1][..., :dim]
        return (k, v), nhd(k), nhd(v)
    if form == "tensor_page1":
        t = backing[0]
        return t, t[:, 0].unsqueeze(1), t[:, 1].unsqueeze(1)
    k, v = backing[0], backing[1][..., :dim]
    return (k, v), k.unsqueeze(1), v.unsqueeze(1)


def append_inputs(case):
    g = generator(case)
    before = torch.tensor(case["seq_before"], dtype=torch.int64)
    appended = torch.tensor(case["appended"], dtype=torch.int64)
    after = (before + appended).tolist()
    # FlashInfer's kv_last_page_len of a request without pages is 0 (get_seq_lens then gives 0).
    indptr, indices, last, num_pages = page_table(after, case["page_size"], case["spare"], False, g, empty_last=0)
    if case["share_prefix"] and len(after) > 1:  # prefix sharing: the full pages before every append, shared
        shared = min(n // case["page_size"] for n in case["seq_before"])
        for b in range(1, len(after)):
            indices[int(indptr[b]) : int(indptr[b]) + shared] = indices[:shared]
    case = {**case, "num_pages": num_pages}
    append_indptr = indptr_of(case["appended"])
    nnz = int(append_indptr[-1])
    shape = (nnz, case["heads"], case["head_dim"])
    key = torch.randn(shape, generator=g).to(case["dtype"])
    value = torch.randn(shape, generator=g).to(case["dtype"])
    if case["rows"] == "strided":
        wide = torch.randn((nnz, case["heads"], case["head_dim"] + 2), generator=g).to(case["dtype"])
        wide[..., 1 : 1 + case["head_dim"]] = key
        key = wide[..., 1 : 1 + case["head_dim"]]
    return {
        "case": case,
        "indptr": indptr,
        "indices": indices,
        "last": last,
        "append_indptr": append_indptr,
        "nnz": nnz,
        "key": key,
        "value": value,
    }


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of their size: an exact comparison for every dtype, NaN included."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def append_run(case, inputs):
    full = inputs["case"]
    index = full["index_dtype"]
    seq_lens = kernforge.get_seq_lens(inputs["indptr"], inputs["last"], full["page_size"])
    batch_indices, positions = kernforge.get_batch_indices_positions(inputs["append_indptr"], seq_lens, inputs["nnz"])
    backing = append_backing(full)
    cache, _, _ = append_cache_views(full, backing)
    args = (
        inputs["key"],
        inputs["value"],
        batch_indices.to(index),
        positions.to(index),
        cache,
        inputs["indices"].to(index),
        inputs["indptr"].to(index),
        inputs["last"].to(index),
        full["layout"],
    )
    with threads(full["threads"]):
        if full["bound"]:  # the prepared decode step's form: into layer 1 of two cache tensors
            other = append_backing(full)
            bound = bound_append_paged_kv_cache(*args[:4], [other[0], cache], *args[5:])
            bound(1)
            if not torch.equal(bits(other[0]), bits(append_backing(full)[0])):
                raise FuzzFailure("bound_append_paged_kv_cache(...)(1) wrote into layer 0's cache")
        else:
            kernforge.append_paged_kv_cache(*args)
    outputs = {"seq_lens": seq_lens, "batch_indices": batch_indices, "positions": positions}
    outputs.update({f"backing{i}": bits(t) for i, t in enumerate(backing)})
    return outputs


def append_reference(case, inputs):
    full = inputs["case"]
    page_size = full["page_size"]
    lengths = [b + a for b, a in zip(full["seq_before"], full["appended"])]
    batch_indices, positions = [], []
    for b, (before, appended) in enumerate(zip(full["seq_before"], full["appended"])):
        batch_indices += [b] * appended
        positions += range(before, before + appended)  # FlashInfer's: seq_len - appended + j
    backing = append_backing(full)
    _, k_view, v_view = append_cache_views(full, backing)
    indptr, indices = inputs["indptr"], inputs["indices"]
    for i, (b, position) in enumerate(zip(batch_indices, positions)):
        page = int(indices[int(indptr[b]) + position // page_size])
        k_view[page, position % page_size] = inputs["key"][i]
        v_view[page, position % page_size] = inputs["value"][i]
    outputs = {
        "seq_lens": torch.tensor(lengths, dtype=torch.int32),
        "batch_indices": torch.tensor(batch_indices, dtype=torch.int32),
        "positions": torch.tensor(positions, dtype=torch.int32),
    }
    outputs.update({f"backing{i}": bits(t) for i, t in enumerate(backing)})
    return outputs


# --------------------------------------------------------------------------- decode


def batch_size(rng: random.Random, high: int) -> int:
    """1 about a third of the time, now and then 0 (an idle step), else 2..high."""
    pick = rng.random()
    return 0 if pick < 0.03 else 1 if pick < 0.33 else rng.randint(2, high)


def draw_decode_plan(rng: random.Random, head_dim: int, first: dict | None) -> dict:
    batch = batch_size(rng, 6)
    page_size = rng.choice(PAGE_SIZES)
    lengths = [kv_length(rng) for _ in range(batch)]
    longest = max(lengths, default=0)
    soft_cap = rng.choice([None, None, None, 1.0, 5.0, 30.0])
    form = rng.choice(cache_forms(page_size))
    # bound: the prepared decode step's bound_run over the layers' cache tensors (no scales, no lse)
    bound = form in ("tensor", "squeezed") and rng.random() < 0.3
    plan = {
        "lengths": lengths,
        "page_size": page_size,
        "spare": rng.choice([0, 1, 3]),
        "share": rng.random() < 0.25,
        "poison": rng.random() < 0.5,  # unread slots hold NaN
        "num_kv_heads": first["num_kv_heads"] if first and rng.random() < 0.5 else rng.choice([1, 1, 2, 3]),
        "window_left": rng.choice([-1, -1, -1, 0, rng.randint(0, max(longest, 1)), rng.randint(1, 40)]),
        "soft_cap": soft_cap,
        "q_magnitude": rng.choice([1.0, 1.0, 4.0 if soft_cap else 6.0]),  # large: peaky softmax, logits past the cap
        "sm_scale": rng.choice([None, None, None, 0.05, 1.0 / math.sqrt(head_dim) * 1.7]),
        "q_scale": rng.choice([None, None, 1.5]),
        "k_scale": scale_arg(rng, [None, None, 0.5, 1.3]),
        "v_scale": scale_arg(rng, [None, None, 0.6, 2.0]),
        "disable_split_kv": rng.random() < 0.2,
        "form": form,
        "layers": rng.choice([1, 1, 2, 3]),
        "io": "bound" if bound else rng.choice(["fresh", "fresh", "given"]),  # given: strided q, out=, lse= views
        "return_lse": not bound and rng.random() < 0.85,
        "index_dtype": rng.choice([torch.int32, torch.int32, torch.int64]),
    }
    if bound:
        plan.update(q_scale=None, k_scale=None, v_scale=None)
    return plan


def draw_decode(rng: random.Random) -> dict:
    q_dtype, kv_dtype, out_dtype, head_dim, group = rng.choice(DECODE_GEOMETRIES)
    plans = [draw_decode_plan(rng, head_dim, None)]
    for _ in range(rng.choice([0, 0, 1, 2])):  # re-plans of the same wrapper
        plans.append(draw_decode_plan(rng, head_dim, plans[0]))
    return {
        "seed": rng.getrandbits(31),
        "q_dtype": q_dtype,
        "kv_dtype": kv_dtype,
        "out_dtype": out_dtype,
        "head_dim": head_dim,
        "group": group or rng.choice([12, 16]),
        "layout": rng.choice(["NHD", "HND"]),
        "threads": rng.choice([1, 2, 3]),
        "plans": plans,
    }


def decode_inputs(case):
    """Per plan: the page table, and per layer the NHD planes, the cache argument and q."""
    g = generator(case)
    D, group = case["head_dim"], case["group"]
    plans = []
    for p, plan in enumerate(case["plans"]):
        lengths = plan["lengths"]
        indptr, indices, last, num_pages = page_table(
            lengths,
            plan["page_size"],
            plan["spare"],
            plan["share"],
            g,
            empty_last=int(torch.randint(0, 9, (1,), generator=g)),
        )
        unread = ~read_slots(lengths, plan["page_size"], indptr, indices, num_pages)
        Hkv = plan["num_kv_heads"]
        layers = []
        for layer in range(plan["layers"]):
            salt = 100 * p + 10 * layer
            k, v = kv_planes(num_pages, plan["page_size"], Hkv, D, case["kv_dtype"], case, salt, unread, plan["poison"])
            cache = as_cache(k, v, plan["form"], case["layout"], g)
            q = (torch.randn((len(lengths), Hkv * group, D), generator=g) * plan["q_magnitude"]).to(case["q_dtype"])
            layers.append({"index": layer, "k": k, "v": v, "cache": cache, "q": q})
        plans.append({"indptr": indptr, "indices": indices, "last": last, "layers": layers})
    return plans


def decode_run(case, inputs):
    outputs = {}
    with threads(case["threads"]):
        wrapper = kernforge.BatchDecodeWithPagedKVCacheWrapper(workspace(), case["layout"])
        for p, (plan, tables) in enumerate(zip(case["plans"], inputs)):
            index = plan["index_dtype"]
            given = [tables[name].to(index).clone() for name in ("indptr", "indices", "last")]
            Hkv = plan["num_kv_heads"]
            wrapper.plan(
                *given,
                Hkv * case["group"],
                Hkv,
                case["head_dim"],
                plan["page_size"],
                window_left=plan["window_left"],
                logits_soft_cap=plan["soft_cap"],
                q_data_type=case["q_dtype"],
                kv_data_type=case["kv_dtype"],
                o_data_type=case["out_dtype"],
                sm_scale=plan["sm_scale"],
                disable_split_kv=plan["disable_split_kv"],
            )
            scribble(*given)
            if plan["io"] == "bound":
                run_layer = bound_layers(wrapper, case, tables["layers"])
            else:
                run_layer = functools.partial(decode_layer, wrapper, case, plan)
            run_layers(outputs, p, tables["layers"], run_layer)
    return outputs


def bound_layers(wrapper, case, layers):
    """A run of one layer through ``bound_run`` over every layer's cache: q and out fixed buffers."""
    first = layers[0]["q"]
    q = torch.empty_like(first)
    out = torch.full(first.shape, math.nan, dtype=case["out_dtype"])
    bound = wrapper.bound_run(q, [layer["cache"] for layer in layers], out)

    def run_layer(layer):
        q.copy_(layer["q"])
        bound(layer["index"])
        return {"out": out.clone()}

    return run_layer


def run_layers(outputs: dict, p: int, layers: list, run_layer) -> None:
    """The layer loop of plan ``p``: every layer, then the first again (the same bits)."""
    first = None
    for layer_index, layer in enumerate(layers):
        got = run_layer(layer)
        first = first or got
        outputs.update({f"p{p}.l{layer_index}.{name}": t for name, t in got.items()})
    check_same(first, run_layer(layers[0]), f"plan {p}")


def run_outputs(result, out, lse, return_lse: bool) -> dict:
    """A wrapper run()'s result as a layer's outputs, copied (the next run may reuse the buffers): out, and
    lse where there is one (returned with ``return_lse``, else the ``lse`` buffer run() was given, which
    it fills too). A given ``out`` must be the tensor run() returns."""
    got_out, got_lse = result if return_lse else (result, lse)
    if out is not None and got_out is not out:
        raise FuzzFailure("run(out=...) did not return the given out")
    got = {"out": got_out.clone()}
    if got_lse is not None:
        got["lse"] = got_lse.clone()
    return got


def planned_run(wrapper, plan, q, kv: tuple, head_dim_vo: int, out_dtype) -> dict:
    """One run() of a decode or prefill plan on ``q`` and the KV arguments ``kv``, the plan's scales as
    drawn; with io "given", q a strided view and out and lse NaN-filled views passed in."""
    given = plan["io"] == "given"
    q = strided_q(q, given)
    rows, heads, _ = q.shape
    out, lse = out_buffers(rows, heads, head_dim_vo, out_dtype, given)
    scales = {name: scale_value(plan[name]) for name in ("q_scale", "k_scale", "v_scale")}
    result = wrapper.run(q, *kv, out=out, lse=lse, return_lse=plan["return_lse"], **scales)
    return run_outputs(result, out, lse, plan["return_lse"])


def decode_layer(wrapper, case, plan, layer) -> dict:
    return planned_run(wrapper, plan, layer["q"], (layer["cache"],), case["head_dim"], case["out_dtype"])


def plan_reference_args(plan, head_dim_qk: int) -> dict:
    """requests_reference's scales, window and cap for a decode or prefill plan, as run() applies them:
    sm_scale (1/sqrt(head_dim_qk) when None) times q_scale, k_scale and v_scale as floats."""
    sm_scale = plan["sm_scale"] if plan["sm_scale"] is not None else 1.0 / math.sqrt(head_dim_qk)
    return {
        "sm_scale": sm_scale * as_float(plan["q_scale"]),
        "window_left": plan["window_left"],
        "soft_cap": plan["soft_cap"] or 0.0,
        "k_scale": scale_float(plan["k_scale"]),
        "v_scale": scale_float(plan["v_scale"]),
    }


def add_layer_reference(outputs: dict, p: int, layer_index: int, plan, out, lse) -> None:
    """A layer's reference under the names run_layers gives the run's outputs; lse only where run() gives
    one (return_lse, or the lse buffer of io "given")."""
    outputs[f"p{p}.l{layer_index}.out"] = out
    if plan["return_lse"] or plan["io"] == "given":
        outputs[f"p{p}.l{layer_index}.lse"] = lse


def decode_reference(case, inputs):
    outputs = {}
    for p, (plan, tables) in enumerate(zip(case["plans"], inputs)):
        settings = plan_reference_args(plan, case["head_dim"])
        for layer_index, layer in enumerate(tables["layers"]):
            q = layer["q"]
            out, lse = requests_reference(
                q,
                list(range(q.shape[0] + 1)),
                lambda b: tuple(
                    gather(x, tables["indptr"], tables["indices"], b, plan["lengths"][b])
                    for x in (layer["k"], layer["v"])
                ),
                case["head_dim"],
                **settings,
            )
            add_layer_reference(outputs, p, layer_index, plan, out, lse)
    return outputs


def decode_tolerance(case):
    dtype = computed_in(case["q_dtype"], case["kv_dtype"], case["out_dtype"])
    return attention_tolerance(dtype, DECODE_LSE_TOL, case["plans"])


# --------------------------------------------------------------------------- prefill (paged and ragged)


def draw_prefill_request(rng: random.Random, causal: bool) -> tuple[int, int]:
    """(qo_len, kv_len): a prefill chunk on a prefix, a decode-like step on a long prefix, or lengths
    drawn apart (causal rows of qo_len > kv_len then see no key)."""
    pick = rng.random()
    if pick < 0.5:
        qo = size(rng, 70)
        return qo, qo + rng.choice([0, 0, size(rng, 70), rng.randint(0, 300)])
    if pick < 0.65:
        return rng.choice([1, 2, 3]), kv_length(rng, 1500)
    if pick < 0.75:
        return rng.randint(71, 160), rng.randint(0, 300)
    return size(rng, 40), kv_length(rng, 200)


def draw_prefill_plan(rng: random.Random, ragged: bool, first: dict | None, tile: bool) -> dict:
    batch = batch_size(rng, 5)
    causal = rng.random() < 0.6
    requests = [draw_prefill_request(rng, causal) for _ in range(batch)]
    soft_cap = None if tile else rng.choice([None, None, None, 2.0, 30.0])
    mask = "none" if tile else rng.choice(["none", "none", "none", "custom", "packed"])
    page_size = 1 if ragged else rng.choice(PAGE_SIZES)
    longest = max((kv for _, kv in requests), default=0)
    return {
        "qo_lens": [qo for qo, _ in requests],
        "kv_lens": [kv for _, kv in requests],
        "causal": causal,
        "mask": mask,
        "mask_density": rng.choice([0.1, 0.7, 1.0]),
        "page_size": page_size,
        "spare": rng.choice([0, 1, 3]),
        "share": not ragged and rng.random() < 0.25,
        "poison": rng.random() < 0.5,
        "extra": 0 if mask != "none" else rng.choice([0, 0, 0, 1, 3]),  # indptr buffers longer than the batch
        "num_kv_heads": first["num_kv_heads"] if first and rng.random() < 0.5 else rng.choice([1, 1, 2, 3]),
        "group": rng.choice([1, 1, 2, 3, 4, 5, 6, 7, 8]),
        "window_left": rng.choice([-1, -1, -1, 0, rng.randint(0, max(longest, 1)), rng.randint(1, 40)]),
        "soft_cap": soft_cap,
        "q_magnitude": rng.choice([1.0, 1.0, 3.0 if soft_cap else 6.0]),
        "sm_scale": None if tile else rng.choice([None, None, None, 0.05, 0.2]),
        "q_scale": None if tile else rng.choice([None, None, 1.5]),
        "k_scale": scale_arg(rng, [None, None, 0.5, 1.3]),
        "v_scale": scale_arg(rng, [None, None, 0.6, 2.0]),
        "disable_split_kv": rng.random() < 0.2,
        "form": rng.choice(cache_forms(page_size)),
        "extra_rows": rng.choice([0, 0, 5]),  # ragged K/V rows past kv_indptr[-1]
        "layers": rng.choice([1, 1, 2, 3]),
        "io": rng.choice(["fresh", "fresh", "given"]),
        "return_lse": rng.random() < 0.85,
        "index_dtype": rng.choice([torch.int32, torch.int32, torch.int64]),
    }


def draw_prefill(ragged: bool):
    def draw(rng: random.Random) -> dict:
        tile = ragged and rng.random() < 0.2
        geometry = TILE_GEOMETRY if tile else rng.choice(RAGGED_GEOMETRIES if ragged else PREFILL_GEOMETRIES)
        dtype, kv_dtype, head_dim_qk, head_dim_vo = geometry
        plans = [draw_prefill_plan(rng, ragged, None, tile)]
        for _ in range(rng.choice([0, 0, 1, 2])):
            plans.append(draw_prefill_plan(rng, ragged, plans[0], tile))
        return {
            "seed": rng.getrandbits(31),
            "dtype": dtype,
            "kv_dtype": kv_dtype,
            "head_dim_qk": head_dim_qk,
            "head_dim_vo": head_dim_vo,
            "tile": rng.choice(TILES) if tile else None,
            "layout": rng.choice(["NHD", "HND"]),
            "threads": rng.choice([1, 2, 3]),
            "plans": plans,
        }

    return draw


def mask_of(plan, g) -> list[torch.Tensor] | None:
    if plan["mask"] == "none":
        return None
    return [torch.rand(qo, kv, generator=g) < plan["mask_density"] for qo, kv in zip(plan["qo_lens"], plan["kv_lens"])]


def packbits(masks) -> torch.Tensor:
    """FlashInfer's segment_packbits, little bit order: each request from a byte boundary."""
    packed = [torch.zeros(0, dtype=torch.uint8)]
    for m in masks:
        flat = m.reshape(-1).to(torch.uint8)
        flat = torch.cat([flat, flat.new_zeros(-len(flat) % 8)])
        packed.append((flat.view(-1, 8) << torch.arange(8, dtype=torch.uint8)).sum(1).to(torch.uint8))
    return torch.cat(packed)


def prefill_inputs(ragged: bool):
    def inputs(case):
        g = generator(case)
        Dqk, Dvo = case["head_dim_qk"], case["head_dim_vo"]
        plans = []
        for p, plan in enumerate(case["plans"]):
            qo_lens, kv_lens = plan["qo_lens"], plan["kv_lens"]
            qo_indptr = indptr_of(qo_lens)
            Hkv = plan["num_kv_heads"]
            Hq = Hkv * plan["group"]
            masks = mask_of(plan, g)
            tables = {"qo_indptr": qo_indptr, "masks": masks, "layers": []}
            if ragged:
                kv_indptr = indptr_of(kv_lens)
                tables["kv_indptr"] = kv_indptr
                rows = int(kv_indptr[-1]) + plan["extra_rows"]
            else:
                empty_last = int(torch.randint(0, 9, (1,), generator=g))  # unread: a request without pages
                indptr, indices, last, num_pages = page_table(
                    kv_lens, plan["page_size"], plan["spare"], plan["share"], g, empty_last
                )
                unread = ~read_slots(kv_lens, plan["page_size"], indptr, indices, num_pages)
                tables.update(indptr=indptr, indices=indices, last=last)
            for layer in range(plan["layers"]):
                salt = 100 * p + 10 * layer
                q = torch.randn((int(qo_indptr[-1]), Hq, Dqk), generator=g) * plan["q_magnitude"]
                entry = {"q": q.to(case["dtype"])}
                if ragged:
                    k = torch.randn((rows, Hkv, Dqk), generator=generator(case, salt))
                    v = torch.randn((rows, Hkv, Dvo), generator=generator(case, salt + 1))
                    if plan["poison"]:
                        k[int(kv_indptr[-1]) :] = math.nan
                        v[int(kv_indptr[-1]) :] = math.nan
                    k, v = k.to(case["kv_dtype"]), v.to(case["kv_dtype"])
                    entry.update(k=k, v=v)
                    if case["layout"] == "HND":
                        entry.update(k_arg=k.transpose(0, 1).contiguous(), v_arg=v.transpose(0, 1).contiguous())
                    else:
                        entry.update(k_arg=k, v_arg=v)
                else:
                    k, v = kv_planes(
                        num_pages, plan["page_size"], Hkv, Dqk, case["kv_dtype"], case, salt, unread, plan["poison"]
                    )
                    entry.update(k=k, v=v, cache=as_cache(k, v, plan["form"], case["layout"], g))
                tables["layers"].append(entry)
            plans.append(tables)
        return plans

    return inputs


def prefill_run(ragged: bool):
    def run(case, inputs):
        outputs = {}
        with threads(case["threads"]):
            cls = (
                kernforge.BatchPrefillWithRaggedKVCacheWrapper
                if ragged
                else kernforge.BatchPrefillWithPagedKVCacheWrapper
            )
            wrapper = cls(workspace(), case["layout"])
            for p, (plan, tables) in enumerate(zip(case["plans"], inputs)):
                given = plan_prefill(wrapper, case, plan, tables, ragged)
                scribble(*given)
                run_layers(
                    outputs, p, tables["layers"], lambda layer: prefill_layer(wrapper, case, plan, layer, ragged)
                )
        return outputs

    return run


def plan_prefill(wrapper, case, plan, tables, ragged: bool) -> list[torch.Tensor]:
    """plan() of ``plan``; returns the index tensors it was given (to scribble on)."""
    g = torch.Generator().manual_seed(case["seed"] + 1)
    index = plan["index_dtype"]
    Hkv = plan["num_kv_heads"]
    masks = tables["masks"]
    mask_args = {}
    if plan["mask"] == "custom":
        mask_args["custom_mask"] = torch.cat([m.reshape(-1) for m in masks]) if masks else torch.zeros(0, dtype=bool)
    elif plan["mask"] == "packed":
        mask_args["packed_custom_mask"] = packbits(masks)
    qo_indptr = tables["qo_indptr"].to(index).clone()
    common = dict(
        causal=plan["causal"],
        window_left=plan["window_left"],
        q_data_type=case["dtype"],
        kv_data_type=case["kv_dtype"],
        disable_split_kv=plan["disable_split_kv"],
    )
    if case["tile"] is not None:
        kv_indptr = tables["kv_indptr"].to(index).clone()
        del common["disable_split_kv"]
        wrapper.plan_with_tile(
            qo_indptr, kv_indptr, Hkv * plan["group"], Hkv, case["head_dim_qk"], case["tile"],
            head_dim_vo=case["head_dim_vo"], **common,
        )  # fmt: skip
        return [qo_indptr, kv_indptr]
    common.update(logits_soft_cap=plan["soft_cap"], sm_scale=plan["sm_scale"], **mask_args)
    if ragged:
        kv_indptr = tables["kv_indptr"].to(index).clone()
        wrapper.plan(qo_indptr, kv_indptr, Hkv * plan["group"], Hkv, case["head_dim_qk"], case["head_dim_vo"], **common)
        return [qo_indptr, kv_indptr]
    extra = plan["extra"]
    indptr, last, indices = (garbage_tail(tables[name], extra, g).to(index) for name in ("indptr", "last", "indices"))
    wrapper.plan(
        qo_indptr, indptr, indices, last, Hkv * plan["group"], Hkv, case["head_dim_qk"], plan["page_size"], **common
    )
    return [qo_indptr, indptr, indices, last]


def prefill_layer(wrapper, case, plan, layer, ragged: bool) -> dict:
    kv = (layer["k_arg"], layer["v_arg"]) if ragged else (layer["cache"],)
    return planned_run(wrapper, plan, layer["q"], kv, case["head_dim_vo"], case["dtype"])


def prefill_reference(ragged: bool):
    def reference(case, inputs):
        outputs = {}
        for p, (plan, tables) in enumerate(zip(case["plans"], inputs)):
            settings = plan_reference_args(plan, case["head_dim_qk"])
            for layer_index, layer in enumerate(tables["layers"]):
                if ragged:
                    kv_indptr = tables["kv_indptr"]

                    def kv_of(b, layer=layer, kv_indptr=kv_indptr):
                        rows = slice(int(kv_indptr[b]), int(kv_indptr[b + 1]))
                        return layer["k"][rows], layer["v"][rows]
                else:

                    def kv_of(b, layer=layer):
                        n = plan["kv_lens"][b]
                        return tuple(
                            gather(x, tables["indptr"], tables["indices"], b, n) for x in (layer["k"], layer["v"])
                        )

                out, lse = requests_reference(
                    layer["q"],
                    tables["qo_indptr"],
                    kv_of,
                    case["head_dim_vo"],
                    tables["masks"],
                    causal=plan["causal"],
                    **settings,
                )
                add_layer_reference(outputs, p, layer_index, plan, out, lse)
        return outputs

    return reference


def prefill_tolerance(case):
    dtype = computed_in(case["dtype"], case["kv_dtype"])
    return attention_tolerance(dtype, PREFILL_LSE_TOL, case["plans"])


# --------------------------------------------------------------------------- single-request ops


def draw_single_decode(rng: random.Random) -> dict:
    q_dtype, kv_dtype, _, head_dim, group = rng.choice([g for g in DECODE_GEOMETRIES if g[2] == g[0]])
    soft_cap = rng.choice([None, None, None, 5.0])
    kv_len = kv_length(rng)
    return {
        "seed": rng.getrandbits(31),
        "q_dtype": q_dtype,
        "kv_dtype": kv_dtype,
        "head_dim": head_dim,
        "num_kv_heads": rng.choice([1, 2, 3]),
        "group": group or rng.choice([12, 16]),
        "kv_len": kv_len,
        "layout": rng.choice(["NHD", "HND"]),
        "kv_rows": rng.choice(["contiguous", "padded"]),  # k and v rows in a wider buffer
        "window_left": rng.choice([-1, -1, 0, rng.randint(0, max(kv_len, 1))]),
        "soft_cap": soft_cap,
        "q_magnitude": rng.choice([1.0, 4.0]),
        "sm_scale": rng.choice([None, None, 0.07]),
        "q_scale": rng.choice([None, None, 1.5]),
        "k_scale": scale_arg(rng, [None, None, 0.5]),
        "v_scale": scale_arg(rng, [None, None, 2.0]),
        "return_lse": rng.random() < 0.7,
        "threads": rng.choice([1, 2, 3]),
    }


def single_kv(case, shape_k, shape_v, dtype):
    """(k, v) NHD values and the op's arguments in the case's layout and row form."""
    k = torch.randn(shape_k, generator=generator(case, 1)).to(dtype)
    v = torch.randn(shape_v, generator=generator(case, 2)).to(dtype)

    def arg(x):
        x = x if case["layout"] == "NHD" else x.transpose(0, 1).contiguous()
        if case.get("kv_rows") == "padded":
            wide = torch.full((*x.shape[:-1], x.shape[-1] + 3), math.nan).to(dtype)
            wide[..., : x.shape[-1]] = x
            x = wide[..., : x.shape[-1]]
        return x

    return k, v, arg(k), arg(v)


def single_decode_inputs(case):
    Hkv, D = case["num_kv_heads"], case["head_dim"]
    q = (torch.randn((Hkv * case["group"], D), generator=generator(case)) * case["q_magnitude"]).to(case["q_dtype"])
    k, v, k_arg, v_arg = single_kv(case, (case["kv_len"], Hkv, D), (case["kv_len"], Hkv, D), case["kv_dtype"])
    return q, k, v, k_arg, v_arg


def single_decode_run(case, inputs):
    q, _, _, k_arg, v_arg = inputs
    with threads(case["threads"]):
        result = kernforge.single_decode_with_kv_cache(
            q,
            k_arg,
            v_arg,
            kv_layout=case["layout"],
            q_scale=scale_value(case["q_scale"]),
            k_scale=scale_value(case["k_scale"]),
            v_scale=scale_value(case["v_scale"]),
            window_left=case["window_left"],
            logits_soft_cap=case["soft_cap"],
            sm_scale=case["sm_scale"],
            return_lse=case["return_lse"],
        )
    return {"out": result[0], "lse": result[1]} if case["return_lse"] else {"out": result}


def single_decode_reference(case, inputs):
    q, k, v, _, _ = inputs
    sm_scale = (case["sm_scale"] or 1.0 / math.sqrt(case["head_dim"])) * as_float(case["q_scale"])
    out, lse = attention_reference(
        q[None],
        k,
        v,
        sm_scale=sm_scale,
        window_left=case["window_left"],
        soft_cap=case["soft_cap"] or 0.0,
        k_scale=scale_float(case["k_scale"]),
        v_scale=scale_float(case["v_scale"]),
    )
    return {"out": out[0], "lse": lse[0]} if case["return_lse"] else {"out": out[0]}


def single_decode_tolerance(case):
    return {"out": out_tolerance(computed_in(case["q_dtype"], case["kv_dtype"]), case), "lse": DECODE_LSE_TOL}


def draw_single_prefill(return_lse_op: bool):
    def draw(rng: random.Random) -> dict:
        dtype, kv_dtype, head_dim_qk, head_dim_vo = rng.choice(RAGGED_GEOMETRIES)
        causal = rng.random() < 0.6
        qo_len, kv_len = draw_prefill_request(rng, causal)
        soft_cap = rng.choice([None, None, None, 2.0])
        return {
            "seed": rng.getrandbits(31),
            "dtype": dtype,
            "kv_dtype": kv_dtype,
            "head_dim_qk": head_dim_qk,
            "head_dim_vo": head_dim_vo,
            "qo_len": qo_len,
            "kv_len": kv_len,
            "num_kv_heads": rng.choice([1, 2, 3]),
            "group": rng.choice([1, 2, 3, 4, 5, 6, 7, 8]),
            "layout": rng.choice(["NHD", "HND"]),
            "kv_rows": rng.choice(["contiguous", "padded"]),
            "causal": causal,
            "mask": rng.choice(["none", "none", "custom", "packed"]),
            "window_left": rng.choice([-1, -1, 0, rng.randint(0, max(kv_len, 1))]),
            "soft_cap": soft_cap,
            "q_magnitude": rng.choice([1.0, 3.0]),
            "sm_scale": rng.choice([None, None, 0.1]),
            "k_scale": rng.choice([None, None, 0.7]),
            "v_scale": rng.choice([None, None, 1.8]),
            "return_lse": return_lse_op or rng.random() < 0.5,
            "threads": rng.choice([1, 2, 3]),
        }

    return draw


def single_prefill_inputs(case):
    Hkv, Dqk, Dvo = case["num_kv_heads"], case["head_dim_qk"], case["head_dim_vo"]
    g = generator(case, 3)
    q = (torch.randn((case["qo_len"], Hkv * case["group"], Dqk), generator=g) * case["q_magnitude"]).to(case["dtype"])
    k, v, k_arg, v_arg = single_kv(case, (case["kv_len"], Hkv, Dqk), (case["kv_len"], Hkv, Dvo), case["kv_dtype"])
    mask = None if case["mask"] == "none" else torch.rand(case["qo_len"], case["kv_len"], generator=g) < 0.7
    return q, k, v, k_arg, v_arg, mask


def single_prefill_run(return_lse_op: bool):
    def run(case, inputs):
        q, _, _, k_arg, v_arg, mask = inputs
        op = (
            kernforge.single_prefill_with_kv_cache_return_lse
            if return_lse_op
            else kernforge.single_prefill_with_kv_cache
        )
        kwargs = {} if return_lse_op else {"return_lse": case["return_lse"]}
        if case["mask"] == "custom":
            kwargs["custom_mask"] = mask
        elif case["mask"] == "packed":
            kwargs["packed_custom_mask"] = packbits([mask])
        with threads(case["threads"]):
            result = op(
                q,
                k_arg,
                v_arg,
                causal=case["causal"],
                kv_layout=case["layout"],
                sm_scale=case["sm_scale"],
                window_left=case["window_left"],
                logits_soft_cap=case["soft_cap"],
                k_scale=case["k_scale"],
                v_scale=case["v_scale"],
                **kwargs,
            )
        return {"out": result[0], "lse": result[1]} if case["return_lse"] else {"out": result}

    return run


def single_prefill_reference(case, inputs):
    q, k, v, _, _, mask = inputs
    out, lse = attention_reference(
        q,
        k,
        v,
        sm_scale=case["sm_scale"] or 1.0 / math.sqrt(case["head_dim_qk"]),
        causal=case["causal"],
        mask=mask,
        window_left=case["window_left"],
        soft_cap=case["soft_cap"] or 0.0,
        k_scale=as_float(case["k_scale"]),
        v_scale=as_float(case["v_scale"]),
    )
    return {"out": out, "lse": lse} if case["return_lse"] else {"out": out}


def single_prefill_tolerance(case):
    return {"out": out_tolerance(computed_in(case["dtype"], case["kv_dtype"]), case), "lse": PREFILL_LSE_TOL}


# --------------------------------------------------------------------------- cascade: merging attention states


def draw_states(rng: random.Random, num_states: int | None) -> dict:
    return {
        "seed": rng.getrandbits(31),
        "seq_len": size(rng, 40),
        "num_states": num_states if num_states is not None else rng.choice([0, 1, 2, 3, 5, 8]),
        "num_heads": rng.choice([1, 2, 3, 8]),
        "head_dim": rng.choice([1, 7, 16, 64, 72, 100, 128, 129]),
        "dtype": rng.choice([FP32, BF16, FP16]),
        "empty": rng.choice([0.0, 0.0, 0.2, 1.0]),  # the share of states with s = -inf (empty key sets)
        "spread": rng.choice([0.5, 4.0, 40.0]),  # how far apart the states' s lie
        "v_layout": rng.choice(["contiguous", "padded", "strided_dim"]),
        "s_layout": rng.choice(["contiguous", "strided", "bf16"]),  # bf16: a read-only s of another dtype
        "masked": rng.random() < 0.5,  # merge_state_in_place's mask
        "threads": rng.choice([1, 2, 3]),
    }


def states(case, shape, salt):
    """(v [*shape, head_dim] of the dtype, s [*shape] float32): s spread around 0, some -inf (empty)."""
    g = generator(case, salt)
    v = torch.randn((*shape, case["head_dim"]), generator=g).to(case["dtype"])
    s = torch.randn(shape, generator=g) * case["spread"]
    s = torch.where(torch.rand(shape, generator=g) < case["empty"], -math.inf, s)
    return v, s


def v_laid_out(v: torch.Tensor, how: str) -> torch.Tensor:
    if how == "padded":
        wide = torch.full((*v.shape[:-1], v.shape[-1] + 3), math.nan, dtype=v.dtype)
        wide[..., : v.shape[-1]] = v
        return wide[..., : v.shape[-1]]
    if how == "strided_dim":  # a strided last dimension: read from a copy
        return v.transpose(-1, -2).contiguous().transpose(-1, -2)
    return v


def s_laid_out(s: torch.Tensor, how: str) -> torch.Tensor:
    if how == "strided":
        wide = torch.full((*s.shape[:-1], s.shape[-1] + 2), math.nan)
        wide[..., : s.shape[-1]] = s
        return wide[..., : s.shape[-1]]
    if how == "bf16":
        return s.to(BF16)  # converted as FlashInfer's .to(float32)
    return s


def ref_merge(v, s):
    """float64 merge of states v [T, N, H, D], s [T, N, H] (base 2) over N; empty -> (0, -inf).
    A state with s = -inf contributes nothing, whatever its v holds (test_cascade.py's)."""
    v64, s64 = v.double(), s.double()
    v64 = torch.where(torch.isneginf(s64)[..., None], 0.0, v64)
    T, _, H = s64.shape
    s_max = s64.amax(dim=1, keepdim=True) if s64.shape[1] else torch.full((T, 1, H), -math.inf, dtype=s64.dtype)
    empty = torch.isneginf(s_max)
    w = torch.exp2(s64 - torch.where(empty, 0.0, s_max))
    total = w.sum(dim=1, keepdim=True)
    out = (v64 * (w / torch.where(empty, 1.0, total))[..., None]).sum(dim=1)
    lse = torch.where(empty, -math.inf, s_max + torch.log2(total)).squeeze(1)
    return out, lse


def cascade_tolerance(case):
    tol = ATTENTION_TOL[case["dtype"]]
    return {"v": (tol, tol), "s": STATE_S_TOL}


def pair_inputs(case):
    shape = (case["seq_len"], case["num_heads"])
    (v_a, s_a), (v_b, s_b) = states(case, shape, 0), states(case, shape, 1)
    mask = torch.rand(case["seq_len"], generator=generator(case, 2)) < 0.5
    return v_a, s_a, v_b, s_b, mask


def merge_state_run(case, inputs):
    v_a, s_a, v_b, s_b, _ = inputs
    how_v, how_s = case["v_layout"], case["s_layout"]
    with threads(case["threads"]):
        v, s = kernforge.merge_state(v_laid_out(v_a, how_v), s_laid_out(s_a, how_s), v_laid_out(v_b, how_v), s_b)
    return {"v": v, "s": s}


def merge_state_reference(case, inputs):
    v_a, s_a, v_b, s_b, _ = inputs
    s_dtype = BF16 if case["s_layout"] == "bf16" else FP32
    v, s = ref_merge(torch.stack([v_a, v_b], 1), torch.stack([s_a.to(s_dtype).float(), s_b], 1))
    return {"v": v, "s": s}


def merge_in_place_run(case, inputs):
    v_a, s_a, v_b, s_b, mask = inputs
    # The updated v and s need a contiguous last dimension: rows padded or not; the other state any layout.
    v = v_laid_out(v_a, "padded") if case["v_layout"] == "padded" else v_a.clone()
    s = s_laid_out(s_a, "strided") if case["s_layout"] == "strided" else s_a.clone()
    with threads(case["threads"]):
        kernforge.merge_state_in_place(
            v, s, v_laid_out(v_b, case["v_layout"]), s_laid_out(s_b, case["s_layout"]), mask if case["masked"] else None
        )
    return {"v": v.clone(), "s": s.clone()}


def merge_in_place_reference(case, inputs):
    v_a, s_a, v_b, s_b, mask = inputs
    s_other = s_b.to(BF16).float() if case["s_layout"] == "bf16" else s_b
    v, s = ref_merge(torch.stack([v_a, v_b], 1), torch.stack([s_a, s_other], 1))
    if case["masked"]:  # the unmasked tokens keep their state as it was
        v = torch.where(mask[:, None, None], v, v_a.double())
        s = torch.where(mask[:, None], s, s_a.double())
    return {"v": v, "s": s}


def merge_states_inputs(case):
    return states(case, (case["seq_len"], case["num_states"], case["num_heads"]), 0)


def merge_states_run(case, inputs):
    v, s = inputs
    with threads(case["threads"]):
        v_out, s_out = kernforge.merge_states(v_laid_out(v, case["v_layout"]), s_laid_out(s, case["s_layout"]))
    return {"v": v_out, "s": s_out}


def merge_states_reference(case, inputs):
    v, s = inputs
    if case["s_layout"] == "bf16":
        s = s.to(BF16).float()
    out, lse = ref_merge(v, s)
    return {"v": out, "s": lse}


TARGETS = [
    target("append_paged_kv_cache", draw_append, append_inputs, append_run, append_reference, lambda case: (0, 0)),
    target(
        "BatchDecodeWithPagedKVCacheWrapper",
        draw_decode,
        decode_inputs,
        decode_run,
        decode_reference,
        decode_tolerance,
    ),
    target(
        "BatchPrefillWithPagedKVCacheWrapper",
        draw_prefill(False),
        prefill_inputs(False),
        prefill_run(False),
        prefill_reference(False),
        prefill_tolerance,
    ),
    target(
        "BatchPrefillWithRaggedKVCacheWrapper",
        draw_prefill(True),
        prefill_inputs(True),
        prefill_run(True),
        prefill_reference(True),
        prefill_tolerance,
    ),
    target(
        "single_decode_with_kv_cache",
        draw_single_decode,
        single_decode_inputs,
        single_decode_run,
        single_decode_reference,
        single_decode_tolerance,
    ),
    target(
        "single_prefill_with_kv_cache",
        draw_single_prefill(False),
        single_prefill_inputs,
        single_prefill_run(False),
        single_prefill_reference,
        single_prefill_tolerance,
    ),
    target(
        "single_prefill_with_kv_cache_return_lse",
        draw_single_prefill(True),
        single_prefill_inputs,
        single_prefill_run(True),
        single_prefill_reference,
        single_prefill_tolerance,
    ),
    target(
        "merge_state",
        lambda rng: draw_states(rng, 2),
        pair_inputs,
        merge_state_run,
        merge_state_reference,
        cascade_tolerance,
    ),
    target(
        "merge_state_in_place",
        lambda rng: draw_states(rng, 2),
        pair_inputs,
        merge_in_place_run,
        merge_in_place_reference,
        cascade_tolerance,
    ),
    target(
        "merge_states",
        lambda rng: draw_states(rng, None),
        merge_states_inputs,
        merge_states_run,
        merge_states_reference,
        cascade_tolerance,
    ),
]
