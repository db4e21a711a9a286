"""``save_pretrained`` of an optimized model: the checkpoint stock transformers would have written.

optimize() replaces modules: the linears become :class:`kernforge.nn.Linear` (the weight packed for
the GEMM; q|k|v and gate|up packed as one), and the MoE experts become packed weights outside the
state dict. The optimized model's ``state_dict()`` is kernforge's layout (packed buffers and each
Linear's extra state, a dict), which transformers' ``save_pretrained`` cannot write and no stock
model loads. So optimize() records the stock state dict's keys, shapes and dtypes
(:func:`stock_layout`) and gives the model a ``save_pretrained`` (:func:`install`) that writes that
state dict, rebuilt from the packed weights (:func:`stock_state_dict`), through transformers' own.

The rebuild is exact or refused: a bf16 weight packed unquantized is a permutation of the original
(checked by packing the rebuilt weight again), and the norms and embeddings are the model's own
tensors. A quantized weight, a weight rounded to bf16 from a wider dtype, packed experts and a
tensor-parallel shard cannot be restored: saving refuses, naming them and how to save instead.
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch
from torch import nn

from kernforge.model_spec import PACKED_LINEARS
from kernforge.nn import Linear
from kernforge.ops.gemm import bf16

# key -> (shape, dtype) of the model's state dict before optimize()
StockLayout = dict[str, tuple[tuple[int, ...], torch.dtype]]

# A packed linear's name -> the stock linears packed in it, in order (DeepSeek's first part is
# q_a_proj, or q_proj without a q LoRA: whichever the stock layout has).
_PACKED_PARTS = {**PACKED_LINEARS, "qkv_a_proj": ("q_a_proj", "q_proj", "kv_a_proj_with_mqa")}
_SHOWN = 4  # names shown in the error, of each kind of problem
_NOT_IN_MODEL = "no counterpart in the optimized model (MoE experts are packed outside it)"
_OUTSIDE_STATE_DICT = "weights held outside the model's state dict (as a GGUF file's blocks are)"


class _Stock:
    """What optimize() recorded of the stock state dict: each key's layout, and the keys that alias
    an earlier one (tied weights: ``lm_head.weight`` and ``embed_tokens.weight``)."""

    def __init__(self, layout: StockLayout, aliases: dict[str, str]):
        self.layout, self.aliases = layout, aliases
        self.modules: dict[str, list[str]] = {}  # a module's name -> its keys
        for key in layout:
            self.modules.setdefault(key.rpartition(".")[0], []).append(key)


def stock_layout(model: nn.Module) -> _Stock:
    """The stock state dict's keys, shapes, dtypes and tied aliases; call before any module changes
    (meta tensors, of layers a ``materialize_layer`` fills later, have their shapes already)."""
    layout: StockLayout = {}
    aliases: dict[str, str] = {}
    first_of: dict[int, str] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        if not isinstance(tensor, torch.Tensor):
            continue
        layout[key] = (tuple(tensor.shape), tensor.dtype)
        first = first_of.setdefault(id(tensor), key)
        if first != key:
            aliases[key] = first
    return _Stock(layout, aliases)


def install(model: nn.Module) -> None:
    """Give ``model`` (optimized) the ``save_pretrained`` below, in place of transformers' for this
    instance only (a ``copy.deepcopy`` of the model binds it to the copy)."""
    # into __dict__ as nn.Module.__setattr__ would put it (its annotation allows tensors and modules only)
    model.__dict__["save_pretrained"] = types.MethodType(save_pretrained, model)


def save_pretrained(
    model: Any,
    save_directory: str | os.PathLike[str],
    is_main_process: bool = True,
    state_dict: dict[str, torch.Tensor] | None = None,
    **kwargs: Any,
) -> Any:
    """transformers' ``save_pretrained`` with the stock state dict (:func:`stock_state_dict`) unless
    ``state_dict`` is given; raises ValueError, before writing anything, where it cannot be rebuilt."""
    if state_dict is None:
        state_dict = stock_state_dict(model)
    return type(model).save_pretrained(
        model, save_directory, is_main_process=is_main_process, state_dict=state_dict, **kwargs
    )


def stock_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict the model had before optimize(), rebuilt from the optimized one (see the module
    docstring); ValueError naming what cannot be."""
    runtime: Any = getattr(model, "_kernforge", None)
    if runtime is None:
        raise ValueError(
            "stock_state_dict(model) needs a model prepared by kernforge.integrations.transformers.optimize()"
        )
    if runtime.comm is not None:
        _refuse({"each rank holds a tensor-parallel shard of them (tp_group)": ["the weights"]})
    stock: _Stock = runtime.stock
    restored: dict[str, torch.Tensor] = {}
    problems: dict[str, list[str]] = {}  # why -> the modules or keys it holds for
    refused: set[str] = set()  # the keys of linears in problems (named there once, by module)
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            refused.update(_restore_linear(name, module, stock, restored, problems))
        elif hasattr(module, "out_features") and name not in stock.modules:  # another kind of linear
            problems.setdefault(_OUTSIDE_STATE_DICT, []).append(name)
    for key, tensor in model.state_dict().items():
        if key in stock.layout and key not in restored and isinstance(tensor, torch.Tensor):
            restored[key] = tensor
    for alias, first in stock.aliases.items():
        if first in restored:
            restored[alias] = restored[first]  # one tensor, as stock: save_pretrained writes the tie once
    for key in stock.layout:
        if key in refused:
            continue
        if key not in restored:
            problems.setdefault(_NOT_IN_MODEL, []).append(key)
        elif _layout_of(restored[key]) != stock.layout[key]:
            problems.setdefault("kept by kernforge in another shape or dtype", []).append(key)
    if problems:
        _refuse(problems)
    return {key: restored[key] for key in stock.layout}


def _restore_linear(
    name: str, module: Linear, stock: _Stock, restored: dict[str, torch.Tensor], problems: dict[str, list[str]]
) -> list[str]:
    """The stock weights and biases of the linears packed in kernforge Linear ``name``, into
    ``restored``; why they cannot be restored, into ``problems`` (and their keys returned)."""
    parts = _stock_parts(name, stock)
    keys = [key for part in parts for key in stock.modules[part]]
    if not keys:
        problems.setdefault(_OUTSIDE_STATE_DICT, []).append(name)
        return []
    if all(key in stock.aliases for key in keys):
        return []  # a tied head: its embedding is saved
    layouts = [stock.layout.get(f"{part}.weight") for part in parts]
    weight, why = _unpacked_weight(module, layouts)
    if weight is None:
        problems.setdefault(why, []).append(name)
        return keys
    widths = [layout[0][0] for layout in layouts if layout is not None]
    # Copies, not views: transformers takes tensors sharing storage for tied weights.
    for part, part_weight in zip(parts, weight.split(widths)):
        restored[f"{part}.weight"] = part_weight.clone()
    bias = module.bias
    if isinstance(bias, torch.Tensor):
        for part, part_bias in zip(parts, bias.split(widths)):
            if f"{part}.bias" in stock.layout:  # packing gave a bias-free part zeros
                restored[f"{part}.bias"] = part_bias.clone()
    return []


def _unpacked_weight(
    module: Linear, layouts: list[tuple[tuple[int, ...], torch.dtype] | None]
) -> tuple[torch.Tensor | None, str]:
    """The weight ``module`` packed, exactly the stock weights (of ``layouts``: their shapes and
    dtypes; None for a stock linear without a plain ``weight``) side by side; or None and why not."""
    if module.quant is not None:
        return None, f"quantized (quant={module.quant!r})"
    if any(layout is None for layout in layouts):
        return None, "stored quantized before optimize() (a four-bit checkpoint's qweight, scales, ...)"
    wider = sorted({str(layout[1]) for layout in layouts if layout is not None and layout[1] is not torch.bfloat16})
    if wider:
        return None, f"rounded to bf16 from {', '.join(wider)} when packed"
    weight = _unpacked_bf16(module)
    if weight is None or sum(layout[0][0] for layout in layouts if layout is not None) != weight.shape[0]:
        return None, "packed in a layout this code cannot unpack"
    return weight, ""


def _stock_parts(name: str, stock: _Stock) -> list[str]:
    """The stock linears kernforge Linear ``name`` stands for: itself, or the ones packed in it."""
    if name in stock.modules:
        return [name]
    parent, _, leaf = name.rpartition(".")
    prefix = f"{parent}." if parent else ""
    return [prefix + part for part in _PACKED_PARTS.get(leaf, ()) if prefix + part in stock.modules]


def _unpacked_bf16(module: Linear) -> torch.Tensor | None:
    """The ``[out_features, in_features]`` bf16 weight an unquantized Linear packed, or None when
    packing it again does not give the module's buffer (a layout this code does not know)."""
    packed = module.weight_packed
    if not isinstance(packed, torch.Tensor) or packed.dim() != 4:
        return None
    panels, pairs, width, pair = packed.shape
    rows = packed.permute(0, 2, 1, 3).reshape(panels * width, pairs * pair)
    weight = rows[: module.out_features, : module.in_features].contiguous()
    repacked = bf16.convert_weight_packed(weight).packed
    return weight if repacked.shape == packed.shape and torch.equal(repacked, packed) else None


def _layout_of(tensor: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    return tuple(tensor.shape), tensor.dtype


def _listed(keys: list[str]) -> str:
    return ", ".join(keys[:_SHOWN]) + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


def _refuse(problems: dict[str, list[str]]) -> None:
    shown = "; ".join(f"{_listed(names)}: {why}" for why, names in problems.items())
    raise ValueError(
        "save_pretrained: this kernforge-optimized model cannot be written back as the stock checkpoint: "
        f"{shown}. Save the model before kernforge.integrations.transformers.optimize() (or keep the checkpoint "
        "it was loaded from), and optimize() the loaded model again"
    )
