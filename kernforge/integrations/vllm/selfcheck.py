"""Which of the plugin's parts run faster than vLLM's own kernels on this CPU: measured here, once.

A part that is faster on one CPU can be slower on another (the GEMM on AMX, where vLLM's oneDNN
wins; attention on a Xeon without AMX, issue 37), so with ``KERNFORGE_VLLM`` unset each part is
checked where it meets the served model's shapes, against the kernel vLLM would run instead:

* ``linear``: each bf16 weight shape, ``weight_packed_linear`` against vLLM's own dispatch
  (oneDNN, or sgl-kernel's packed GEMM for small weights) at one row and at a prefill chunk;
* ``attention``: a scheduler step of a KV-cache group (vLLM's metadata turned into a plan, then the
  group's layers each writing their K/V and attending), decodes of a short and a long context and a
  prefill chunk, against vLLM's ``CPU_ATTN`` metadata builder and kernels on its own cache;
* ``moe``: each unquantized MoE layer shape (experts, hidden and intermediate sizes, top-k), the
  experts' ``fused_experts`` on kernforge's packed weights against the CPU experts vLLM's oracle
  picks (``cpu_fused_moe`` on its prepacked weights) at random routing, for one token and for 64;
* ``int4``: each 4-bit linear layer's mode, dtype, weight type and shape, ``int4_scaled_mm_cpu`` (or
  ``int4_w4a16_linear``) against the mixed-precision kernel vLLM would pick (``CPUWNA16LinearKernel``:
  ``cpu_gemm_wna16``, or sgl-kernel's W4A8 on AMX) at one row and at a prefill chunk.

Each case runs both sides alternately after a warm-up (which compiles kernforge's kernel) and
keeps the medians; the part goes to kernforge where the geometric mean of vLLM's time over
kernforge's across the cases is at least 1. The verdict is kept in kernforge's cache beside the
tuner's records (``<cache>/tuning/vllm-<part>.json``, keyed by the shapes, the tier and the CPU
model, stamped with kernforge's version; vLLM's version is part of the shapes' key), so a machine
measures each shape once and every later engine start reads it; each verdict is logged once per
process with the times it rests on. ``KERNFORGE_VLLM`` set to ``1``, ``0`` or a list of parts
overrides the check. ``layers`` (RMSNorm, SiluAndMul, RoPE: a few percent of a step, 1.02x stock
alone on an AMX-less Xeon) and ``mla`` have no check yet: they stay on.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping

from kernforge.jit import isa
from kernforge.jit.tuning import TuningStore

Case = tuple[Callable[[], object], Callable[[], object]]  # (kernforge's call, vLLM's call)
ROUNDS = 7  # alternating pairs timed per case, after a warm-up of each side
MIN_SECONDS = 0.05  # per case and side: short calls are repeated to at least this, then medians

_verdicts: dict[tuple[str, str], bool] = {}  # (part, shapes) -> kernforge's turn, this process


def kernforge_is_faster(part: str, shapes: str, cases: Callable[[], Mapping[str, Case]]) -> bool:
    """Whether ``part`` should run kernforge's kernels on ``shapes`` (a key naming the problem):
    the recorded verdict for this machine, else measured now on ``cases()`` and recorded."""
    from kernforge.integrations import vllm as plugin

    forced = plugin.forced_parts()
    if forced is not None:
        return part in forced
    key = (part, shapes)
    if key not in _verdicts:
        _verdicts[key] = _recorded_or_measured(part, shapes, cases)
    return _verdicts[key]


def _recorded_or_measured(part: str, shapes: str, cases: Callable[[], Mapping[str, Case]]) -> bool:
    import vllm

    store, tier = TuningStore(), isa.selected_tier()
    kernel, bucket = f"vllm-{part}", f"{shapes}|vllm {vllm.__version__}"
    recorded = store.lookup(kernel, bucket, tier)
    if recorded is not None and isinstance(recorded.get("kernforge"), bool):
        _log(part, shapes, recorded["kernforge"], recorded.get("speedup"), "recorded")
        return recorded["kernforge"]
    seconds = {name: time_pair(*pair) for name, pair in cases().items()}
    speedup = math.exp(statistics.fmean(math.log(v / k) for k, v in seconds.values()))
    verdict = speedup >= 1.0
    store.record(kernel, bucket, tier, {"kernforge": verdict, "speedup": speedup}, seconds)
    _log(part, shapes, verdict, speedup, "measured " + _seconds_text(seconds))
    return verdict


def time_pair(kernforge_call: Callable[[], object], vllm_call: Callable[[], object]) -> tuple[float, float]:
    """Median seconds of one call of each side, timed alternately (this memory's rate moves over
    seconds); each side warmed up first, calls repeated to ``MIN_SECONDS`` per side."""
    kernforge_call()
    vllm_call()
    repeats = max(1, math.ceil(MIN_SECONDS / ROUNDS / max(_once(kernforge_call), _once(vllm_call), 1e-7)))
    samples: tuple[list[float], list[float]] = ([], [])
    for _ in range(ROUNDS):
        for side, call in enumerate((kernforge_call, vllm_call)):
            samples[side].append(_once(call, repeats))
    return statistics.median(samples[0]), statistics.median(samples[1])


def _once(call: Callable[[], object], repeats: int = 1) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - started) / repeats


def _seconds_text(seconds: Mapping[str, tuple[float, float]]) -> str:
    return "; ".join(f"{name}: kernforge {k * 1e3:.3f} ms, vLLM {v * 1e3:.3f} ms" for name, (k, v) in seconds.items())


def _log(part: str, shapes: str, verdict: bool, speedup: float | None, how: str) -> None:
    from vllm.logger import init_logger

    ratio = "" if speedup is None else f" at {speedup:.2f}x vLLM's speed"
    init_logger(__name__).info(
        "kernforge %s (%s): %s%s (%s)",
        part,
        shapes,
        "kernforge's kernels" if verdict else "vLLM's kernels, faster on this CPU",
        ratio,
        how,
    )
