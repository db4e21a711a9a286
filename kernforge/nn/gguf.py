"""torch.nn modules over a GGUF file's block-quantized tensors (``kernforge.ops.gemm.gguf``), packed
once at load and run at their own type: what ``kernforge.from_gguf`` puts where the model's
``nn.Linear`` and ``nn.Embedding`` layers were.

* :class:`GGUFLinear`: ``y = x @ W.T (+ b)`` on ``gguf_linear``; a fused layer (q|k|v, gate|up) holds
  one packed weight per run of parts of one type (a Q4_K_M file's attn_v is Q6_K where q and k are Q4_K).
* :class:`GGUFEmbedding`: rows dequantized on lookup only, from the same packed weight an lm_head tied
  to it multiplies by (one copy in memory).
* :class:`GGUFExperts`: a mixture of experts' experts, each expert's gate|up and down a GGUFLinear,
  run per expert on the tokens routed to it (not fused).
"""

from __future__ import annotations

import torch
from torch import nn

from kernforge.ops._common import BoundCall
from kernforge.ops.activation import silu_and_mul
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

    def bound(self, x: torch.Tensor, out: torch.Tensor) -> BoundCall:
        """``out = self(x)`` checked once, as a call of no arguments (``GGUFLinearRunner.bound``)."""
        return self._runner.bound(x, out)

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


class GGUFExperts(nn.Module):
    """A mixture-of-experts layer's experts on GGUF weights (what ``from_gguf`` puts where the model's
    stacked experts were): expert ``e`` is ``down[e](silu(gate_e(x)) * up_e(x))``, ``gate_up[e]`` a
    :class:`GGUFLinear` whose output is ``[gate | up]``, every part at the type the file stores.
    ``forward(x, top_k_index, top_k_weights)`` (transformers' experts' call) is
    ``sum_j top_k_weights[t, j] * expert_{top_k_index[t, j]}(x[t])`` per token, accumulated in fp32.

    Speed: this is not a fused kernel. The routed (token, expert) pairs are grouped by expert and each
    expert with tokens runs its two prepared GGUF GEMMs and ``silu_and_mul`` on its rows (three calls
    per active expert, each reading only that expert's blocks); a decode step's one token skips the
    grouping and runs its ``top_k`` experts directly. kernforge's one-call ``fused_experts`` does not
    read GGUF blocks."""

    def __init__(self, gate_up: list[GGUFLinear], down: list[GGUFLinear]):
        super().__init__()
        if not down or len(gate_up) != len(down):
            raise ValueError(
                f"GGUFExperts takes one gate|up and one down per expert, got {len(gate_up)} and {len(down)}"
            )
        self.num_experts = len(down)
        self.hidden_dim, self.intermediate_dim = down[0].out_features, down[0].in_features
        for e, (gu, d) in enumerate(zip(gate_up, down)):
            shapes = ((gu.out_features, gu.in_features), (d.out_features, d.in_features))
            if shapes != ((2 * self.intermediate_dim, self.hidden_dim), (self.hidden_dim, self.intermediate_dim)):
                raise ValueError(f"expert {e}'s gate|up and down are {shapes}; expert 0's are {self._shapes}")
        self.gate_up, self.down = nn.ModuleList(gate_up), nn.ModuleList(down)
        self._calls = [(gu.forward, d.forward) for gu, d in zip(gate_up, down)]  # no module hooks per call

    @property
    def _shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        return (2 * self.intermediate_dim, self.hidden_dim), (self.hidden_dim, self.intermediate_dim)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        x = hidden_states.reshape(-1, self.hidden_dim).contiguous()
        ids = top_k_index.reshape(x.shape[0], -1).long()
        weights = top_k_weights.reshape(ids.shape).to(torch.float32)
        out = torch.zeros(x.shape[0], self.hidden_dim, dtype=torch.float32)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_experts):
            raise ValueError(f"top_k_index must lie in [0, {self.num_experts}), got ids up to {int(ids.max())}")
        if x.shape[0] == 1:  # decode: the token's own experts, nothing to group
            for expert, weight in zip(ids[0].tolist(), weights[0].tolist()):
                out.add_(self._expert(expert, x), alpha=weight)
            return out.to(x.dtype)
        order = torch.argsort(ids.reshape(-1), stable=True)  # the (token, slot) pairs, grouped by expert
        tokens, pair_weights = order // ids.shape[1], weights.reshape(-1)[order, None]
        start = 0
        for expert, count in enumerate(torch.bincount(ids.reshape(-1), minlength=self.num_experts).tolist()):
            if count:
                rows = tokens[start : start + count]
                y = self._expert(expert, x.index_select(0, rows)).to(torch.float32)
                out.index_add_(0, rows, y.mul_(pair_weights[start : start + count]))
                start += count
        return out.to(x.dtype)

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        gate_up, down = self._calls[expert]
        return down(silu_and_mul(gate_up(x)))

    def extra_repr(self) -> str:
        layers = [layer for layer in [*self.gate_up, *self.down] if isinstance(layer, GGUFLinear)]
        types = dict.fromkeys("|".join(layer.qtypes) for layer in layers)  # gate|up's, then down's
        return (
            f"experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
            f"types={', '.join(types)}"
        )
