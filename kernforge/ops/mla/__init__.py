"""Multi-head latent attention (DeepSeek-V2/V3): FlashInfer's ``BatchMLAPagedAttentionWrapper``
over a paged latent cache (``attention``). Each module registers its ops when imported
(``kernforge.ops`` imports this package), so a new part is one more name below."""

from kernforge.ops.mla import attention, projections  # noqa: F401  (registers their ops)
