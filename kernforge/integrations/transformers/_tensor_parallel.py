"""Tensor parallelism for ``optimize(model, tp_group=...)``: Megatron's sharding of a Llama-family
decoder, on the stock modules before optimize() replaces them, so the rest of optimize() (packing,
the paged cache, attention) runs unchanged on each rank's part.

* attention: q/k/v keep this rank's query and KV heads (column parallel: rows of their weights), so
  the paged KV cache holds this rank's KV heads only; o_proj keeps the matching input columns (row
  parallel) and its output is all-reduced;
* MLP: gate/up keep a slice of the intermediate rows, down the same columns, all-reduced after;
* lm_head: vocab parallel, each rank a slice of the vocabulary's rows, the logits all-gathered along
  the vocabulary (the padding rows of a vocabulary the ranks do not divide are dropped);
* embeddings and norms: replicated. A bias of a row-parallel linear stays on rank 0 only, so the
  all-reduce adds it once.

Every rank ends a layer with the same bits (kernforge's all_reduce gives every rank the same sum),
so greedy decoding picks the same tokens on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from kernforge.distributed import Communicator
from kernforge.integrations.transformers._modules import _linear


class RowParallel(nn.Module):
    """A linear holding a slice of its input features: the partial outputs all-reduced."""

    def __init__(self, linear: nn.Module, comm: Communicator):
        super().__init__()
        self.linear, self.comm = linear, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        self.comm.all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return f"all_reduce over {self.comm.world_size} ranks"


class VocabParallel(nn.Module):
    """An lm_head holding a slice of the vocabulary's rows: the logits gathered along the vocabulary."""

    def __init__(self, linear: nn.Module, comm: Communicator, vocab_size: int):
        super().__init__()
        self.linear, self.comm, self.vocab_size = linear, comm, vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.comm.all_gather(self.linear(x), dim=-1)
        return logits if logits.shape[-1] == self.vocab_size else logits[..., : self.vocab_size]

    def extra_repr(self) -> str:
        return f"vocab {self.vocab_size}, all_gather over {self.comm.world_size} ranks"


def check_shardable(config, decoder, world: int) -> None:
    """Raises ValueError unless the heads and the MLP divide among ``world`` ranks."""
    from kernforge.integrations.transformers import UnsupportedModelError

    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % world or kv_heads % world:
        raise ValueError(
            f"tensor parallelism over {world} ranks needs the attention heads ({heads}) and KV heads "
            f"({kv_heads}) to divide among them"
        )
    for layer in decoder.layers:
        mlp, attn = layer.mlp, layer.self_attn
        if hasattr(mlp, "experts") or not all(
            type(getattr(mlp, n, None)) is nn.Linear for n in ("gate_proj", "up_proj", "down_proj")
        ):
            raise UnsupportedModelError(
                f"tensor parallelism covers dense gated MLPs (gate/up/down nn.Linear); layer {attn.layer_idx} "
                f"has {type(mlp).__name__}"
            )
        if mlp.gate_proj.out_features % world:
            raise ValueError(
                f"tensor parallelism over {world} ranks needs the intermediate size "
                f"({mlp.gate_proj.out_features}) to divide among them"
            )
        norm = getattr(attn, "q_norm", None)
        if norm is not None and norm.weight.numel() != attn.head_dim:
            raise UnsupportedModelError("tensor parallelism needs per-head q/k norms (not over the whole projection)")


def shard_stock_modules(model: nn.Module, comm: Communicator) -> None:
    """Keeps this rank's part of every attention and MLP linear of the stock decoder (new modules,
    the model's weights untouched: a tied embedding keeps its rows)."""
    rank, world = comm.rank, comm.world_size
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            owner = attn if hasattr(attn, name) else mlp
            setattr(owner, name, _rows(getattr(owner, name), rank, world))
        attn.o_proj = _columns(attn.o_proj, rank, world)
        mlp.down_proj = _columns(mlp.down_proj, rank, world)


def parallelize_outputs(model: nn.Module, comm: Communicator) -> None:
    """After optimize()'s replacement: the row-parallel linears all-reduce, lm_head (sharded here,
    vocab parallel) all-gathers."""
    for layer in model.model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, comm)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, comm)


def vocab_parallel_head(lm_head: nn.Linear, comm: Communicator) -> tuple[nn.Linear, int]:
    """lm_head's rows for this rank (the vocabulary padded with zero rows to a multiple of the
    ranks), and the vocabulary size."""
    vocab = lm_head.out_features
    per_rank = -(-vocab // comm.world_size)
    weight = lm_head.weight.detach()
    begin, end = comm.rank * per_rank, min(vocab, (comm.rank + 1) * per_rank)
    part = weight.new_zeros(per_rank, weight.shape[1])
    part[: max(0, end - begin)] = weight[begin:end]
    bias = None
    if lm_head.bias is not None:
        bias = lm_head.bias.detach().new_zeros(per_rank)
        bias[: max(0, end - begin)] = lm_head.bias.detach()[begin:end]
    return _linear(part, bias), vocab


def _rows(linear: nn.Linear, rank: int, world: int) -> nn.Linear:
    size = linear.out_features // world
    rows = slice(rank * size, (rank + 1) * size)
    bias = None if linear.bias is None else linear.bias.detach()[rows].clone()
    return _linear(linear.weight.detach()[rows].clone(), bias)


def _columns(linear: nn.Linear, rank: int, world: int) -> nn.Linear:
    size = linear.in_features // world
    bias = None if linear.bias is None else (linear.bias.detach().clone() if rank == 0 else None)
    return _linear(linear.weight.detach()[:, rank * size : (rank + 1) * size].clone(), bias)
