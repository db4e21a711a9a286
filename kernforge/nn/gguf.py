"""torch.nn modules over a GGUF file's block-quantized tensors (``kernforge.ops.gemm.gguf``), packed
once at load and run at their own type: what ``kernforge.from_gguf`` puts where the model's
``nn.Linear`` and ``nn.Embedding`` layers were.

* :class:`GGUFLinear`: ``y = x @ W.T (+ b)`` on ``gguf_linear``; a fused layer (q|k|v, gate|up) holds
  one packed weight per run of parts of one type (a Q4_K_M file's attn_v is Q6_K where q and k are Q4_K).
* :class:`GGUFEmbedding`: rows dequantized on lookup only, from the same packed weight an lm_head tied
  to it multiplies by (one copy in memory).
"""

from __future__ import annotations

import torch
from torch import nn

from kernforge.ops.gemm import gguf


class GGUFLinear(nn.Module):
    """A linear layer on GGUF weights. ``parts``: packed weights with one K, their outputs side by
    side; ``bias`` fp32 ``[N]`` or None; outputs in ``dtype``."""

    def __init__(self, parts: list[gguf.PackedGGUFWeight], bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.parts = list(parts)
        self.in_features = self.parts[0].k
        self.out_features = sum(part.n for part in self.parts)
        self.dtype = dtype
        bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        self._runner = gguf.GGUFLinearRunner(self.parts, bias)  # checked and laid out once, run per token

    @classmethod
    def concatenated(cls, layers: list[GGUFLinear]) -> GGUFLinear:
        """One layer whose output is ``layers``' outputs side by side; adjacent parts of one type are
        packed as one weight (one GEMM call)."""
        if not all(isinstance(layer, GGUFLinear) for layer in layers):
            kinds = ", ".join(type(layer).__name__ for layer in layers)
            raise ValueError(f"cannot fuse GGUF weights with other linears ({kinds}): all or none must be GGUF")
        runs: list[list[gguf.PackedGGUFWeight]] = []
        for part in (part for layer in layers for part in layer.parts):
            if runs and runs[-1][0].qtype == part.qtype:
                runs[-1].append(part)
            else:
                runs.append([part])
        parts = [run[0] if len(run) == 1 else gguf.concatenated(run) for run in runs]
        bias = None
        if any(layer.bias is not None for layer in layers):  # zeros for a layer without one
            bias = torch.cat(
                [torch.zeros(layer.out_features) if layer.bias is None else layer.bias for layer in layers]
            )
        return cls(parts, bias, layers[0].dtype)

    @property
    def bias(self) -> torch.Tensor | None:
        """fp32 ``[out_features]`` or None (fixed at construction: the runner holds it)."""
        return self._runner.bias

    @property
    def qtypes(self) -> tuple[str, ...]:
        return tuple(part.qtype for part in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._runner(x)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"types={'|'.join(self.qtypes)}"
        )


class GGUFEmbedding(nn.Module):
    """An embedding over a packed GGUF weight ``[vocab, hidden]``: the looked-up rows, in ``dtype``,
    times ``scale`` (Gemma's sqrt(hidden); 1 elsewhere)."""

    def __init__(self, weight: gguf.PackedGGUFWeight, dtype: torch.dtype, scale: float = 1.0):
        super().__init__()
        self.weight_packed, self.dtype, self.scale = weight, dtype, float(scale)
        # The packed codes as the module's parameter (frozen): what transformers reads a model's device from.
        self.codes = nn.Parameter(weight.packed, requires_grad=False)
        self.num_embeddings, self.embedding_dim = weight.n, weight.k

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input_ids has dtype {input_ids.dtype}; expected torch.int64 or torch.int32")
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.num_embeddings):
            raise ValueError(f"input_ids must lie in [0, {self.num_embeddings}), got ids up to {int(input_ids.max())}")
        rows = gguf.embedding_rows(self.weight_packed, input_ids.long())
        if self.scale != 1.0:
            rows = rows * self.scale
        return rows.to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={self.weight_packed.qtype}"
