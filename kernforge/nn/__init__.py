"""torch.nn modules on kernforge's kernels: ``Linear`` (prepacked bf16, int8 w8a8 or fp8 block-scaled
GEMM) and ``replace_linears`` to swap a model's ``nn.Linear`` layers in place."""

from kernforge.nn.linear import Linear, quantize_weight_fp8_block, quantize_weight_int8, replace_linears

__all__ = ["Linear", "quantize_weight_fp8_block", "quantize_weight_int8", "replace_linears"]
