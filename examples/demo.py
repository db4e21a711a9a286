"""kernforge demo: pre-warm, run the ops, check them against torch, time both.

Run with `make demo`. Timings are medians over repeated calls at 2 threads (or
torch's thread count); both sides allocate their output per call. See
benchmarks/ for the full comparison (torch.compile, preallocated outputs, GB/s).
"""

import statistics
import time

import torch
import torch.nn.functional as F

import kernforge
from kernforge.ops.attention.prefill import prefill_variant_params

TOKENS, HIDDEN, INTERMEDIATE = 256, 4096, 11008
EPS = 1e-6


def median_us(fn, reps=50):
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e3


def torch_fused_add(x, r, scale):
    r.add_(x)
    return F.rms_norm(r, (HIDDEN,), scale, EPS)


def main():
    info = kernforge.cpu_info()
    print(
        f"kernforge {kernforge.__version__}: tier {info['selected_tier']} "
        f"(runnable: {', '.join(info['runnable_tiers'])}), {torch.get_num_threads()} threads"
    )

    print("\n== pre-warm (the ops below: bf16 and fp32; the sampler: fp32 probs; attention and linear: bf16) ==")
    model_ops = (
        "rmsnorm",
        "fused_add_rmsnorm",
        "gemma_rmsnorm",
        "gemma_fused_add_rmsnorm",
        "silu_and_mul",
        "gelu_and_mul",
        "gelu_tanh_and_mul",
    )
    results = kernforge.prewarm(
        {
            "kernels": [
                *({"op": op, "dtype": ["bf16", "fp32"]} for op in model_ops),
                {"op": "top_k_top_p_sampling_from_probs", "dtype": "fp32"},
                {
                    "module": "decode",
                    "params": {"q_dtype": "bf16", "kv_dtype": "bf16", "out_dtype": "bf16", "head_dim": 128, "group": 4},
                },
                {
                    "module": "prefill",
                    "params": prefill_variant_params(torch.bfloat16, torch.bfloat16, torch.bfloat16, 128, 128, 4),
                },
                {"op": "weight_packed_linear", "dtype": "bf16"},
            ]
        }
    )
    compiled = [r for r in results if r.compiled]
    print(f"{len(compiled)} compiled, {len(results) - len(compiled)} already cached")
    for r in compiled:
        print(f"  {r.key}  {r.seconds:.2f} s")

    torch.manual_seed(0)
    dt = torch.bfloat16
    x = torch.randn(TOKENS, HIDDEN, dtype=dt)
    w = torch.randn(HIDDEN, dtype=dt)
    h = torch.randn(TOKENS, 2 * INTERMEDIATE, dtype=dt) * 2
    d = INTERMEDIATE
    # (name, kernforge call, torch eager call, fp32 reference of the kernforge result)
    cases = [
        (
            "rmsnorm",
            lambda: kernforge.rmsnorm(x, w, EPS),
            lambda: F.rms_norm(x, (HIDDEN,), w, EPS),
            lambda: F.rms_norm(x.float(), (HIDDEN,), w.float(), EPS),
        ),
        (
            "gemma_rmsnorm",
            lambda: kernforge.gemma_rmsnorm(x, w, EPS),
            lambda: F.rms_norm(x, (HIDDEN,), 1 + w, EPS),
            lambda: F.rms_norm(x.float(), (HIDDEN,), 1 + w.float(), EPS),
        ),
        (
            "silu_and_mul",
            lambda: kernforge.silu_and_mul(h),
            lambda: F.silu(h[:, :d]) * h[:, d:],
            lambda: F.silu(h[:, :d].float()) * h[:, d:].float(),
        ),
        (
            "gelu_and_mul",
            lambda: kernforge.gelu_and_mul(h),
            lambda: F.gelu(h[:, :d]) * h[:, d:],
            lambda: F.gelu(h[:, :d].float()) * h[:, d:].float(),
        ),
        (
            "gelu_tanh_and_mul",
            lambda: kernforge.gelu_tanh_and_mul(h),
            lambda: F.gelu(h[:, :d], approximate="tanh") * h[:, d:],
            lambda: F.gelu(h[:, :d].float(), approximate="tanh") * h[:, d:].float(),
        ),
    ]
    print(f"\n== ops, bf16, [{TOKENS}, ...], output allocated per call, {torch.get_num_threads()} threads ==")
    print("correct: within bf16 tolerance (1e-2) of a float32 torch reference")
    print(f"{'op':26} {'correct':>8} {'kernforge us':>13} {'torch us':>9} {'speedup':>8}")
    for name, ours, theirs, reference in cases:
        t_ours, t_theirs = median_us(ours), median_us(theirs)
        print(
            f"{name:26} {str(_matches(ours(), reference())):>8} {t_ours:13.1f} {t_theirs:9.1f} "
            f"{t_theirs / t_ours:7.2f}x"
        )

    for name, fused, scale in (
        ("fused_add_rmsnorm", kernforge.fused_add_rmsnorm, lambda w: w.float()),
        ("gemma_fused_add_rmsnorm", kernforge.gemma_fused_add_rmsnorm, lambda w: 1 + w.float()),
    ):
        xa, ra = x.clone(), torch.randn_like(x)
        xb, rb = xa.clone(), ra.clone()
        s = xa.float() + ra.float()
        fused(xa, ra, w, EPS)
        correct = _matches(xa, F.rms_norm(s, (HIDDEN,), scale(w), EPS)) and _matches(ra, s)
        t_ours = median_us(lambda: fused(xa, ra, w, EPS))
        torch_scale = scale(w).to(dt)
        t_theirs = median_us(lambda: torch_fused_add(xb, rb, torch_scale))
        print(f"{name:26} {str(correct):>8} {t_ours:13.1f} {t_theirs:9.1f} {t_theirs / t_ours:7.2f}x")

    sampling_demo()
    decode_demo()
    prefill_demo()
    linear_demo()


def decode_demo(batch=16, kv_len=2048, heads=32, kv_heads=8, head_dim=128, page=16):
    """One layer of batch decode over a paged bf16 KV cache (pages scattered), against torch's
    scaled_dot_product_attention on a dense copy of each request's KV."""
    pages_per_request = kv_len // page
    num_pages = batch * pages_per_request
    cache = torch.randn(num_pages, 2, page, kv_heads, head_dim, dtype=torch.bfloat16)
    indices = torch.randperm(num_pages, dtype=torch.int32)
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages_per_request
    last_page_len = torch.full((batch,), page, dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16)
    wrapper = kernforge.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8), "NHD")
    wrapper.plan(indptr, indices, last_page_len, heads, kv_heads, head_dim, page, q_data_type=torch.bfloat16)
    out = torch.empty_like(q)
    dense = cache[indices.long()].view(batch, pages_per_request, 2, page, kv_heads, head_dim)
    k, v = (dense[:, :, i].reshape(batch, kv_len, kv_heads, head_dim).transpose(1, 2) for i in (0, 1))

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True).squeeze(2)

    correct = _matches(wrapper.run(q, cache, out=out), sdpa())
    t_ours = median_us(lambda: wrapper.run(q, cache, out=out))
    t_theirs = median_us(sdpa, reps=5)
    gbs = cache.numel() * cache.element_size() / t_ours / 1e3
    print(
        f"\n== decode attention, bf16 paged KV: batch {batch}, KV length {kv_len}, {heads} q / {kv_heads} KV heads, "
        f"head_dim {head_dim}, page {page} =="
    )
    print("correct: within bf16 tolerance of torch SDPA (enable_gqa) on a dense copy; torch us: that SDPA call")
    print(f"{'op':32} {'correct':>8} {'kernforge us':>13} {'torch us':>9} {'speedup':>8}")
    print(
        f"{'BatchDecode...Wrapper.run':32} {str(correct):>8} {t_ours:13.1f} {t_theirs:9.1f} "
        f"{t_theirs / t_ours:7.1f}x   ({gbs:.1f} GB/s of KV read)"
    )


def prefill_demo(length=1024, heads=32, kv_heads=8, head_dim=128):
    """Causal prefill of one request (ragged K/V), against torch's scaled_dot_product_attention."""
    q = torch.randn(length, heads, head_dim, dtype=torch.bfloat16)
    k, v = (torch.randn(length, kv_heads, head_dim, dtype=torch.bfloat16) for _ in range(2))
    indptr = torch.tensor([0, length], dtype=torch.int32)
    wrapper = kernforge.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8))
    wrapper.plan(indptr, indptr, heads, kv_heads, head_dim, causal=True, q_data_type=torch.bfloat16)
    out = torch.empty_like(q)

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
        ).transpose(0, 1)

    correct = _matches(wrapper.run(q, k, v, out=out), sdpa())
    t_ours = median_us(lambda: wrapper.run(q, k, v, out=out), reps=5)
    t_theirs = median_us(sdpa, reps=3)
    gflops = 4 * head_dim * heads * length * (length + 1) / 2 / t_ours / 1e3
    print(
        f"\n== prefill attention, bf16, causal: {length} tokens, {heads} q / {kv_heads} KV heads, "
        f"head_dim {head_dim} =="
    )
    print("correct: within bf16 tolerance of torch SDPA (is_causal, enable_gqa); torch us: that SDPA call")
    print(f"{'op':32} {'correct':>8} {'kernforge us':>13} {'torch us':>9} {'speedup':>8}")
    print(
        f"{'BatchPrefill...Wrapper.run':32} {str(correct):>8} {t_ours:13.1f} {t_theirs:9.1f} "
        f"{t_theirs / t_ours:7.1f}x   ({gflops:.0f} GFLOP/s)"
    )


def linear_demo(n=4096, k=4096):
    """A prepacked bf16 linear layer at decode (1 row) and prefill (256 rows) sizes, against F.linear."""
    weight = torch.randn(n, k, dtype=torch.bfloat16)
    packed = kernforge.convert_weight_packed(weight)
    print(f"\n== linear, bf16 weight [{n}, {k}] prepacked once, out= preallocated ==")
    print("correct: within bf16 tolerance of a float32 matmul; torch us: F.linear")
    print(f"{'op':32} {'correct':>8} {'kernforge us':>13} {'torch us':>9} {'speedup':>8}")
    for m in (1, 256):
        x = torch.randn(m, k, dtype=torch.bfloat16)
        out = torch.empty(m, n, dtype=torch.bfloat16)
        correct = _matches(kernforge.weight_packed_linear(x, packed, out=out), x.float() @ weight.float().T)
        t_ours = median_us(lambda: kernforge.weight_packed_linear(x, packed, out=out), reps=10)
        t_theirs = median_us(lambda: F.linear(x, weight), reps=10)
        print(
            f"{f'weight_packed_linear M={m}':32} {str(correct):>8} {t_ours:13.1f} {t_theirs:9.1f} "
            f"{t_theirs / t_ours:7.2f}x"
        )


def sampling_demo(batch=16, vocab=128256, top_k=50, top_p=0.9):
    """Top-k + top-p sampling on LLM-like rows, against the sort-based torch path engines use."""
    probs = torch.softmax(torch.randn(batch, vocab) * 5, -1)
    kept = _top_k_top_p_kept(probs, top_k, top_p)
    generator = torch.Generator().manual_seed(0)
    samples = kernforge.top_k_top_p_sampling_from_probs(probs, top_k, top_p, generator=generator)
    correct = bool(kept[torch.arange(batch), samples.long()].all())
    t_ours = median_us(lambda: kernforge.top_k_top_p_sampling_from_probs(probs, top_k, top_p, generator=generator))
    t_theirs = median_us(lambda: _torch_top_k_top_p_sample(probs, top_k, top_p), reps=5)
    print(f"\n== sampling, fp32 probs [{batch}, {vocab}], top_k={top_k}, top_p={top_p} ==")
    print("correct: every sample lies in the set a sort-based torch reference keeps")
    print(f"{'op':32} {'correct':>8} {'kernforge us':>13} {'torch us':>9} {'speedup':>8}")
    print(
        f"{'top_k_top_p_sampling_from_probs':32} {str(correct):>8} {t_ours:13.1f} {t_theirs:9.1f} "
        f"{t_theirs / t_ours:7.1f}x"
    )


def _top_k_top_p_kept(probs, top_k, top_p):
    """The entries top-k then top-p keep (ties at the cuts are kept, as kernforge does)."""
    kth = probs.topk(top_k, -1).values[:, -1:]
    top = torch.where(probs >= kth, probs, 0.0)
    top = top / top.sum(-1, keepdim=True)
    sorted_probs = top.sort(-1, descending=True).values
    mass_above = sorted_probs.cumsum(-1) - sorted_probs
    cut = torch.where(mass_above < top_p, sorted_probs, 2.0).amin(-1, keepdim=True)
    return (top >= cut) & (top > 0)


def _torch_top_k_top_p_sample(probs, top_k, top_p):
    """What engines run on CPU today: sort, mask, renormalize, multinomial."""
    sorted_probs, order = probs.sort(-1, descending=True)
    sorted_probs[:, top_k:] = 0
    sorted_probs = sorted_probs / sorted_probs.sum(-1, keepdim=True)
    sorted_probs[(sorted_probs.cumsum(-1) - sorted_probs) > top_p] = 0
    picked = torch.multinomial(sorted_probs, 1)
    return order.gather(1, picked).squeeze(1)


def _matches(result, reference) -> bool:
    return torch.allclose(result.float(), reference.float(), atol=1e-2, rtol=1e-2)


if __name__ == "__main__":
    main()
