"""A stateful plan/run op from a new kernel module, end to end (README: "Writing a kernel module").

``SegmentSumWrapper`` sums ragged segments of rows, ``out[b] = x[indptr[b]:indptr[b+1]].sum(0)``,
written as kernforge's own attention wrappers are (``kernforge/ops/attention/decode.py``):
``plan()`` once per batch (checks, the variant, the thread partition written into a workspace, and
a declared plan ``Struct`` filled by field name), then ``run()`` per layer, which is pointer
extraction and one positional foreign call taking that struct.
"""

from __future__ import annotations

from pathlib import Path

import torch

import kernforge
from kernforge.jit import DType, Entry, Module, Struct

kernforge.register_template_dir(Path(__file__).parent / "templates")

# What plan() fixes for every run(): one struct, declared once (the prelude emits its C definition
# and the cffi cdef), filled by field name at plan time.
SEGMENT_SUM_PLAN = Struct(
    "kf_segment_sum_planned",
    (
        ("indptr", "int64_t"),
        ("dim", "int64_t"),
        ("workspace", "int64_t"),
        ("num_threads", "int64_t"),
    ),
)
SEGMENT_SUM = Module(
    "segment_sum",
    "segment_sum.cpp.jinja",
    params={"dtype": DType()},
    structs=[SEGMENT_SUM_PLAN],
    entries=[
        Entry("workspace_size", "int64_t num_threads", returns="int64_t"),
        Entry("plan", "int64_t indptr, int64_t batch, int64_t num_threads, int64_t workspace"),
        Entry("run", "const kf_segment_sum_planned* plan, int64_t out, int64_t x, int64_t x_stride"),
    ],
)


class SegmentSumWrapper:
    """``plan(indptr, dim, dtype)`` once, then ``run(x, out=None)`` any number of times."""

    def __init__(self, workspace_buffer: torch.Tensor):
        if not isinstance(workspace_buffer, torch.Tensor) or not workspace_buffer.is_cpu:
            raise TypeError("workspace_buffer must be a CPU torch.Tensor")
        self._workspace = workspace_buffer
        self._plan = None

    def plan(self, indptr: torch.Tensor, dim: int, dtype: torch.dtype = torch.float32) -> None:
        if not isinstance(indptr, torch.Tensor) or indptr.dtype != torch.int64 or indptr.dim() != 1:
            raise TypeError("indptr must be a 1-D torch.int64 tensor")
        if indptr.numel() < 1 or indptr[0] != 0 or bool((indptr[1:] < indptr[:-1]).any()):
            raise ValueError("indptr must start at 0 and be non-decreasing")
        kernel = SEGMENT_SUM.variant(dtype=dtype).kernel()
        threads = kernforge.ops.num_threads()
        needed = kernel.workspace_size(threads)
        if self._workspace.numel() * self._workspace.element_size() < needed:
            raise ValueError(f"workspace_buffer holds {self._workspace.nbytes} bytes; this plan needs {needed}")
        self._indptr = indptr.clone()  # the plan's own copy: the caller may reuse theirs
        batch = indptr.numel() - 1
        kernel.plan(self._indptr.data_ptr(), batch, threads, self._workspace.data_ptr())
        self._shape, self._out_shape, self._dtype = (int(indptr[-1]), dim), (batch, dim), dtype
        self._kernel = kernel
        self._plan = kernel.new(
            "kf_segment_sum_planned",
            {
                "indptr": self._indptr.data_ptr(),
                "dim": dim,
                "workspace": self._workspace.data_ptr(),
                "num_threads": threads,
            },
        )

    def run(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self._plan is None:
            raise RuntimeError("SegmentSumWrapper.run() called before plan()")
        if x.shape != self._shape or x.dtype != self._dtype or x.stride(-1) != 1:
            raise ValueError(
                f"x must be a {self._dtype} tensor of shape {self._shape} with contiguous rows, "
                f"got {x.dtype} {tuple(x.shape)}"
            )
        if out is None:
            out = torch.empty(self._out_shape, dtype=self._dtype)
        elif out.shape != self._out_shape or out.dtype != self._dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {self._dtype} tensor of shape {self._out_shape}")
        self._kernel.run(self._plan, out.data_ptr(), x.data_ptr(), x.stride(0))  # positional: the hot path
        return out


def reference(x: torch.Tensor, indptr: torch.Tensor) -> torch.Tensor:
    return torch.stack([x[a:b].float().sum(0) for a, b in zip(indptr[:-1].tolist(), indptr[1:].tolist())])


if __name__ == "__main__":
    lengths = torch.tensor([3, 0, 1000, 1, 17])
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    x = torch.randn(int(indptr[-1]), 100)
    wrapper = SegmentSumWrapper(torch.empty(1024, dtype=torch.uint8))
    wrapper.plan(indptr, dim=100)
    for tier in kernforge.jit.runnable_tiers():
        with kernforge.use_isa(tier):
            wrapper.plan(indptr, dim=100)  # a plan binds the kernel of the tier in use
            torch.testing.assert_close(wrapper.run(x), reference(x, indptr), atol=1e-4, rtol=1e-4)
        print(f"segment_sum on tier {tier}: matches torch")
