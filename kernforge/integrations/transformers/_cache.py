"""The paged KV cache: a transformers ``Cache`` whose keys and values live in kernforge's pages.

One :class:`PagePool` per optimized model holds every layer's pages (``[num_pages, 2, num_kv_heads,
page_size, head_dim]`` per layer, FlashInfer's HND layout: see :data:`KV_LAYOUT`) and a free list. A
:class:`PagedCache` is one batch's use of the pool: the pages of each sequence, in order, and
the attention plans of the current step. Pages return to the pool when the cache is reset or
garbage-collected.

A step (one forward of the model) is planned once, by its first attention layer
(:meth:`PagedCache.begin_step`): the new tokens of each sequence (the padding mask's ones), page
allocation, the page table, and ``plan()`` of the prefill or decode wrapper; every layer then
appends its keys and values (:meth:`PagedCache.update`) and runs the planned wrapper over its
own pages (:meth:`PagedCache.attend`). Left padding is never written to the cache: a padded
prompt's pad positions are dropped from the queries and keys, and their outputs are zeros.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kernforge.integrations.transformers import _kernels as kf
from kernforge.memory import empty_kv_cache

_WORKSPACE_BYTES = 16 << 20  # the wrappers grow it when a plan needs more

# The pages' layout. HND: a head's rows of a page are one run of bytes (4 KiB for 16 tokens of
# head_dim 128 in bf16), which decode reads head by head; in NHD a head's row is 256 bytes of every
# 2 KiB. On a Zen 4, decode read the KV 1.06-1.20x faster from HND pages of 16 than from NHD pages
# of 16 (head dim 64 and 128, batches 1-64, 1K-32K tokens; 1.02x for one request of 1K), and HND
# pages of 64-256 within 4 % of HND 16 (docs/notes/2026-11-26-issue-22-pass-2-hnd-layout.md), so the page size stays
# optimize()'s page_size.
KV_LAYOUT = "HND"


class KVCacheFullError(RuntimeError):
    """The page pool has no free page left for a step."""


@dataclass(frozen=True)
class AttentionSpec:
    """What every layer's attention shares: the plan's parameters."""

    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    sm_scale: float
    window_lefts: tuple[int, ...]  # per layer; -1: full attention

    def page_shape(self, page_size: int) -> tuple[int, ...]:
        """One layer's page: K and V planes of ``page_size`` tokens (FlashInfer's HND layout)."""
        return (2, self.num_kv_heads, page_size, self.head_dim)


class PagePool:
    """The KV pages of an optimized model (every layer's, one allocation) and their free list."""

    def __init__(self, spec: AttentionSpec, num_pages: int, page_size: int):
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"kv_cache_pages must be a positive int, got {num_pages!r}")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.num_pages, self.page_size = num_pages, page_size
        # Uninitialized: the OS backs memory when it is first written, so an unused part of a large
        # pool costs address space only; in 2 MiB huge pages where Linux allows, which spare decode
        # most of its TLB misses over the scattered pages (kernforge.memory).
        self.kv = empty_kv_cache(spec.num_layers, num_pages, *spec.page_shape(page_size), dtype=spec.dtype)
        self.layers = list(self.kv)  # each layer's pages, as views made once (a prepared step binds to them)
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out the lowest page first

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            held = self.num_pages - len(self._free)
            raise KVCacheFullError(
                f"the KV cache is out of pages: this step needs {count} more pages of {self.page_size} tokens, "
                f"{len(self._free)} of kv_cache_pages={self.num_pages} are free; pass "
                f"kv_cache_pages={held + count} or more to kernforge.integrations.transformers.optimize()"
                + (
                    f" ({held} of them for the pages live caches hold: a PagedCache returns its pages when "
                    "reset() or garbage-collected)"
                    if held
                    else ""
                )
            )
        return [self._free.pop() for _ in range(count)]

    def release(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


def new_cache(model) -> PagedCache:
    """A fresh :class:`PagedCache` on ``model``'s page pool (``model`` optimized by ``optimize()``)."""
    runtime = getattr(model, "_kernforge", None)
    if runtime is None:
        raise ValueError("new_cache(model) needs a model prepared by kernforge.integrations.transformers.optimize()")
    return paged_cache(runtime.spec, runtime.pool)


def paged_cache(spec, pool: PagePool) -> PagedCache:
    """A fresh cache of the kind ``spec`` describes: :class:`MLAPagedCache` for an :class:`MLASpec`."""
    return MLAPagedCache(spec, pool) if isinstance(spec, MLASpec) else PagedCache(spec, pool)


def _release_all(pool: PagePool, sequence_pages: list[list[int]]) -> None:
    for pages in sequence_pages:
        pool.release(pages)
    sequence_pages.clear()


@dataclass
class _Step:
    """One forward's plan, shared by every layer."""

    batch: int
    q_len: int
    gather: torch.Tensor | None  # rows (of batch * q_len) that are real tokens; None: all of them
    wrappers: dict  # window_left -> planned wrapper (MLA: the path's name -> planned wrapper)
    batch_indices: torch.Tensor  # append_paged_kv_cache's arguments besides the keys, values and pages
    positions: torch.Tensor
    kv_indices: torch.Tensor
    kv_indptr: torch.Tensor
    last_page_len: torch.Tensor


class PagedLayer(CacheLayerMixin):
    """One layer's view of a :class:`PagedCache` (transformers' per-layer cache interface)."""

    supports_early_init = False

    def __init__(self, cache: PagedCache, layer_idx: int):
        super().__init__()
        self._cache = weakref.proxy(cache)  # the cache owns its layers: no reference cycle
        self.layer_idx = layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        """Nothing to do: the pages exist from the start."""

    def update(self, key_states, value_states, *args, **kwargs):
        return self._cache.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        return self._cache.get_mask_sizes(query_length)

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length  # its name before transformers 5.x renamed it

    def reset(self) -> None:
        self._cache.reset()


class PagedCache(Cache):
    """A transformers ``Cache`` over kernforge's paged KV cache, for one batch of sequences.

    ``get_seq_length()`` is the number of positions processed, padding included (as
    ``DynamicCache`` counts them); :attr:`sequence_lengths` are the tokens each sequence has in
    its pages. ``update()`` writes the new keys and values of the current step into the pages
    and returns its arguments unchanged: attention reads the pages (:meth:`attend`), never a
    concatenated tensor. Beam search (``reorder_cache``) and cache cropping are not supported.
    """

    def __init__(self, spec: AttentionSpec, pool: PagePool):
        super().__init__(layers=[PagedLayer(self, i) for i in range(spec.num_layers)])
        self.spec, self.pool = spec, pool
        self._sequence_pages: list[list[int]] = []
        self.sequence_lengths: list[int] = []
        self._seen = 0
        self._step: _Step | None = None
        self._planned_ahead = False  # plan_step() planned the next forward
        self._wrappers: dict = {}  # (decode, window_left) -> wrapper, reused step after step
        weakref.finalize(self, _release_all, pool, self._sequence_pages)

    # ------------------------------------------------------------------ transformers' Cache interface

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._seen

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # transformers < 5.x passes cache_position
            query_length = query_length.shape[0]
        return self._seen + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    get_max_cache_shape = get_max_length

    @property
    def batch_size(self) -> int:
        return len(self.sequence_lengths) or -1

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write the step's new keys and values (``[batch, num_kv_heads, q_len, head_dim]``, after
        RoPE) into layer ``layer_idx``'s pages; returns them unchanged."""
        step = self._current_step()
        keys, values = (_token_rows(t, step) for t in (key_states, value_states))
        kf.append_paged_kv_cache(
            keys,
            values,
            step.batch_indices,
            step.positions,
            self.pool.kv[layer_idx],
            step.kv_indices,
            step.kv_indptr,
            step.last_page_len,
            kv_layout=KV_LAYOUT,
        )
        return key_states, value_states

    def reset(self) -> None:
        _release_all(self.pool, self._sequence_pages)
        self.sequence_lengths.clear()
        self._seen, self._step, self._planned_ahead = 0, None, False

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("kernforge's PagedCache does not support beam search (reorder_cache)")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("kernforge's PagedCache does not support crop() (assisted decoding)")

    def batch_repeat_interleave(self, repeats: int):
        raise NotImplementedError(
            "kernforge's PagedCache does not support batch_repeat_interleave(); expand the "
            "inputs before the first forward instead"
        )

    def batch_select_indices(self, indices):
        raise NotImplementedError("kernforge's PagedCache does not support batch_select_indices()")

    # ------------------------------------------------------------------ the step

    def plan_step(self, batch: int, q_len: int, attention_mask: torch.Tensor | None = None) -> None:
        """Plan the next forward ahead of it (what its first attention layer would do), so the
        forward itself only reads the plan: how a ``torch.compile``-d model runs without a graph
        break. ``attention_mask`` is the forward's 2-D padding mask (None: no padding)."""
        self.begin_step(batch, q_len, attention_mask, advance=False)
        self._planned_ahead = True

    def start_forward(self, batch: int, q_len: int, attention_mask: torch.Tensor | None) -> None:
        """The first attention layer's call: plan this forward, unless plan_step() did. Either way
        the positions processed (get_seq_length) advance here, after the model read them for the
        forward's own positions."""
        if self._planned_ahead:
            self._planned_ahead = False
            self._seen += q_len
            return
        self.begin_step(batch, q_len, attention_mask)

    def begin_step(self, batch: int, q_len: int, attention_mask: torch.Tensor | None, advance: bool = True) -> None:
        """Plan this forward: which of the ``batch x q_len`` positions are tokens (the last
        ``q_len`` columns of the 2-D padding mask, None: all), their pages, and the attention;
        with ``advance``, count its positions as processed (else start_forward will)."""
        if not self.sequence_lengths:
            self._sequence_pages.extend([] for _ in range(batch))
            self.sequence_lengths.extend([0] * batch)
        elif batch != len(self.sequence_lengths):
            raise ValueError(
                f"this PagedCache holds a batch of {len(self.sequence_lengths)} sequences but the input "
                f"has {batch}; start a new cache (past_key_values=None) for another batch"
            )
        self._step = None
        counts, gather = _new_tokens(batch, q_len, attention_mask)
        fresh = not any(self.sequence_lengths)  # no sequence has a cached prefix
        kv_indptr, kv_indices, last_page_len, seq_lens = self._grow(counts)
        decode = q_len == 1 and gather is None
        qo_indptr = torch.zeros(batch + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(counts, dtype=torch.int32), 0, out=qo_indptr[1:])
        nnz = int(qo_indptr[-1])
        batch_indices, positions = kf.get_batch_indices_positions(qo_indptr, seq_lens, nnz)
        wrappers = self._plan_step(decode, fresh, qo_indptr, kv_indptr, kv_indices, last_page_len, seq_lens)
        self._step = _Step(
            batch, q_len, gather, wrappers, batch_indices, positions, kv_indices, kv_indptr, last_page_len
        )
        if advance:
            self._seen += q_len

    def attend(self, layer_idx: int, query: torch.Tensor) -> torch.Tensor:
        """Attention of ``query`` (``[batch * q_len, num_qo_heads, head_dim]``, after RoPE) over
        layer ``layer_idx``'s pages with the step's plan: ``[batch * q_len, num_qo_heads, head_dim]``."""
        step = self._current_step()
        wrapper = step.wrappers[self.spec.window_lefts[layer_idx]]
        if step.gather is None:
            return kf.attention_run(wrapper, query, self.pool.kv[layer_idx])
        out = kf.attention_run(wrapper, query.index_select(0, step.gather), self.pool.kv[layer_idx])
        full = out.new_zeros(query.shape)
        return full.index_copy_(0, step.gather, out)

    def bound_decode_calls(self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, out: torch.Tensor):
        """For a prepared decode step (``_decode``), after ``start_forward`` planned it: the step's append
        of ``keys``/``values`` (``[batch, num_kv_heads, head_dim]`` rows) and its attention of ``queries``
        into ``out`` (``[batch, num_qo_heads, head_dim]``), each as a call of the layer's index."""
        step = self._current_step()
        if step.gather is not None or step.q_len != 1:
            raise ValueError("bound_decode_calls() is for a decode step: one new token for every sequence")
        layers = self.pool.layers
        append = kf.bound_append_paged_kv_cache(
            keys,
            values,
            step.batch_indices,
            step.positions,
            layers,
            step.kv_indices,
            step.kv_indptr,
            step.last_page_len,
            kv_layout=KV_LAYOUT,
        )
        by_window = {window: wrapper.bound_run(queries, layers, out) for window, wrapper in step.wrappers.items()}
        windows = self.spec.window_lefts
        return append, [by_window[windows[layer]] for layer in range(len(layers))]

    def _current_step(self) -> _Step:
        step = self._step
        if step is None:
            raise RuntimeError(
                "PagedCache: no step planned; the model's first attention layer plans each forward "
                "(begin_step) before layers append or attend"
            )
        return step

    def _grow(self, counts: list[int]):
        """Allocate the pages the new tokens need; the page table after this step."""
        page_size = self.pool.page_size
        lengths = [length + count for length, count in zip(self.sequence_lengths, counts)]
        needed = [-(-length // page_size) - len(pages) for length, pages in zip(lengths, self._sequence_pages)]
        fresh = self.pool.allocate(sum(needed))  # all or nothing: a failed step leaves the cache as it was
        for pages, count in zip(self._sequence_pages, needed):
            pages.extend(fresh[:count])
            del fresh[:count]
        self.sequence_lengths[:] = lengths
        page_counts = [len(pages) for pages in self._sequence_pages]
        kv_indptr = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(page_counts, dtype=torch.int32), 0, out=kv_indptr[1:])
        kv_indices = torch.tensor([page for pages in self._sequence_pages for page in pages] or [0], dtype=torch.int32)
        last_page_len = torch.tensor(
            [length - (pages - 1) * page_size if pages else 0 for length, pages in zip(lengths, page_counts)],
            dtype=torch.int32,
        )
        return kv_indptr, kv_indices, last_page_len, torch.tensor(lengths, dtype=torch.int32)

    def _plan_step(self, decode: bool, fresh: bool, qo_indptr, kv_indptr, kv_indices, last_page_len, seq_lens) -> dict:
        """The step's planned wrappers, one per distinct window (``window_left`` -> wrapper)."""
        return {
            window: self._plan(decode, window, qo_indptr, kv_indptr, kv_indices, last_page_len)
            for window in dict.fromkeys(self.spec.window_lefts)
        }

    def _plan(self, decode: bool, window_left: int, qo_indptr, kv_indptr, kv_indices, last_page_len):
        spec = self.spec
        wrapper = self._wrappers.get((decode, window_left))
        if wrapper is None:
            make = kf.BatchDecodeWithPagedKVCacheWrapper if decode else kf.BatchPrefillWithPagedKVCacheWrapper
            workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8)
            wrapper = self._wrappers[decode, window_left] = make(workspace, KV_LAYOUT)
            wrapper._grows_workspace = True  # kernforge's own wrappers: let plan() size the workspace
        common = dict(window_left=window_left, sm_scale=spec.sm_scale, q_data_type=spec.dtype, kv_data_type=spec.dtype)
        if decode:
            wrapper.plan(
                kv_indptr,
                kv_indices,
                last_page_len,
                spec.num_qo_heads,
                spec.num_kv_heads,
                spec.head_dim,
                self.pool.page_size,
                **common,
            )
        else:
            wrapper.plan(
                qo_indptr,
                kv_indptr,
                kv_indices,
                last_page_len,
                spec.num_qo_heads,
                spec.num_kv_heads,
                spec.head_dim,
                self.pool.page_size,
                causal=True,
                **common,
            )
        return wrapper


def _new_tokens(batch: int, q_len: int, attention_mask: torch.Tensor | None):
    """(tokens per sequence, rows to gather or None) from the 2-D padding mask's last q_len columns."""
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] < q_len:
            raise ValueError(
                f"kernforge attention takes a 2-D padding mask [batch, >= q_len] = [{batch}, >= {q_len}], "
                f"got shape {tuple(attention_mask.shape)}"
            )
        new = attention_mask[:, -q_len:].to(torch.bool)
        if not bool(new.all()):
            return new.sum(1).tolist(), new.reshape(-1).nonzero().squeeze(1)
    return [q_len] * batch, None


def _token_rows(states: torch.Tensor, step: _Step) -> torch.Tensor:
    """``[batch, heads, q_len, head_dim]`` as the step's token rows ``[tokens, heads, head_dim]`` (a
    view when the states are token-major underneath, as the optimized attention's are)."""
    rows = states.transpose(1, 2).reshape(step.batch * step.q_len, states.shape[1], states.shape[3])
    return rows if step.gather is None else rows.index_select(0, step.gather)


# --------------------------------------------------------------------------- multi-head latent attention

# A fresh prompt (no cached prefix) of at least this many tokens (the batch's longest) attends
# unabsorbed (k_nope, v from kv_b_proj, the ragged prefill kernel); a shorter one, and every step with a
# cached prefix, absorbed (the MLA kernel over the latent pages). See MLAPagedCache. Measured on the
# DeepSeek-V2-Lite shape (4 layers, 64 experts), a whole forward of one fresh prompt, best of 5, 2
# threads, idle Zen 4 (2026-11-26), ms absorbed / ragged: 8 tokens 68.0 / 67.6, 16: 97.9 / 94.7, 32:
# 150.6 / 146.9, 64: 228.1 / 223.5, 128: 395.1 / 386.1, 512: 1473.9 / 1412.7. Ragged is as fast or
# faster at every length measured (the attention is a few % of the forward either way).
RAGGED_PREFILL_MIN_TOKENS = 8


@dataclass(frozen=True)
class MLASpec:
    """What every layer's multi-head latent attention (DeepSeek-V2/V3) shares: the plan's parameters.
    A token's cache row is its latent ``c`` (``kv_lora_rank``, RMSNorm'd) and its RoPE'd ``k_pe``
    (``qk_rope_head_dim``), side by side: one row for every head."""

    num_layers: int
    num_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    dtype: torch.dtype
    sm_scale: float

    @property
    def window_lefts(self) -> tuple[int, ...]:
        return (-1,) * self.num_layers

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def page_shape(self, page_size: int) -> tuple[int, ...]:
        """One layer's page: ``[page_size, kv_lora_rank + qk_rope_head_dim]``, c | k_pe per token."""
        return (page_size, self.latent_dim)


class MLAPagedCache(PagedCache):
    """A :class:`PagedCache` of latents: each layer's pages are one buffer ``[num_pages, page_size,
    kv_lora_rank + qk_rope_head_dim]``, read as its two adjacent views ``ckv_cache`` (``[..., :rank]``)
    and ``kpe_cache`` (``[..., rank:]``).

    A step is planned once, by the first layer, on one of two paths. A prompt with nothing cached
    before it (``fresh``) of at least :data:`RAGGED_PREFILL_MIN_TOKENS` tokens (the longest of the
    batch) attends unabsorbed: ``BatchPrefillWithRaggedKVCacheWrapper`` over the step's own keys
    ``[k_nope | k_pe]`` and values (:meth:`attend_ragged`). Every other step (decode, a short prompt,
    a chunk after a cached prefix) attends absorbed: ``BatchMLAPagedAttentionWrapper`` (causal) over
    the latent pages (:meth:`attend_latent`). Either way every layer appends its latents
    (:meth:`append_latents`) first.
    """

    spec: MLASpec

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """transformers' interface: ``key_states`` the latents c ``[batch, 1, q_len, kv_lora_rank]`` and
        ``value_states`` k_pe ``[batch, 1, q_len, qk_rope_head_dim]`` (after RoPE), as transformers'
        DeepSeek attention hands them; written to the pages and returned unchanged."""
        step = self._current_step()
        ckv, kpe = (_token_rows(t, step)[:, 0] for t in (key_states, value_states))
        self._append(layer_idx, ckv, kpe)
        return key_states, value_states

    def append_latents(self, layer_idx: int, ckv: torch.Tensor, kpe: torch.Tensor) -> None:
        """Write the step's latents ``ckv [batch * q_len, kv_lora_rank]`` and ``kpe [batch * q_len,
        qk_rope_head_dim]`` (rows of every position, padding included: it is dropped here)."""
        step = self._current_step()
        if step.gather is not None:
            ckv, kpe = ckv.index_select(0, step.gather), kpe.index_select(0, step.gather)
        self._append(layer_idx, ckv, kpe)

    def _append(self, layer_idx: int, ckv: torch.Tensor, kpe: torch.Tensor) -> None:
        step = self._current_step()
        ckv_cache, kpe_cache = self.latent_caches(layer_idx)
        kf.append_paged_mla_kv_cache(
            ckv,
            kpe,
            step.batch_indices,
            step.positions,
            ckv_cache,
            kpe_cache,
            step.kv_indices,
            step.kv_indptr,
            step.last_page_len,
        )

    def latent_caches(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s (ckv_cache, kpe_cache): adjacent views of its one page buffer."""
        pages = self.pool.kv[layer_idx]
        return pages[..., : self.spec.kv_lora_rank], pages[..., self.spec.kv_lora_rank :]

    @property
    def ragged(self) -> bool:
        """Whether this step attends unabsorbed (:meth:`attend_ragged`), else absorbed (:meth:`attend_latent`)."""
        return "ragged" in self._current_step().wrappers

    def attend_latent(self, layer_idx: int, q_input: torch.Tensor) -> torch.Tensor:
        """Absorbed attention: ``q_input [batch * q_len, heads, kv_lora_rank + qk_rope_head_dim]``, each
        head's ``[q_nope W_UK | q_pe]`` (one row, as the latent pages hold ``[c | k_pe]``: the kernel
        reads both in place), over layer ``layer_idx``'s latent pages: the latent output ``[batch *
        q_len, heads, kv_lora_rank]`` (zeros at padding)."""
        step = self._current_step()
        wrapper, rank = step.wrappers["latent"], self.spec.kv_lora_rank
        ckv_cache, kpe_cache = self.latent_caches(layer_idx)
        rows = q_input if step.gather is None else q_input.index_select(0, step.gather)
        out = kf.attention_run(wrapper, rows[..., :rank], rows[..., rank:], ckv_cache, kpe_cache)
        if step.gather is None:
            return out
        return out.new_zeros((q_input.shape[0], *out.shape[1:])).index_copy_(0, step.gather, out)

    def attend_ragged(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Unabsorbed attention of a fresh prompt over its own keys and values: ``q``, ``k`` ``[batch *
        q_len, heads, qk_nope_head_dim + qk_rope_head_dim]``, ``v [batch * q_len, heads, v_head_dim]``
        (rows of every position; padding is dropped): ``[batch * q_len, heads, v_head_dim]``."""
        step = self._current_step()
        wrapper = step.wrappers["ragged"]
        if step.gather is None:
            return kf.attention_run(wrapper, q, k, v)
        out = kf.attention_run(wrapper, *(t.index_select(0, step.gather) for t in (q, k, v)))
        return out.new_zeros((q.shape[0], *out.shape[1:])).index_copy_(0, step.gather, out)

    def _plan_step(self, decode: bool, fresh: bool, qo_indptr, kv_indptr, kv_indices, last_page_len, seq_lens) -> dict:
        spec = self.spec
        common = dict(causal=True, sm_scale=spec.sm_scale, q_data_type=spec.dtype, kv_data_type=spec.dtype)
        longest = int((qo_indptr[1:] - qo_indptr[:-1]).max()) if len(qo_indptr) > 1 else 0
        if fresh and not decode and longest >= RAGGED_PREFILL_MIN_TOKENS:
            wrapper = self._wrapper("ragged", kf.BatchPrefillWithRaggedKVCacheWrapper)
            heads, qk_dim = spec.num_heads, spec.qk_nope_head_dim + spec.qk_rope_head_dim
            wrapper.plan(qo_indptr, qo_indptr, heads, heads, qk_dim, spec.v_head_dim, **common)
            return {"ragged": wrapper}
        wrapper = self._wrapper("latent", kf.BatchMLAPagedAttentionWrapper)
        wrapper.plan(
            qo_indptr,
            kv_indptr,
            kv_indices,
            seq_lens,
            spec.num_heads,
            spec.kv_lora_rank,
            spec.qk_rope_head_dim,
            self.pool.page_size,
            **common,
        )
        return {"latent": wrapper}

    def _wrapper(self, name: str, make):
        wrapper = self._wrappers.get(name)
        if wrapper is None:
            wrapper = self._wrappers[name] = make(torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8))
            wrapper._grows_workspace = True  # kernforge's own wrappers: let plan() size the workspace
        return wrapper
