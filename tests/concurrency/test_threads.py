"""Ops called from several Python threads at once give what the same calls give one after another.

Each Python thread that calls a kernel starts parallel regions of its own (libgomp keeps one pool of
workers per calling thread), so these tests check what the threads share: the per-thread scratch
of the kernels (thread_local buffers, RoPE's frequency table, sampling's scratch), the per-thread
argument structs and workspaces on the Python side (the single-request attention ops' workspaces,
GGUFLinearRunner's structs), the variants' lazy resolution, and the JIT cache's first compile. Every
result is compared bit for bit with the same call made serially on the same tier, with kernforge at
2 threads per call; a thread still running after ``TIMEOUT`` seconds fails the test as a deadlock
(the threads are daemons, so a hang cannot keep the run from ending).

A plan/run wrapper serves one caller at a time, as in FlashInfer (its plan's argument struct and its
workspace hold the running call's state): the tests give each thread its own wrapper, and run one
wrapper planned on the main thread from several threads in turn. The prepared decode step's
programs per thread are tested in tests/integrations/test_prepared_decode.py.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import gguf
import pytest
import torch
from gguf import quants
from thread_helpers import run_in_threads

import kernforge
from kernforge.jit import core
from kernforge.ops.gemm import gguf as G

from op_helpers import randn, seeded

THREADS = 4  # Python threads, each running every case ROUNDS times, in its own order
ROUNDS = 2
KERNEL_THREADS = 2

Result = torch.Tensor | tuple[torch.Tensor, ...]


@pytest.fixture(autouse=True)
def kernel_threads():
    """Every kernel call on 2 OpenMP threads (a pool per calling thread), whatever the machine."""
    kernforge.set_num_threads(KERNEL_THREADS)
    yield
    kernforge.set_num_threads(None)


def assert_same(got: Result, expected: Result, what: str) -> None:
    got_parts = got if isinstance(got, tuple) else (got,)
    expected_parts = expected if isinstance(expected, tuple) else (expected,)
    assert len(got_parts) == len(expected_parts), what
    for i, (a, b) in enumerate(zip(got_parts, expected_parts)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}[{i}]: {a.dtype} {a.shape} vs {b.dtype} {b.shape}"
        assert torch.equal(a, b), f"{what}[{i}]: differs from the serial call (max diff {(a - b).abs().max()})"


def assert_concurrent_calls_match_serial(cases: dict[str, Callable[[], Result]]) -> None:
    """Every case once serially, then THREADS threads each run every case ROUNDS times, starting at
    a different case (so different ops overlap), and must reproduce the serial results exactly."""
    expected = {name: case() for name, case in cases.items()}
    names = list(cases)

    def job(first: int) -> dict[tuple[str, int], Result]:
        order = names[first:] + names[:first]
        return {(name, r): cases[name]() for r in range(ROUNDS) for name in order}

    for t, results in enumerate(run_in_threads([lambda t=t: job(t % len(names)) for t in range(THREADS)])):
        for (name, r), got in results.items():
            assert_same(got, expected[name], f"{name} (thread {t}, round {r})")


# --------------------------------------------------------------------------- cases


def norm_cases() -> dict[str, Callable[[], Result]]:
    g = seeded("concurrency-norm")
    x, w = randn((64, 4096), g).to(torch.bfloat16), randn((4096,), g).to(torch.bfloat16)
    x3, w3 = randn((6, 5, 2048), g).to(torch.float16), randn((2048,), g).to(torch.float16)
    h, res, wf = randn((48, 4096), g), randn((48, 4096), g), randn((4096,), g)

    def fused_add() -> Result:
        hidden, residual = h.clone(), res.clone()
        kernforge.fused_add_rmsnorm(hidden, residual, wf)
        return hidden, residual

    return {
        "rmsnorm": lambda: kernforge.rmsnorm(x, w),
        "gemma_rmsnorm_3d": lambda: kernforge.gemma_rmsnorm(x3, w3),
        "fused_add_rmsnorm": fused_add,
    }


def rope_cases() -> dict[str, Callable[[], Result]]:
    g = seeded("concurrency-rope")
    nnz = 96
    q, k = randn((nnz, 8, 128), g).to(torch.bfloat16), randn((nnz, 2, 128), g).to(torch.bfloat16)
    qf, kf = randn((nnz, 4, 64), g), randn((nnz, 1, 64), g)
    pos = torch.randint(0, 4000, (nnz,), generator=g, dtype=torch.int32)
    positions = pos.to(torch.int64) % 512
    angles = torch.outer(torch.arange(512, dtype=torch.float32), 10000.0 ** (-torch.arange(0, 128, 2) / 128))
    cos_sin_cache = torch.cat([angles.cos(), angles.sin()], dim=-1)
    query, key = q.reshape(nnz, -1), k.reshape(nnz, -1)
    # The frequency tables are per calling thread and recomputed when the parameters change: the
    # cases alternate two thetas and Llama 3.1's table on every thread.
    return {
        "rope_theta_1e4": lambda: kernforge.apply_rope_pos_ids(q, k, pos, rope_theta=1e4),
        "rope_theta_5e5_interleave": lambda: kernforge.apply_rope_pos_ids(q, k, pos, interleave=True, rope_theta=5e5),
        "llama31_rope_fp32": lambda: kernforge.apply_llama31_rope_pos_ids(qf, kf, pos),
        "rope_cos_sin_cache": lambda: kernforge.apply_rope_with_cos_sin_cache(
            positions, query, key, 128, cos_sin_cache
        ),
    }


def gemm_cases() -> dict[str, Callable[[], Result]]:
    g = seeded("concurrency-gemm")
    x, w, bias = randn((48, 512), g).to(torch.bfloat16), randn((320, 512), g).to(torch.bfloat16), randn((320,), g)
    packed = kernforge.convert_weight_packed(w)
    bias = bias.to(torch.bfloat16)
    x8 = randn((40, 384), g).to(torch.bfloat16)
    w8 = torch.randint(-128, 128, (256, 384), generator=g, dtype=torch.int8)
    packed8 = kernforge.convert_weight_packed_int8(w8, torch.rand(256, generator=g) * 1e-2 + 1e-3)
    raw = torch.from_numpy(quants.quantize(randn((128, 256), g).numpy(), gguf.GGMLQuantizationType["Q8_0"]))
    runner = G.GGUFLinearRunner(G.pack_gguf(raw, "Q8_0", 128, 256))  # one runner shared by every thread
    xq = randn((9, 256), g).to(torch.bfloat16)
    return {
        "weight_packed_linear": lambda: kernforge.weight_packed_linear(x, packed, bias),
        "weight_packed_linear_one_row": lambda: kernforge.weight_packed_linear(x[:1], packed),
        "int8_scaled_mm_with_quant": lambda: kernforge.int8_scaled_mm_with_quant(x8, packed8),
        "gguf_runner_shared": lambda: runner(xq),
        "gguf_linear_one_row": lambda: runner(xq[2:3]),
    }


def sampling_cases() -> dict[str, Callable[[], Result]]:
    g = seeded("concurrency-sampling")
    logits = randn((32, 4096), g, 3.0)
    probs = torch.softmax(randn((8, 50000), g, 3.0), dim=-1)

    def draws(seed: int) -> Result:
        generator = torch.Generator().manual_seed(seed)  # each call its own: draws depend on it alone
        return tuple(kernforge.top_k_top_p_sampling_from_logits(logits, 50, 0.9, generator=generator) for _ in range(3))

    return {
        "top_k_top_p_from_logits_seed_1": lambda: draws(1),
        "top_k_top_p_from_logits_seed_2": lambda: draws(2),
        "top_p_from_probs_seed_offset": lambda: kernforge.top_p_sampling_from_probs(probs, 0.8, seed=7, offset=4),
        "softmax": lambda: kernforge.softmax(logits, 0.7),
    }


PAGE = 16
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128


def paged_batch(lengths: list[int], g: torch.Generator, layers: int = 2):
    """A shuffled page table for ``lengths`` and ``layers`` bf16 caches (K, V) over its pages."""
    counts = [-(-n // PAGE) for n in lengths]
    pages = sum(counts) + 2
    indices = torch.randperm(pages, generator=g)[: sum(counts)].to(torch.int32)
    indptr = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    last = torch.tensor([(n - 1) % PAGE + 1 for n in lengths], dtype=torch.int32)
    shape = (pages, PAGE, KV_HEADS, HEAD_DIM)
    caches = [(randn(shape, g).to(torch.bfloat16), randn(shape, g).to(torch.bfloat16)) for _ in range(layers)]
    return indptr, indices, last, caches


def planned_decode(indptr, indices, last):
    """A decode wrapper over a workspace of its own, planned for the page table."""
    wrapper = kernforge.BatchDecodeWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8))
    wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, HEAD_DIM, PAGE, q_data_type=torch.bfloat16)
    return wrapper


def planned_prefill(qo_indptr, indptr, indices, last):
    """A causal paged prefill wrapper over a workspace of its own, planned for the batch."""
    wrapper = kernforge.BatchPrefillWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8))
    shape = dict(num_qo_heads=HEADS, num_kv_heads=KV_HEADS, head_dim_qk=HEAD_DIM, page_size=PAGE)
    wrapper.plan(qo_indptr, indptr, indices, last, **shape, causal=True, q_data_type=torch.bfloat16)
    return wrapper


def attention_cases() -> dict[str, Callable[[], Result]]:
    g = seeded("concurrency-attention")
    d_indptr, d_indices, d_last, d_caches = paged_batch([37, 300, 5, 130], g)
    dq = randn((4, HEADS, HEAD_DIM), g).to(torch.bfloat16)
    qo_lens, kv_lens = [5, 17], [40, 64]
    p_indptr, p_indices, p_last, p_caches = paged_batch(kv_lens, g)
    qo_indptr = torch.tensor([0, 5, 22], dtype=torch.int32)
    pq = randn((sum(qo_lens), HEADS, HEAD_DIM), g).to(torch.bfloat16)
    sq, sk, sv = (randn(shape, g).to(torch.bfloat16) for shape in [(HEADS, 128), (200, 2, 128), (200, 2, 128)])
    pfq = randn((24, HEADS, 128), g).to(torch.bfloat16)

    def decode() -> Result:  # a wrapper and workspace per call: per thread
        wrapper = planned_decode(d_indptr, d_indices, d_last)
        return tuple(t for cache in d_caches for t in wrapper.run(dq, cache, return_lse=True))

    def prefill() -> Result:
        wrapper = planned_prefill(qo_indptr, p_indptr, p_indices, p_last)
        return tuple(t for cache in p_caches for t in wrapper.run(pq, cache, return_lse=True))

    return {
        "decode_wrapper_per_thread": decode,
        "prefill_wrapper_per_thread": prefill,
        # the single-request ops plan into a workspace per calling thread
        "single_decode": lambda: kernforge.single_decode_with_kv_cache(sq, sk, sv),
        "single_prefill_causal": lambda: kernforge.single_prefill_with_kv_cache(pfq, sk[:40], sv[:40], causal=True),
    }


def test_norms_from_threads():
    assert_concurrent_calls_match_serial(norm_cases())


def test_rope_from_threads():
    assert_concurrent_calls_match_serial(rope_cases())


def test_gemms_from_threads():
    assert_concurrent_calls_match_serial(gemm_cases())


def test_sampling_with_a_generator_per_thread():
    assert_concurrent_calls_match_serial(sampling_cases())


def test_attention_with_a_wrapper_per_thread():
    assert_concurrent_calls_match_serial(attention_cases())


def test_every_family_at_once():
    """All the cases above mixed: other ops' kernels run on the other threads meanwhile."""
    cases = {**norm_cases(), **rope_cases(), **gemm_cases(), **sampling_cases(), **attention_cases()}
    assert_concurrent_calls_match_serial(cases)


def test_one_wrapper_planned_once_runs_on_other_threads_in_turn():
    """A wrapper belongs to no thread: planned on this one, its runs on others (one at a time, as a
    wrapper serves one caller at a time) give the serial results."""
    g = seeded("concurrency-shared-wrapper")
    indptr, indices, last, caches = paged_batch([37, 300, 5, 130], g, layers=3)
    queries = [randn((4, HEADS, HEAD_DIM), g).to(torch.bfloat16) for _ in range(THREADS)]
    decode = planned_decode(indptr, indices, last)
    p_indptr, p_indices, p_last, p_caches = paged_batch([40, 64], g, layers=3)
    qo_indptr = torch.tensor([0, 5, 22], dtype=torch.int32)
    prefill_queries = [randn((22, HEADS, HEAD_DIM), g).to(torch.bfloat16) for _ in range(THREADS)]
    prefill = planned_prefill(qo_indptr, p_indptr, p_indices, p_last)

    def layers(t: int) -> list[Result]:
        return [decode.run(queries[t], cache) for cache in caches] + [
            prefill.run(prefill_queries[t], cache) for cache in p_caches
        ]

    expected = [layers(t) for t in range(THREADS)]
    turn = threading.Lock()

    def job(t: int) -> list[Result]:
        results = []
        for layer in range(len(caches) + len(p_caches)):
            with turn:  # one caller at a time; the threads interleave layer by layer
                if layer < len(caches):
                    results.append(decode.run(queries[t], caches[layer]))
                else:
                    results.append(prefill.run(prefill_queries[t], p_caches[layer - len(caches)]))
        return results

    for t, results in enumerate(run_in_threads([lambda t=t: job(t) for t in range(THREADS)])):
        for layer, (got, want) in enumerate(zip(results, expected[t])):
            assert_same(got, want, f"thread {t} layer {layer}")


def test_wrapper_docstrings_say_one_caller_at_a_time():
    for cls in (
        kernforge.BatchDecodeWithPagedKVCacheWrapper,
        kernforge.BatchPrefillWithPagedKVCacheWrapper,
        kernforge.BatchPrefillWithRaggedKVCacheWrapper,
    ):
        assert "one caller at a time" in " ".join((cls.__doc__ or "").split()), cls.__name__


# --------------------------------------------------------------------------- the JIT cache


@pytest.mark.parametrize("cffi_mode", ["api", "abi"])
def test_first_compile_raced_from_threads_compiles_once(cache, monkeypatch, cffi_mode):
    """Threads of one process call an op whose variant no cache holds yet: one compiles it (under the
    entry's file lock), the others wait and load it, and every call gives the serial result."""
    monkeypatch.setenv("KERNFORGE_CFFI_MODE", cffi_mode)
    monkeypatch.setenv("KERNFORGE_LOCK_TIMEOUT", "120")  # a leaked lock fails instead of hanging
    compiles: list[str] = []
    compile_once = core._compile

    def counting_compile(plan, entry):
        compiles.append(plan.key)
        return compile_once(plan, entry)

    monkeypatch.setattr(core, "_compile", counting_compile)
    g = seeded("concurrency-first-compile")
    x, w = randn((64, 1024), g).to(torch.float16), randn((1024,), g).to(torch.float16)
    core.invalidate_dispatch()  # variants resolved by earlier tests resolve again, in this empty cache
    try:
        results = run_in_threads([lambda: kernforge.gemma_rmsnorm(x, w) for _ in range(THREADS)])
        assert len(compiles) == 1 and compiles[0].startswith("norm_dtype-fp16_fused_add-0_gemma-1"), compiles
        assert (cache / compiles[0] / "kernel.so").is_file()
        expected = kernforge.gemma_rmsnorm(x, w)
        for t, got in enumerate(results):
            assert_same(got, expected, f"thread {t}")
        assert len(compiles) == 1
    finally:
        core.invalidate_dispatch()  # later tests resolve from the session's cache again


# --------------------------------------------------------------------------- one thread pool with torch


def _os_threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _mapped_libgomp() -> set[str]:
    with open("/proc/self/maps") as maps:
        return {line.split()[-1] for line in maps if "libgomp" in line.rsplit("/", 1)[-1]}


def test_torch_and_kernforge_ops_alternating_share_one_thread_pool():
    """Kernels follow torch.get_num_threads() and bind to the libgomp torch loaded: alternating
    torch and kernforge ops on this thread starts no thread beyond torch's own pool."""
    saved = torch.get_num_threads()
    kernforge.set_num_threads(None)  # follow torch, the default
    try:
        torch.set_num_threads(KERNEL_THREADS)
        assert kernforge.ops.num_threads() == KERNEL_THREADS
        g = seeded("concurrency-one-pool")
        a = randn((512, 512), g)
        x, w = randn((256, 4096), g).to(torch.bfloat16), randn((4096,), g).to(torch.bfloat16)
        packed = kernforge.convert_weight_packed(randn((512, 512), g).to(torch.bfloat16))
        xb = a.to(torch.bfloat16)

        def torch_ops():
            torch.softmax(a @ a, dim=-1).sum()

        def kernforge_ops():
            kernforge.rmsnorm(x, w)
            kernforge.weight_packed_linear(xb, packed)

        torch_ops()
        kernforge_ops()  # warm: both have run (kernels compiled and loaded) before counting
        before = _os_threads()
        for _ in range(5):
            torch_ops()
            kernforge_ops()
        started = _os_threads() - before
        assert not started, f"alternating torch and kernforge ops started {len(started)} more threads"
        assert len(_mapped_libgomp()) == 1, _mapped_libgomp()
        torch.set_num_threads(1)
        assert kernforge.ops.num_threads() == 1  # the cores torch is allowed, and no more
    finally:
        torch.set_num_threads(saved)
        kernforge.set_num_threads(KERNEL_THREADS)


def test_kernel_threads_follow_torch_in_each_thread():
    """num_threads() read on another Python thread is torch's setting too (torch keeps it per thread
    for OpenMP and initializes each new thread from the global value)."""
    saved = torch.get_num_threads()
    kernforge.set_num_threads(None)
    try:
        torch.set_num_threads(1)
        assert run_in_threads([kernforge.ops.num_threads] * 2) == [1, 1]
        torch.set_num_threads(KERNEL_THREADS)
        assert run_in_threads([kernforge.ops.num_threads] * 2) == [KERNEL_THREADS] * 2
    finally:
        torch.set_num_threads(saved)
        kernforge.set_num_threads(KERNEL_THREADS)
