"""The GEMM family: prepacked bf16 linear layers (``bf16``), int8 w8a8 (``int8``), fp8 block-scaled
weights (``fp8``), four-bit weights (``int4``), llama.cpp's GGUF block types (``gguf``) and batched
matmuls (``bmm``), over one micro-kernel layer (``templates/include/kernforge/gemm/``); ``_common`` holds
the checks they share, and the ones families building on GEMM's packed weights need (MoE's experts,
MLA's projections) are public here."""

from kernforge.ops.gemm import bf16, bmm, fp8, gguf, int4, int8  # noqa: F401  (registers their ops)
from kernforge.ops.gemm._common import check_cpu_tensor, check_layout_version, packed_weight, raise_for_status

__all__ = ["check_cpu_tensor", "check_layout_version", "packed_weight", "raise_for_status"]
