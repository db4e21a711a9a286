"""Cases the fuzzer once failed on, kept after their fix: (target, case seed), replayed on every tier
by test_fuzz.py. Each line says what the case found."""

REGRESSIONS: list[tuple[str, int]] = [
    # a 4-D input [0, 5, 0, 2d]: merging its leading dims as view(-1, 0, 2d) raised RuntimeError (-1 is
    # ambiguous for 0 elements) instead of returning the empty output (kernforge/ops/_common.py rows_view)
    ("silu_and_mul", 3180115128),
    # an empty row selection: read_blocks reshaped the decoded fields of 0 rows with a -1, a RuntimeError
    # instead of fp32 [0, K] (kernforge/ops/gemm/gguf.py read_blocks)
    ("dequantize_rows", 3145955721),
    # ids of shape [0]: _values viewed the codes of 0 rows as [0, -1, group], a RuntimeError instead of
    # [0, K] (kernforge/ops/gemm/gguf.py _values)
    ("embedding_rows", 404014343),
    # q [0, 1, 1] (head_dim 1) with strides (1, 0, 0), as torch arithmetic leaves an empty tensor: run()
    # refused it as "q must be contiguous in head_dim" (kernforge/ops/attention/_wrapper.py check_q)
    ("single_prefill_with_kv_cache", 1634108189),
    # the hour-long run (master seed 1795970248): fp32 gelu_and_mul at scale 30, 2.2e-5 off in an output of
    # 1.5e-5 whose factors were ~100: the target's tolerance, not the kernel (targets_activation.tolerance)
    ("gelu_and_mul", 2981928564),
    # CI (master seed 0): fp32 ragged prefill with q at 6 × q_scale 1.5, 2.6e-5 off where 2e-5 was allowed:
    # fp32 logits of ~30 round by ~1e-6 each, which the out tolerance did not scale with
    # (targets_attention.out_tolerance), not the kernel
    ("BatchPrefillWithRaggedKVCacheWrapper", 1304190161),
    # CI (master seed 0): fp32 Llama 3.1 RoPE at position 16043658, x / pi = 5106854.95 estimated in fp32 as
    # 5106854.5 and rounded to 5106854: the remainder near pi, outside the polynomial's range, sin 1e-5
    # off (kernforge/rope.h sincos now reduces the remainder once more)
    ("apply_llama31_rope_pos_ids_inplace", 1413991568),
]
