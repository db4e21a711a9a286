"""The prepared decode step: a decode forward as a list of bound kernel calls.

A decode step (one new token per sequence) moves few bytes besides the weights, and on a small
model the Python around the kernels costs as much as the weights take to read: transformers'
module calls, each op's checks, its output allocations (SmolLM2-135M measured ~0.23 ms per layer
outside the kernels, about half a step). :class:`DecodeSteps`, installed as an optimized decoder's
``forward``, runs such a step itself: for each batch size it prepares once static buffers (the
residual stream, the normed rows, q|k|v, the attention's output, gate|up, ...) and every layer's
kernel calls on them, checked once (the ops' ``bound_*`` forms); a step then copies the token's
embedding and positions in, plans the paged cache (the append and the attention are bound once per
step, for every layer), and runs the calls in order. The kernels and their order are the eager
forward's, so the step's outputs equal its outputs bit for bit (``tests/integrations``).

Anything else runs transformers' forward as before: prefill, padding in the new tokens, hooks on the
decoder's modules, ``output_hidden_states`` / ``output_attentions``, ``torch.compile``, and layers
this module does not know (their MLP, a MoE block or a stock one, runs as its module's forward
inside the step; an attention or layer layout of another kind makes the whole step stock's).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.utils.generic import ModelOutput

from kernforge.integrations.transformers import _compat
from kernforge.integrations.transformers import _kernels as kf
from kernforge.integrations.transformers._cache import MLAPagedCache, PagedCache
from kernforge.integrations.transformers._modules import Attention, GatedMLP, RMSNorm
from kernforge.jit import core as jit_core
from kernforge.model_spec import GATED_OP_BY_ACTIVATION
from kernforge.nn import Linear
from kernforge.nn.gguf import GGUFLinear
from kernforge.ops._common import num_threads

# decoder layers whose forward is the pre-norm block the step runs: h += attn(norm(h)); h += mlp(norm(h))
PRE_NORM_LAYERS = (
    "LlamaDecoderLayer",
    "MistralDecoderLayer",
    "Qwen2DecoderLayer",
    "Qwen3DecoderLayer",
    "Qwen2MoeDecoderLayer",
    "Qwen3MoeDecoderLayer",
    "MixtralDecoderLayer",
    "OlmoeDecoderLayer",
)
# keyword arguments a decoder's forward may get that the step can run with, at these values
_BENIGN_KWARGS = {
    "output_router_logits": (None, False),
    "use_cache": (None, True, False),
    "output_attentions": (None, False),
    "output_hidden_states": (None, False),
}
Call = Callable[[], object]  # a bound kernel call, or a module's forward writing a buffer
_OUTPUT_CACHE_FIELD = next(
    name for name in _compat.CACHE_ARGUMENTS if name in {f.name for f in dataclasses.fields(BaseModelOutputWithPast)}
)


class DecodeSteps:
    """An optimized decoder's ``forward``: prepared decode steps where they apply, else ``stock``."""

    def __init__(self, decoder: Any, stock: Callable[..., Any], cache_argument: str):
        self.decoder, self.stock, self.cache_argument = decoder, stock, cache_argument
        functools.update_wrapper(self, stock)  # the stock forward's name, docs and signature, for inspect
        self._local = threading.local()  # each thread's programs: a program's buffers serve one step at a time
        self._output: type[ModelOutput] | None = None  # the stock forward's output class, once seen
        self._modules_seen()

    def __getstate__(self) -> dict[str, Any]:  # a copied model starts without programs
        return {name: value for name, value in self.__dict__.items() if name != "_local"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def _programs(self) -> dict[int, _Program]:
        """This thread's programs by batch size."""
        programs: dict[int, _Program] | None = getattr(self._local, "programs", None)
        if programs is None:
            programs = self._local.programs = {}
        return programs

    def _modules_seen(self) -> None:
        """What the decoder's modules allow, read again whenever a program is (re)built."""
        decoder = self.decoder
        self.supported = all(_layer_supported(layer) for layer in decoder.layers)
        self._hooks = [
            hooks
            for module in decoder.modules()
            if module is not decoder
            for hooks in (module._forward_hooks, module._forward_pre_hooks)
        ]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        input_ids: Any = kwargs.get("input_ids")
        cache: Any = kwargs.get(self.cache_argument)
        if args or self._output is None or not self._applies(input_ids, cache, kwargs):
            output = self.stock(*args, **kwargs)
            if isinstance(output, ModelOutput) and "last_hidden_state" in output:
                self._output = type(output)  # what the step returns too (MoE models' carries router_logits)
            return output
        batch, programs = input_ids.shape[0], self._programs()
        program = programs.get(batch)
        if program is None or not program.current(self.decoder):
            self._modules_seen()
            if not self._applies(input_ids, cache, kwargs):
                return self.stock(*args, **kwargs)
            program = programs[batch] = _Program(self.decoder, batch)
        hidden = program.run(input_ids, kwargs.get("position_ids"), kwargs.get("attention_mask"), cache)
        return self._output(last_hidden_state=hidden, **{_OUTPUT_CACHE_FIELD: cache})

    def _applies(self, input_ids: Any, cache: Any, kwargs: dict[str, Any]) -> bool:
        """Whether this forward is a decode step the prepared step runs as transformers would."""
        if not self.supported or torch.compiler.is_compiling() or self.decoder.training:
            return False
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] != 1:
            return False
        if not isinstance(cache, PagedCache) or isinstance(cache, MLAPagedCache) or not cache.sequence_lengths:
            return False
        for name, value in kwargs.items():
            if name not in ("input_ids", self.cache_argument, "position_ids", "attention_mask", "inputs_embeds"):
                if not any(value is allowed for allowed in _BENIGN_KWARGS.get(name, ())):
                    return False
        config = self.decoder.config
        if kwargs.get("inputs_embeds") is not None or config.output_hidden_states or config.output_attentions:
            return False
        mask = kwargs.get("attention_mask")
        if mask is not None and (mask.dim() != 2 or not bool(mask[:, -1].all())):
            return False  # a padded new token: the stock path gathers the real rows
        hooked = torch.nn.modules.module
        if hooked._global_forward_hooks or hooked._global_forward_pre_hooks:
            return False
        return not any(self._hooks) or all(map(_inert, (hook for hooks in self._hooks for hook in hooks.values())))


def _inert(hook: Callable[..., Any]) -> bool:
    """transformers' output-capturing hooks (installed for good the first time a forward asks for
    hidden states) do nothing unless a forward asks again, which runs the stock forward."""
    return getattr(hook, "__module__", "") == "transformers.utils.output_capturing"


def _layer_supported(layer: Any) -> bool:
    attn = getattr(layer, "self_attn", None)
    norms = (getattr(layer, name, None) for name in ("input_layernorm", "post_attention_layernorm"))
    return (
        type(layer).__name__ in PRE_NORM_LAYERS
        and type(attn) is Attention
        and attn.clip_qkv is None
        and (attn.q_norm is None or type(attn.q_norm) is RMSNorm)  # not GemmaRMSNorm (1 + weight)
        and all(type(norm) is RMSNorm for norm in norms)
    )


class _Program:
    """The prepared decode step of one batch size: buffers and every layer's bound calls."""

    def __init__(self, decoder: Any, batch: int):
        first = decoder.layers[0].self_attn
        self.batch, self.generation, self.threads = batch, jit_core._generation, num_threads()
        self.rotary, self.embed_tokens, self.norm = decoder.rotary_emb, decoder.embed_tokens, decoder.norm
        self.cos_sin_cache = self.rotary.cos_sin_cache
        self.layers = list(decoder.layers)
        heads, kv_heads, head_dim = first.num_qo_heads, first.num_kv_heads, first.head_dim
        hidden = decoder.layers[0].input_layernorm.weight.numel()
        dtype = decoder.layers[0].input_layernorm.weight.dtype
        new = lambda *shape: torch.empty(shape, dtype=dtype)  # noqa: E731
        self.hidden = new(batch, hidden)  # the residual stream
        self.normed = new(batch, hidden)
        self.qkv = new(batch, (heads + 2 * kv_heads) * head_dim)
        q, k, v = self.projected_qkv = self.qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], 1)
        if first.q_norm is not None:  # normed copies: the q|k|v rows stay the projection's
            q, k = new(batch, heads * head_dim), new(batch, kv_heads * head_dim)
        self.q, self.k, self.v = q, k, v
        self.attention = new(batch, heads * head_dim)
        self.projected = new(batch, hidden)  # o_proj's and the MLP's outputs
        self.positions = torch.zeros(batch, dtype=torch.int64)
        self.rows = (
            q.view(batch, heads, head_dim),
            k.view(batch, kv_heads, head_dim),
            v.view(batch, kv_heads, head_dim),
            self.attention.view(batch, heads, head_dim),
        )
        self.before_attention = [self._attention_input(layer) for layer in self.layers]
        self.after_attention = [self._attention_output_and_mlp(layer, new) for layer in self.layers]

    def current(self, decoder: Any) -> bool:
        """Whether what the calls were bound to is still the model's: the kernels' tier, the threads
        torch allows, the layers, and RoPE's cos/sin cache (which grows past the positions it was
        built for)."""
        return (
            self.generation == jit_core._generation
            and self.threads == num_threads()
            and self.rotary is decoder.rotary_emb
            and self.embed_tokens is decoder.embed_tokens
            and self.norm is decoder.norm
            and self.cos_sin_cache is self.rotary.cos_sin_cache
            and all(a is b for a, b in zip(self.layers, decoder.layers))
        )

    def _attention_input(self, layer: Any) -> list[Call]:
        """input_layernorm, q|k|v, the q/k norms, RoPE: the layer's calls up to the cache's append."""
        attn = layer.self_attn
        calls = [_bound_norm(layer.input_layernorm, self.hidden, self.normed)]
        calls.append(_bound_linear(attn.qkv_proj, self.normed, self.qkv))
        if attn.q_norm is not None:
            batch, (q, k, _) = self.batch, self.projected_qkv
            for norm, source, target in ((attn.q_norm, q, self.q), (attn.k_norm, k, self.k)):
                width = norm.weight.numel()  # per head (Qwen3) or the whole row
                calls.append(_bound_norm(norm, source.view(batch, -1, width), target.view(batch, -1, width)))
        calls.append(
            kf.bound_rope_with_cos_sin_cache_inplace(
                self.positions, self.q, self.k, attn.head_dim, self.cos_sin_cache, is_neox=True
            )
        )
        return calls

    def _attention_output_and_mlp(self, layer: Any, new: Callable[..., torch.Tensor]) -> list[Call]:
        """o_proj, the residual add, post_attention_layernorm, the MLP and its residual add."""
        add = self.hidden.add_  # stock's residual + h: the same bf16 sum, in place
        calls = [_bound_linear(layer.self_attn.o_proj, self.attention, self.projected)]
        calls.append(lambda: add(self.projected))
        calls.append(_bound_norm(layer.post_attention_layernorm, self.hidden, self.normed))
        calls.extend(self._mlp(layer.mlp, new))
        calls.append(lambda: add(self.projected))
        return calls

    def _mlp(self, mlp: Any, new: Callable[..., torch.Tensor]) -> list[Call]:
        if type(mlp) is not GatedMLP:  # a MoE block or another MLP: its own forward, inside the step
            return [lambda: self.projected.copy_(mlp.forward(self.normed))]
        gate_up = new(self.batch, mlp.gate_up_proj.out_features)
        gated = new(self.batch, mlp.gate_up_proj.out_features // 2)
        op = GATED_OP_BY_ACTIVATION[mlp.activation]
        return [
            _bound_linear(mlp.gate_up_proj, self.normed, gate_up),
            kf.bound_gated(op, gate_up, gated),
            _bound_linear(mlp.down_proj, gated, self.projected),
        ]

    def run(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        cache: PagedCache,
    ) -> torch.Tensor:
        """One decode step: the new tokens' final hidden states ``[batch, 1, hidden]``."""
        batch = self.batch
        self.hidden.copy_(self.embed_tokens.forward(input_ids).view(batch, -1))
        if position_ids is None:  # as transformers: the positions the cache has seen
            self.positions.fill_(cache.get_seq_length())
        else:
            self.positions.copy_(position_ids.reshape(-1).expand(batch))
        cache.start_forward(batch, 1, attention_mask)
        q, k, v, out = self.rows
        append, attend = cache.bound_decode_calls(k, v, q, out)
        for index, (before, after) in enumerate(zip(self.before_attention, self.after_attention)):
            for call in before:
                call()
            append(index)
            attend[index](index)
            for call in after:
                call()
        return self.norm.forward(self.hidden.view(batch, 1, -1))  # a tensor of its own: the caller keeps it


def _bound_norm(norm: Any, x: torch.Tensor, out: torch.Tensor) -> Call:
    return kf.bound_rmsnorm(x, norm.weight, norm.eps, out)


def _bound_linear(linear: Any, x: torch.Tensor, out: torch.Tensor) -> Call:
    """``out = linear(x)``: the layer's bound form (kernforge's Linear and GGUFLinear have one), else its
    forward (a tensor-parallel wrapper...) with the result copied into ``out``."""
    if isinstance(linear, (Linear, GGUFLinear)):
        return linear.bound(x, out)
    forward = linear.forward
    return lambda: out.copy_(forward(x))
