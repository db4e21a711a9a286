"""Add a kernel variant by declaring a module and writing its template, then call it.

The declaration below names the template (examples/templates/relu2_and_mul.cpp.jinja),
its compile-time parameter (the dtype) and its entry point; the template writes
`{{ decl.run }}` for the entry, includes the shared prelude and writes its body
against kf::VecF, so the same file builds for every ISA tier. kernforge renders,
compiles, caches and loads it exactly like the built-in ops.
"""

from pathlib import Path

import torch

import kernforge
from kernforge.jit import DType, Entry, Module

kernforge.register_template_dir(Path(__file__).parent / "templates")

# out [rows, d] = relu(x[:, :d])^2 * x[:, d:] for x [rows, 2d]; addresses travel as int64.
RELU2_AND_MUL = Module(
    "relu2_and_mul",
    "relu2_and_mul.cpp.jinja",
    params={"dtype": DType()},
    entries=[Entry("run", "int64_t out, int64_t input, int64_t rows, int64_t d, int64_t num_threads")],
)


def relu2_and_mul(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype)
    rows = x.numel() // (2 * d)
    # variant() is memoized (a torch dtype is accepted); after the first call, kernel() is one compare.
    kernel = RELU2_AND_MUL.variant(dtype=x.dtype).kernel()
    kernel.run(out.data_ptr(), x.data_ptr(), rows, d, kernforge.ops.num_threads())
    return out


if __name__ == "__main__":
    x = torch.randn(33, 2 * 1000, dtype=torch.bfloat16)
    for tier in kernforge.jit.runnable_tiers():
        with kernforge.use_isa(tier):
            got = relu2_and_mul(x)
        ref = torch.relu(x[:, :1000].float()).square() * x[:, 1000:].float()
        torch.testing.assert_close(got.float(), ref, atol=1e-2, rtol=1e-2)
        print(f"relu2_and_mul on tier {tier}: matches torch")
