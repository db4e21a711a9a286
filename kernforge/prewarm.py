"""Build variants ahead of time, in parallel, from a manifest.

A manifest is JSON::

    {
      "isa": "avx512",                       # optional: default is the tier in use
      "kernels": [
        {"op": "rmsnorm", "dtype": ["bfloat16", "float16"]},
        {"op": "silu_and_mul", "dtype": "bfloat16"},
        {"module": "norm", "params": {"dtype": "bf16", "fused_add": true, "gemma": false}},
        {"module": "my_package.kernels:RELU2", "params": {"dtype": "bf16"}}
      ]
    }

A ``module`` is a registered module's name or ``package.module:ATTRIBUTE`` (a
user's :class:`~kernforge.jit.module.Module`, imported to register it); its
params are checked against the declaration (``python -m kernforge modules``
prints every schema).

``manifest_from_model_config`` derives one from a Hugging Face ``config.json``,
``kernforge.integrations.transformers.gguf_manifest`` from a GGUF file (its GEMMs at the file's
tensor types; ``prewarm --gguf``).
The norm and activation kernels take the hidden size at run time (they are
memory-bound, and a per-size build would only multiply compiles), so the
model's sizes are recorded in the manifest's ``model`` section but select
nothing. Its linear layers' weight shapes (``linear_shapes``: the fused q|k|v,
o, the fused gate|up, down and lm_head, as kernforge's transformers integration
runs them) select the GEMM variants dispatch picks for them at every row bucket
(the tuned configuration where one is recorded, else the default), and are what
``tune_model_linears`` (``prewarm --model-config ... --tune``) hands to the GEMM
tuner. With ``quant="int8"`` the w8a8 GEMM is built too, with ``quant="fp8_block"`` the fp8
block-scaled one, with ``quant="int4"`` / ``"int4_w4a16"`` the four-bit one (and a MoE model's experts
in the same kind).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from kernforge.jit import core, isa
from kernforge.jit.module import DeclarationError, Module, registered
from kernforge.model_spec import ModelSpec
from kernforge.ops import OPS
from kernforge.ops._common import TORCH_DTYPES, dtype_name
from kernforge.ops._registry import MODEL_KERNELS

ALL_DTYPES = ("bf16", "fp16", "fp32")


# What a model's linears (and MoE experts) may be quantized to: None (bf16), int8 w8a8, fp8 block-scaled,
# four-bit weights with int8 (W4A8) or bf16 (W4A16) activations.
QUANTS = (None, "int8", "fp8_block", "int4", "int4_w4a16")
# What the manifest's model section adds for a multi-head latent attention model.
MLA_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def manifest_from_model_config(
    config: dict | str | Path, kv_cache_dtypes: tuple[str, ...] = (), quant: str | None = None
) -> dict:
    """Ops a decoder model needs, from its ``config.json`` (path or dict). Attention is built for
    a KV cache in the model's dtype and in each of ``kv_cache_dtypes`` (such as
    ``"float8_e4m3fn"``); the linear layers' GEMMs for the model's dtype, and with ``quant="int8"``
    the w8a8 GEMM as well."""
    return manifest_from_spec(ModelSpec.from_config(config), kv_cache_dtypes, quant)


def manifest_from_spec(spec: ModelSpec, kv_cache_dtypes: tuple[str, ...] = (), quant: str | None = None) -> dict:
    """:func:`manifest_from_model_config` of a :class:`~kernforge.model_spec.ModelSpec` already read
    (an optimized transformers model's is ``model._kernforge.model_spec``, the one it runs by)."""
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
    model = {
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "dtype": spec.dtype,
        "activation": spec.activation,
        "model_type": spec.model_type,
        "linear_shapes": spec.linear_shapes(),
    }
    if spec.is_mla:
        model.update({name: getattr(spec, name) for name in MLA_FIELDS})
    return {
        "model": model,
        # each family says what a model runs of it, next to its ops (ops._registry.model_kernels)
        "kernels": [entry for hook in MODEL_KERNELS for entry in hook(spec, tuple(kv_cache_dtypes), quant)],
    }


TUNE_ROWS = (1, 16, 128, 1024)  # decode, small and large batches, prefill


def tune_model_attention(config: dict | str | Path, measure=None) -> list[dict]:
    """Run :func:`kernforge.tune_prefill` for the model's head_dim and GQA group, in its dtype (an MLA
    model's: the latent attention's 576 / 512 with every head on one KV head, and the prompt path's
    qk_nope + rope / v with one head per KV head)."""
    from kernforge.tune import tune_prefill

    spec = ModelSpec.from_config(config)
    dtype = TORCH_DTYPES[dtype_name(spec.dtype)]
    if spec.is_mla:  # the absorbed latent attention (one KV head for all), then the unabsorbed prompt path
        absorbed = (spec.kv_lora_rank + spec.qk_rope_head_dim, spec.kv_lora_rank)
        return tune_prefill([absorbed], [spec.num_attention_heads], dtype, measure=measure) + tune_prefill(
            [(spec.qk_nope_head_dim + spec.qk_rope_head_dim, spec.v_head_dim)], [1], dtype, measure=measure
        )
    return tune_prefill([(spec.head_dim, spec.head_dim)], [spec.group], dtype, measure=measure)


def tune_model_linears(config: dict | str | Path, m_list=TUNE_ROWS, measure=None) -> list[dict]:
    """Run :func:`kernforge.tune_gemm` for each distinct linear shape of the model (``config.json``,
    path or dict) at each M of ``m_list``, x in the model's dtype, on the tier in use: the winners
    are recorded where ``weight_packed_linear``'s dispatch finds them. ``measure`` as tune_gemm's."""
    from kernforge.tune import tune_gemm

    model = manifest_from_model_config(config)["model"]
    shapes = list(dict.fromkeys(tuple(nk) for nk in model["linear_shapes"].values()))  # distinct, in order
    return tune_gemm(m_list, shapes, TORCH_DTYPES[dtype_name(model["dtype"])], measure=measure)


def specs_from_manifest(manifest: dict | str | Path, tier: str | None = None) -> list[core.KernelSpec]:
    """Every KernelSpec a manifest asks for (duplicates removed, order kept)."""
    if not isinstance(manifest, dict):
        manifest = json.loads(Path(manifest).read_text())
    tier = (tier or manifest.get("isa") or isa.selected_tier()).lower()
    specs: dict[core.KernelSpec, None] = {}
    for item in manifest.get("kernels", []):
        if "op" in item:
            dtypes = item.get("dtype", ALL_DTYPES)
            for dtype in [dtypes] if isinstance(dtypes, str) else dtypes:
                specs[op_kernels(item["op"]).variant(TORCH_DTYPES[dtype_name(dtype)]).spec(tier)] = None
        elif "module" in item:
            module = find_module(item["module"])
            params = {k: tuple(v) if isinstance(v, list) else v for k, v in item.get("params", {}).items()}
            specs[module.variant(**params).spec(tier)] = None
        else:
            raise ValueError(f"manifest entry {item!r} needs an 'op' or a 'module'")
    return list(specs)


def op_kernels(op: str):
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; known ops: {', '.join(OPS)}")
    return OPS[op]


def find_module(name: str) -> Module:
    """A registered module by name, or ``package.module:ATTRIBUTE`` (imported)."""
    if ":" not in name:
        return registered(name)
    path, _, attribute = name.partition(":")
    try:
        imported = importlib.import_module(path)
    except ImportError as exc:  # a ValueError, so the CLI reports it as an error line
        raise DeclarationError(f"cannot import {path!r} (for module {name!r}): {exc}") from None
    module = getattr(imported, attribute, None)
    if not isinstance(module, Module):
        raise DeclarationError(f"{name} is not a kernforge Module")
    return module


def all_ops_manifest(dtypes=ALL_DTYPES) -> dict:
    def taken(op):  # the requested dtypes this op takes (sampling from probs takes fp32 only)
        return [d for d in dtypes if TORCH_DTYPES[dtype_name(d)] in OPS[op].dtypes]

    return {"kernels": [{"op": op, "dtype": taken(op)} for op in OPS if taken(op)]}


def prewarm(
    manifest: dict | str | Path | list[core.KernelSpec] | None = None,
    *,
    isa_tier: str | None = None,
    jobs: int | None = None,
    progress: bool = True,
) -> list[core.BuildResult]:
    """Build every variant of ``manifest`` (default: all ops, all dtypes) in parallel.

    Variants for a tier this CPU cannot run are compiled but not loaded
    (building a cache for other machines). Returns one BuildResult each.
    """
    if isinstance(manifest, list):
        specs = manifest
    else:
        specs = specs_from_manifest(manifest if manifest is not None else all_ops_manifest(), isa_tier)
    jobs = max(1, jobs or os.cpu_count() or 1)
    bar = _Progress(len(specs), enabled=progress)
    results: list[core.BuildResult] = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        # Pre-warm is the way to fill the cache, so it compiles even under KERNFORGE_JIT=0.
        futures = [pool.submit(lambda spec: core.build(spec, load=None, allow_compile=True)[0], spec) for spec in specs]
        for future in as_completed(futures):
            result = future.result()
            results.append(result)
            bar.advance(result)
    bar.finish()
    return sorted(results, key=lambda r: r.key)


class _Progress:
    """A one-line progress bar on a terminal, a summary line otherwise."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.compiled = total, 0, 0
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self._lock = threading.Lock()

    def advance(self, result: core.BuildResult) -> None:
        with self._lock:
            self.done += 1
            self.compiled += result.compiled
            if self.enabled:
                filled = int(30 * self.done / max(self.total, 1))
                line = f"[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} {result.spec.prefix()}"
                sys.stderr.write(("\r\033[K" if self.tty else "") + line + ("" if self.tty else "\n"))
                sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled:
            sys.stderr.write(
                ("\n" if self.tty else "") + f"kernforge: prewarm done: {self.compiled} compiled, "
                f"{self.done - self.compiled} already cached\n"
            )
