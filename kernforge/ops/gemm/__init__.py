"""The GEMM family: prepacked bf16 linear layers (``bf16``), int8 w8a8 (``int8``), fp8 block-scaled
weights (``fp8``) and batched matmuls (``bmm``), over one micro-kernel layer
(``templates/include/kernforge/gemm/``); ``_common`` holds the checks they share."""

from kernforge.ops.gemm import bf16, bmm, fp8, int4, int8  # noqa: F401  (registers their ops)
