"""Build variants ahead of time, in parallel, from a manifest.

A manifest is JSON::

    {
      "isa": "avx512",                       # optional: default is the tier in use
      "kernels": [
        {"op": "rmsnorm", "dtype": ["bfloat16", "float16"]},
        {"op": "silu_and_mul", "dtype": "bfloat16"},
        {"template": "my_op.cpp.jinja", "params": {"dtype": "bf16"}}
      ]
    }

``manifest_from_model_config`` derives one from a Hugging Face ``config.json``.
The norm and activation kernels take the hidden size at run time (they are
memory-bound, and a per-size build would only multiply compiles), so the
model's sizes are recorded in the manifest's ``model`` section but select
nothing.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from kernforge.jit import core, isa

ALL_DTYPES = ("bf16", "fp16", "fp32")

_GATED_BY_HF_ACTIVATION = {
    "silu": "silu_and_mul",
    "swish": "silu_and_mul",
    "gelu": "gelu_and_mul",
    "gelu_pytorch_tanh": "gelu_tanh_and_mul",
    "gelu_new": "gelu_tanh_and_mul",
    "gelu_fast": "gelu_tanh_and_mul",
    "gelu_tanh": "gelu_tanh_and_mul",
}


def manifest_from_model_config(config: dict | str | Path) -> dict:
    """Ops a decoder model needs, from its ``config.json`` (path or dict)."""
    if not isinstance(config, dict):
        config = json.loads(Path(config).read_text())
    config = {**config.get("text_config", {}), **config}  # multimodal configs nest the LM
    dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    activation = config.get("hidden_act") or config.get("hidden_activation") or "silu"
    if activation not in _GATED_BY_HF_ACTIVATION:
        raise ValueError(f"config.json activation {activation!r} has no kernforge gated op; "
                         f"known: {', '.join(_GATED_BY_HF_ACTIVATION)}")
    sizes = {}
    for name in ("hidden_size", "intermediate_size"):
        value = config.get(name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"config.json needs a positive integer {name}, got {value!r}")
        sizes[name] = value
    gemma = "gemma" in str(config.get("model_type", "")).lower()
    norms = ["gemma_rmsnorm", "gemma_fused_add_rmsnorm"] if gemma else ["rmsnorm", "fused_add_rmsnorm"]
    return {
        "model": {**sizes, "dtype": dtype, "activation": activation, "model_type": config.get("model_type")},
        "kernels": [
            *({"op": op, "dtype": dtype} for op in [*norms, _GATED_BY_HF_ACTIVATION[activation]]),
            {"op": "top_k_top_p_sampling_from_probs", "dtype": "fp32"},  # the sampler, on fp32 probs
        ],
    }


def specs_from_manifest(manifest: dict | str | Path, tier: str | None = None) -> list[core.KernelSpec]:
    """Every KernelSpec a manifest asks for (duplicates removed, order kept)."""
    from kernforge.ops import variant_for

    if not isinstance(manifest, dict):
        manifest = json.loads(Path(manifest).read_text())
    tier = (tier or manifest.get("isa") or isa.selected_tier()).lower()
    specs: dict[core.KernelSpec, None] = {}
    for item in manifest.get("kernels", []):
        if "op" in item:
            dtypes = item.get("dtype", ALL_DTYPES)
            for dtype in [dtypes] if isinstance(dtypes, str) else dtypes:
                specs[variant_for(item["op"], dtype).spec(tier)] = None
        elif "template" in item:
            tiers = item.get("tiers")
            variant = core.Variant(item["template"], item.get("params", {}), tuple(tiers or isa.TIER_ORDER))
            specs[variant.spec(tier)] = None
        else:
            raise ValueError(f"manifest entry {item!r} needs an 'op' or a 'template'")
    return list(specs)


def all_ops_manifest(dtypes=ALL_DTYPES) -> dict:
    from kernforge.ops import OP_VARIANTS
    from kernforge.ops._common import dtype_name

    def taken(op):  # the requested dtypes this op takes (sampling from probs takes fp32 only)
        return [d for d in dtypes if any(dtype_name(t) == dtype_name(d) for t in OP_VARIANTS[op])]

    return {"kernels": [{"op": op, "dtype": taken(op)} for op in OP_VARIANTS if taken(op)]}


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
            sys.stderr.write(("\n" if self.tty else "") +
                             f"kernforge: prewarm done: {self.compiled} compiled, "
                             f"{self.done - self.compiled} already cached\n")
