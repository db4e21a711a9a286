"""Mixture of experts: routing (``routing``: topk_softmax, topk_sigmoid, grouped_topk,
biased_grouped_topk) and the fused experts (``experts``). Each module registers its ops when
imported (``kernforge.ops`` imports this package), so a new part is one more name below."""

from kernforge.ops.moe import experts, routing  # noqa: F401  (registers their ops)
