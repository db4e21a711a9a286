"""kernforge's MoE kernels under vLLM's CPU fused-MoE layer (``FusedMoE`` with unquantized weights).

* Experts: vLLM's unquantized MoE oracle picks the first class of its CPU list
  (``vllm.model_executor.layers.fused_moe.oracle.unquantized.backend_to_kernel_cls(CPU)``:
  ``X86CPUUnquantizedExperts`` (AMX), ..., ``CPUUnquantizedExperts``) whose ``is_supported_config``
  accepts the layer. vLLM has no registry for that list, so :func:`register_experts` wraps the
  function (checked against the signature and the CPU list it was written for) to put
  :class:`KernforgeCPUUnquantizedExperts` first. That class is a subclass of vLLM's
  ``CPUUnquantizedExperts``, so the modular-kernel plumbing (prepare/finalize, output buffer,
  ``apply_router_weight_on_input`` on the input) stays vLLM's: it packs the layer's ``w13``/``w2``
  once with ``pack_experts`` after loading and runs ``kernforge.fused_experts(..., out=output)``.
  It takes bf16 layers with SiLU-gated experts and no biases, SwiGLU limits or expert parallelism;
  every other layer falls through to vLLM's classes. Per layer shape, the plugin's self-check
  (:mod:`kernforge.integrations.vllm.selfcheck`) times it against the CPU experts vLLM's oracle
  would have picked (``cpu_fused_moe`` on weights prepacked by ``cpu_prepack_moe_weight`` for the
  class's ISA, or zentorch's kernel); where vLLM's win, the layer holds an instance of that class
  and hands it its weights and every ``apply``.
* Routing: vLLM's ``CPURouter`` (``router/cpu_router.py``) computes top-k with module functions
  it looks up at call time. :func:`patch_routing` replaces ``_softmax_topk`` (softmax top-k, with
  or without renormalization: Qwen-MoE, Mixtral, OLMoE) and ``_grouped_topk`` (DeepSeek's grouped
  rules: softmax without a bias, ``grouped_topk``; sigmoid with a correction bias,
  ``biased_grouped_topk``) by wrappers that call kernforge's routing ops and hand every other case
  (another scoring function, k over 16, groups kernforge does not take) to vLLM's function.

On the CPU vLLM calls the MoE layer directly rather than through its ``moe_forward`` custom op,
so under torch.compile Dynamo traces into the router and the experts: both call
``kernforge.torch_library``'s ops (one graph node each).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
from vllm.model_executor.layers.fused_moe.oracle import unquantized as unquantized_oracle
from vllm.model_executor.layers.fused_moe.router import cpu_router
from vllm.model_executor.utils import replace_parameter
from vllm.platforms import CpuArchEnum, current_platform

from kernforge import torch_library as ops
from kernforge.integrations.vllm import selfcheck
from kernforge.ops.moe.experts import PackedExperts, pack_experts
from kernforge.ops.moe.routing import MAX_TOPK

# vLLM 0.32's functions, as this module replaces or wraps them
BACKEND_TO_KERNEL_CLS_PARAMETERS = ["backend"]
SOFTMAX_TOPK_PARAMETERS = ["router_logits", "top_k", "renormalize"]
GROUPED_TOPK_PARAMETERS = [
    "gating_output",
    "topk",
    "renormalize",
    "num_expert_group",
    "topk_group",
    "scoring_func",
    "routed_scaling_factor",
    "e_score_correction_bias",
]
ROUTING_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MOE_CHECK_TOKENS = (1, 64)  # the self-check's cases: a decode step's token, a prefill chunk's tokens


class KernforgeCPUUnquantizedExperts(CPUUnquantizedExperts):
    """vLLM's unquantized CPU MoE experts on kernforge's ``fused_experts``: the layer's bf16
    ``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]`` packed once, SiLU gating,
    the k experts' weighted sum in the down projection (vLLM's finalize then has nothing to
    reduce, as for its own CPU experts). Where the self-check found vLLM's CPU experts faster on
    the layer's shape, ``vllm_experts`` holds them and the layer runs theirs instead."""

    vllm_experts: CPUUnquantizedExperts | None = None  # vLLM's experts, where they won the self-check

    @staticmethod
    def _supports_current_device() -> bool:
        return current_platform.is_cpu() and current_platform.get_cpu_architecture() == CpuArchEnum.X86

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation == MoEActivation.SILU

    @staticmethod
    def _supports_parallel_config(moe_parallel_config) -> bool:
        return not moe_parallel_config.use_ep  # an expert map (global ids to local ones) is not taken

    @staticmethod
    def is_supported_config(
        cls: type[mk.FusedMoEExperts],
        moe_config,
        weight_key,
        activation_key,
        activation_format: mk.FusedMoEActivationFormat,
    ) -> tuple[bool, str | None]:
        supported, reason = mk.FusedMoEExperts.is_supported_config(
            cls, moe_config, weight_key, activation_key, activation_format
        )
        if not supported:
            return supported, reason
        unsupported = unsupported_reason(moe_config)
        return unsupported is None, unsupported and f"kernel does not support {unsupported}"

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        w13, w2 = layer.w13_weight.detach(), layer.w2_weight.detach()
        experts, gate_up, hidden = w13.shape
        self.kernforge_sizes = (int(experts), int(gate_up) // 2, int(hidden))  # E, I, H
        # packed only where kernforge's experts are measured or run: a recorded verdict for vLLM's needs none
        pack = functools.cache(lambda: (pack_experts(w13.contiguous(), gated=True), pack_experts(w2.contiguous())))
        self.vllm_experts = self._vllm_experts_if_faster(layer, pack)
        if self.vllm_experts is not None:
            pack.cache_clear()  # before vLLM prepacks its own copy: experts can take GBs
            self.vllm_experts.process_weights_after_loading(layer)
            return
        packed = pack()
        # the packed copies are the layer's weights from now on (vLLM hands them to apply())
        replace_parameter(layer, "w13_weight", packed[0].packed)
        replace_parameter(layer, "w2_weight", packed[1].packed)

    def _vllm_experts_if_faster(
        self, layer: torch.nn.Module, pack: Callable[[], tuple[PackedExperts, PackedExperts]]
    ) -> CPUUnquantizedExperts | None:
        """vLLM's own experts for this layer where the self-check found them faster on its shape."""
        vllm_class = vllm_experts_class(self.moe_config)
        if vllm_class is None:
            return None  # no CPU experts of vLLM's take the layer: nothing to compare with
        vllm_experts = vllm_class(self.moe_config, self.quant_config)
        experts, inter, hidden = self.kernforge_sizes
        shapes = f"bf16 E={experts} H={hidden} I={inter} k={self.moe_config.experts_per_token}"

        def cases() -> dict:
            return _moe_cases(self, vllm_experts, layer, *pack())

        return None if selfcheck.kernforge_is_faster("moe", shapes, cases) else vllm_experts

    def moe_problem_size(
        self, a1: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor
    ) -> tuple[int, int, int, int, int]:
        if self.vllm_experts is not None:
            return self.vllm_experts.moe_problem_size(a1, w1, w2, topk_ids)
        # the packed weights are not [E, N, K]: N comes from the sizes recorded when packing
        experts, inter, _ = self.kernforge_sizes
        return experts, a1.size(0), 2 * inter, a1.size(-1), topk_ids.size(1)

    def apply(
        self,
        output: torch.Tensor,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: MoEActivation,
        global_num_experts: int,
        expert_map: torch.Tensor | None,
        a1q_scale: torch.Tensor | None,
        a2_scale: torch.Tensor | None,
        workspace13: torch.Tensor,
        workspace2: torch.Tensor,
        expert_tokens_meta: mk.ExpertTokensMetadata | None,
        apply_router_weight_on_input: bool,
    ) -> None:
        if self.vllm_experts is not None:
            self.vllm_experts.apply(
                output,
                hidden_states,
                w1,
                w2,
                topk_weights,
                topk_ids,
                activation,
                global_num_experts,
                expert_map,
                a1q_scale,
                a2_scale,
                workspace13,
                workspace2,
                expert_tokens_meta,
                apply_router_weight_on_input,
            )
            return
        if apply_router_weight_on_input:
            # vLLM's prepare() scaled hidden_states by the (single, k = 1) router weight already
            topk_weights = torch.ones_like(topk_weights)
        experts, inter, hidden = self.kernforge_sizes
        packed_w1 = PackedExperts(w1, experts, 2 * inter, hidden, parts=2)
        packed_w2 = PackedExperts(w2, experts, hidden, inter)
        ops.fused_experts(hidden_states, packed_w1, packed_w2, topk_weights, topk_ids, out=output)


def vllm_experts_class(moe_config) -> type[CPUUnquantizedExperts] | None:
    """The CPU experts vLLM's oracle picks for a layer when kernforge's are not in its list (the
    first that takes it, as ``select_unquantized_moe_backend``); None when none does."""
    standard = mk.FusedMoEActivationFormat.Standard
    for cls in unquantized_oracle.backend_to_kernel_cls(unquantized_oracle.UnquantizedMoeBackend.CPU):
        if cls is KernforgeCPUUnquantizedExperts:
            continue
        if cls.is_supported_config(cls, moe_config, None, None, standard)[0]:
            return cls
    return None


def _moe_cases(
    kernforge_experts: KernforgeCPUUnquantizedExperts,
    vllm_experts: CPUUnquantizedExperts,
    layer: torch.nn.Module,
    packed_w13: PackedExperts,
    packed_w2: PackedExperts,
) -> dict:
    """The MoE self-check: both experts' ``apply`` on the layer's weights at random routing,
    kernforge's on its packed copies, vLLM's on copies it pads and prepacks on a stand-in layer
    (the real one is left as it is; the copies go with the cases, once measured)."""
    stand_in = torch.nn.Module()
    stand_in.w13_weight = torch.nn.Parameter(layer.w13_weight.detach(), requires_grad=False)
    stand_in.w2_weight = torch.nn.Parameter(layer.w2_weight.detach(), requires_grad=False)
    for name in ("moe_config", "activation"):  # what vLLM reads to run zentorch's kernel instead
        setattr(stand_in, name, getattr(layer, name, None))
    vllm_experts.process_weights_after_loading(stand_in)
    experts, _, hidden = kernforge_experts.kernforge_sizes
    topk = kernforge_experts.moe_config.experts_per_token
    cases = {}
    for tokens in MOE_CHECK_TOKENS:
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
        weights, ids = torch.randn(tokens, experts).softmax(-1).topk(topk)
        routing = (x, weights, ids.to(torch.int32))
        cases[f"M={tokens}"] = (
            _applying(kernforge_experts, packed_w13.packed, packed_w2.packed, *routing),
            _applying(vllm_experts, stand_in.w13_weight, stand_in.w2_weight, *routing),
        )
    return cases


def _applying(experts, w13, w2, x, topk_weights, topk_ids) -> functools.partial:
    """``experts.apply`` as vLLM's modular kernel calls it on an unquantized layer without expert
    parallelism (no expert map, no scales, the router weights on the output), into a new output."""
    nothing = torch.empty(0, dtype=x.dtype)  # the CPU experts' workspaces: they take no scratch
    return functools.partial(
        experts.apply,
        output=torch.empty_like(x),
        hidden_states=x,
        w1=w13,
        w2=w2,
        topk_weights=topk_weights,
        topk_ids=topk_ids,
        activation=MoEActivation.SILU,
        global_num_experts=experts.moe_config.num_experts,
        expert_map=None,
        a1q_scale=None,
        a2_scale=None,
        workspace13=nothing,
        workspace2=nothing,
        expert_tokens_meta=None,
        apply_router_weight_on_input=False,
    )


def unsupported_reason(moe_config) -> str | None:
    """What of a layer's config kernforge's experts do not take (None: it takes the layer)."""
    if moe_config.in_dtype != torch.bfloat16:
        return f"{moe_config.in_dtype} activations (kernforge packs bf16 experts)"
    if moe_config.has_bias:
        return "expert biases"
    clamps = ("swiglu_limit", "swiglu_alpha", "swiglu_beta", "activation_situ_beta", "activation_situ_linear_beta")
    if any(getattr(moe_config, name, None) is not None for name in clamps):
        return "SwiGLU limits or SiTU parameters"
    return None


# --------------------------------------------------------------------------- the oracle's CPU list


def register_experts() -> bool:
    """Put :class:`KernforgeCPUUnquantizedExperts` first in vLLM's unquantized CPU MoE experts;
    False (nothing changed) when vLLM's oracle is not the one this was written for."""
    original = getattr(unquantized_oracle, "backend_to_kernel_cls", None)
    cpu = getattr(getattr(unquantized_oracle, "UnquantizedMoeBackend", None), "CPU", None)
    if original is None or cpu is None:
        return False
    if getattr(original, "kernforge_original", None) is not None:
        return True  # already wrapped in this process
    if list(inspect.signature(original).parameters) != BACKEND_TO_KERNEL_CLS_PARAMETERS:
        return False
    if CPUUnquantizedExperts not in original(cpu):
        return False
    unquantized_oracle.backend_to_kernel_cls = _kernforge_first(original, cpu)
    return True


def _kernforge_first(original, cpu):
    @functools.wraps(original)
    def backend_to_kernel_cls(backend):
        classes = original(backend)
        return [KernforgeCPUUnquantizedExperts, *classes] if backend == cpu else classes

    backend_to_kernel_cls.kernforge_original = original
    return backend_to_kernel_cls


# --------------------------------------------------------------------------- routing


def patch_routing() -> list[str]:
    """Replace the CPU router's top-k functions whose signatures are the ones this was written for;
    the names of the rules now on kernforge (none: vLLM changed both)."""
    replaced = []
    for name, parameters, wrap, rules in (
        ("_softmax_topk", SOFTMAX_TOPK_PARAMETERS, _kernforge_softmax_topk, "softmax top-k"),
        ("_grouped_topk", GROUPED_TOPK_PARAMETERS, _kernforge_grouped_topk, "grouped top-k"),
    ):
        original = getattr(cpu_router, name, None)
        if original is None:
            continue
        if getattr(original, "kernforge_original", None) is None:
            if list(inspect.signature(original).parameters) != parameters:
                continue
            patched = wrap(original)
            patched.kernforge_original = original
            setattr(cpu_router, name, patched)
        replaced.append(rules)
    return replaced


def _routable(logits: torch.Tensor) -> bool:
    return logits.dim() == 2 and logits.dtype in ROUTING_DTYPES


def _kernforge_softmax_topk(original):
    @functools.wraps(original)
    def _softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool):
        if not (_routable(router_logits) and 1 <= top_k <= min(MAX_TOPK, router_logits.shape[-1])):
            return original(router_logits, top_k, renormalize)
        return ops.topk_softmax(router_logits, router_logits, top_k, bool(renormalize), ties="torch")

    return _softmax_topk


def _kernforge_grouped_topk(original):
    @functools.wraps(original)
    def _grouped_topk(
        gating_output: torch.Tensor,
        topk: int,
        renormalize: bool,
        num_expert_group: int,
        topk_group: int,
        scoring_func: str,
        routed_scaling_factor: float,
        e_score_correction_bias: torch.Tensor | None,
    ):
        biased = e_score_correction_bias is not None
        experts = gating_output.shape[-1]
        groups = num_expert_group
        takes = (
            _routable(gating_output)
            and scoring_func == ("sigmoid" if biased else "softmax")  # kernforge's two grouped rules
            and 1 <= groups <= experts
            and experts % groups == 0
            and 1 <= topk_group <= groups
            and 1 <= topk <= min(MAX_TOPK, topk_group * (experts // groups))
            and (not biased or experts // groups >= 2)  # a biased group is scored by its two best
            and 0 < routed_scaling_factor < float("inf")  # kernforge's range for it
        )
        if not takes:
            return original(
                gating_output,
                topk,
                renormalize,
                num_expert_group,
                topk_group,
                scoring_func,
                routed_scaling_factor,
                e_score_correction_bias,
            )
        # vLLM's CPU rule scales the weights by routed_scaling_factor, renormalized or not, as kernforge's
        # does; equal values in torch.topk's order, as vLLM picks them
        rule = dict(renormalize=bool(renormalize), num_expert_group=groups, topk_group=topk_group)
        rule.update(routed_scaling_factor=float(routed_scaling_factor), ties="torch")
        if biased:
            return ops.biased_grouped_topk(gating_output, gating_output, e_score_correction_bias, topk, **rule)
        return ops.grouped_topk(gating_output, gating_output, topk, **rule)

    return _grouped_topk
