"""SGLang's baseline on CPU without kernforge and without a CPU build of sgl-kernel: the few Python-level
names SGLang 0.5.23 imports from ``sgl_kernel`` whenever SGLANG_USE_CPU_ENGINE=1, in plain torch.

Only for measuring SGLang's own CPU path (``--attention-backend torch_native``), by putting this folder
on PYTHONPATH (tests/sglang/README.md). The ``sglang-kernel`` wheel on PyPI is a CUDA build (it pins a
CUDA torch), and SGLang's CPU build of it is built from source, so a CPU environment has no
``sgl_kernel`` at all, yet SGLang imports these at module level on CPU (sglang/srt/mem_cache/allocation.py,
sglang/kernels/ops/kvcache/cache_move.py, sglang/kernels/ops/speculative/*).

It registers no ``torch.ops.sgl_kernel`` op: ``torch.ops.sgl_kernel.convert_weight_packed`` being absent
keeps ``sglang.srt.utils.cpu_has_amx_support()`` False, so SGLang takes its torch-native layers.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch

__version__ = "0.0.0+baseline"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] = the next end-start entries of
    out_cache_loc, request after request (SGLang's Triton kernel assign_req_to_token_pool)."""
    del pool_len
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """Copies KV rows src_loc -> tgt_loc in every layer's buffer; the buffers come as raw base
    pointers, which plain torch cannot address: unused by one_batch and offline_throughput."""
    _unavailable("copy_all_layer_kv_cache_cpu")


def _unavailable(name: str) -> NoReturn:
    raise NotImplementedError(f"sgl_kernel.{name}: not in the baseline stand-in (tests/sglang/stubs/baseline)")


def __getattr__(name: str) -> Any:
    # The speculative-decoding helpers (assign_draft_cache_locs_contiguous_cpu, fill_bonus_tokens_cpu,
    # build_tree_kernel_efficient_cpu, ...) are imported at module level on CPU but called only with
    # speculative decoding on: importable, raising if called.
    if name.startswith("__") or not name.endswith("_cpu"):
        raise AttributeError(name)

    def call(*args: Any, **kwargs: Any) -> NoReturn:
        _unavailable(name)

    call.__name__ = name
    return call
