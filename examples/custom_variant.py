"""Add a kernel variant by writing a template, then call it.

The template (examples/templates/relu2_and_mul.cpp.jinja) sets `cdecl`,
includes the shared prelude and writes its body against kf::VecF, so the same
file builds for every ISA tier. kernforge renders, compiles, caches and loads
it exactly like the built-in ops.
"""

from pathlib import Path

import torch

import kernforge
from kernforge.jit import Variant
from kernforge.ops._common import dtype_name, num_threads

kernforge.register_template_dir(Path(__file__).parent / "templates")

# One Variant per dtype: after the first call, getting the kernel is one compare.
RELU2_AND_MUL = {dt: Variant("relu2_and_mul.cpp.jinja", {"dtype": dt}) for dt in ("fp32", "bf16", "fp16")}


def relu2_and_mul(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype)
    rows = x.numel() // (2 * d)
    RELU2_AND_MUL[dtype_name(x.dtype)].kernel()(out.data_ptr(), x.data_ptr(), rows, d, num_threads())
    return out


if __name__ == "__main__":
    x = torch.randn(33, 2 * 1000, dtype=torch.bfloat16)
    for tier in kernforge.jit.runnable_tiers():
        with kernforge.use_isa(tier):
            got = relu2_and_mul(x)
        ref = torch.relu(x[:, :1000].float()).square() * x[:, 1000:].float()
        torch.testing.assert_close(got.float(), ref, atol=1e-2, rtol=1e-2)
        print(f"relu2_and_mul on tier {tier}: matches torch")
