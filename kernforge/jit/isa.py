"""CPU feature detection and ISA tiers.

Features come from CPUID plus XGETBV (what the OS has enabled), read by a tiny
compiled probe (``templates/cpu_probe.cpp.jinja``) that goes through the same
JIT cache as every kernel, so it is compiled once per machine and only called
(a few microseconds) per process. AMX counts only once the kernel has granted
this process the tile state via ``arch_prctl(ARCH_REQ_XCOMP_PERM)``.

Tiers, best first: amx > avx512 > avx2 > generic. ``KERNFORGE_ISA`` (read at
first use) or :func:`use_isa` / :func:`set_isa` force a lower one.
"""

from __future__ import annotations

import contextlib
import os
import platform
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

# name -> (register index in the probe's output, bit, XCR0 state the OS must enable)
_XCR0_AVX = 0b110  # SSE and AVX (YMM) state
_XCR0_AVX512 = 0b1110_0110  # plus opmask, ZMM_Hi256, Hi16_ZMM
_XCR0_AMX = (1 << 17) | (1 << 18)  # XTILECFG, XTILEDATA
_CPUID_1_ECX, _CPUID_7_EBX, _CPUID_7_ECX, _CPUID_7_EDX, _CPUID_71_EAX = 1, 2, 3, 4, 5
_XCR0, _AMX_GRANTED = 6, 7

_FEATURE_BITS = {
    "fma": (_CPUID_1_ECX, 12, _XCR0_AVX),
    "f16c": (_CPUID_1_ECX, 29, _XCR0_AVX),
    "avx2": (_CPUID_7_EBX, 5, _XCR0_AVX),
    "avx512f": (_CPUID_7_EBX, 16, _XCR0_AVX512),
    "avx512dq": (_CPUID_7_EBX, 17, _XCR0_AVX512),
    "avx512bw": (_CPUID_7_EBX, 30, _XCR0_AVX512),
    "avx512vl": (_CPUID_7_EBX, 31, _XCR0_AVX512),
    "avx512vbmi": (_CPUID_7_ECX, 1, _XCR0_AVX512),
    "avx512_vnni": (_CPUID_7_ECX, 11, _XCR0_AVX512),
    "avx512_fp16": (_CPUID_7_EDX, 23, _XCR0_AVX512),
    "avx512_bf16": (_CPUID_71_EAX, 5, _XCR0_AVX512),
    "amx_bf16": (_CPUID_7_EDX, 22, _XCR0_AMX),
    "amx_tile": (_CPUID_7_EDX, 24, _XCR0_AMX),
    "amx_int8": (_CPUID_7_EDX, 25, _XCR0_AMX),
}
FEATURES = tuple(_FEATURE_BITS)


@dataclass(frozen=True)
class Tier:
    name: str
    requires: tuple[str, ...]  # features the CPU must have to run this tier
    flags: tuple[str, ...]  # compiler flags that enable them
    optional: tuple[tuple[str, str], ...] = ()  # (feature, flag) used when present

    def compile_flags(self, features: frozenset[str] | None) -> tuple[str, ...]:
        """Flags for a build: the optional extensions this CPU has, or all of
        them when building for another machine (``features`` is None)."""
        extra = tuple(flag for feat, flag in self.optional if features is None or feat in features)
        return self.flags + extra

    def used_features(self, flags: tuple[str, ...]) -> tuple[str, ...]:
        """Features an artifact built with ``flags`` needs at run time."""
        return self.requires + tuple(feat for feat, flag in self.optional if flag in flags)


_AVX2_REQ = ("avx2", "fma", "f16c")
_AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")
_AVX512_REQ = _AVX2_REQ + ("avx512f", "avx512bw", "avx512vl", "avx512dq")
_AVX512_FLAGS = _AVX2_FLAGS + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")

TIERS: dict[str, Tier] = {
    t.name: t
    for t in (
        Tier(
            "amx",
            _AVX512_REQ + ("avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"),
            _AVX512_FLAGS + ("-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16", "-mamx-int8"),
            (("avx512_fp16", "-mavx512fp16"), ("avx512vbmi", "-mavx512vbmi")),
        ),
        Tier(
            "avx512",
            _AVX512_REQ,
            _AVX512_FLAGS,
            (
                ("avx512_bf16", "-mavx512bf16"),
                ("avx512_vnni", "-mavx512vnni"),
                ("avx512_fp16", "-mavx512fp16"),
                ("avx512vbmi", "-mavx512vbmi"),
            ),
        ),
        Tier("avx2", _AVX2_REQ, _AVX2_FLAGS),
        Tier("generic", (), ()),
    )
}
TIER_ORDER = tuple(TIERS)  # best first


class IsaError(ValueError):
    """A tier was asked for that this CPU (or OS) cannot run."""


def decode_features(regs: list[int]) -> frozenset[str]:
    """Feature names from the probe's raw registers (pure, testable)."""
    xcr0, amx_granted = regs[_XCR0], bool(regs[_AMX_GRANTED])
    found = set()
    for name, (reg, bit, xcr0_state) in _FEATURE_BITS.items():
        if (regs[reg] >> bit) & 1 and xcr0 & xcr0_state == xcr0_state:
            found.add(name)
    if not amx_granted:
        found -= {"amx_tile", "amx_bf16", "amx_int8"}
    return frozenset(found)


_lock = threading.Lock()
_features: frozenset[str] | None = None
_forced: str | None = None
_forced_read_env = False
_listeners: list[Callable[[], None]] = []
# Reads the raw CPUID/XGETBV registers: a compiled kernel, so the JIT installs it (isa sits
# below the JIT and does not import it).
_read_registers: Callable[[], list[int]] | None = None


def on_change(listener: Callable[[], None]) -> None:
    """Call ``listener`` whenever the selected tier changes."""
    _listeners.append(listener)


def set_register_reader(reader: Callable[[], list[int]]) -> None:
    global _read_registers
    _read_registers = reader


def cpu_features() -> frozenset[str]:
    """This CPU's usable features (probed once per process)."""
    global _features
    if _features is None:
        with _lock:
            if _features is None:
                _features = _probe()
    return _features


def _probe() -> frozenset[str]:
    if _read_registers is None:
        raise RuntimeError("kernforge.jit.isa: no CPU register reader installed (import kernforge.jit)")
    return decode_features(_read_registers())


@lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name (tuning records are kept per model)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def runnable(tier: str, features: frozenset[str] | None = None) -> bool:
    features = cpu_features() if features is None else features
    return all(f in features for f in TIERS[tier].requires)


def runnable_tiers() -> list[str]:
    """Tiers this CPU and OS can run, best first."""
    return [t for t in TIER_ORDER if runnable(t)]


def best_tier() -> str:
    return runnable_tiers()[0]


def validate(tier: str) -> str:
    if tier not in TIERS:
        raise IsaError(f"unknown ISA tier {tier!r}; choose one of {', '.join(TIER_ORDER)}")
    if not runnable(tier):
        missing = [f for f in TIERS[tier].requires if f not in cpu_features()]
        raise IsaError(
            f"ISA tier {tier!r} needs {', '.join(missing)}, which this CPU or OS does not provide; "
            f"runnable tiers: {', '.join(runnable_tiers())}"
        )
    return tier


def selected_tier() -> str:
    """The tier kernels are built for: forced (env or set_isa) or the best runnable."""
    global _forced, _forced_read_env
    if not _forced_read_env:
        env = os.environ.get("KERNFORGE_ISA", "").strip().lower()
        if env and _forced is None:
            _forced = validate(env)  # a bad value raises on every call until fixed
        _forced_read_env = True
    return _forced or best_tier()


def set_isa(tier: str | None) -> None:
    """Force kernels to ``tier`` (None: back to the best runnable tier)."""
    global _forced, _forced_read_env
    _forced = None if tier is None else validate(tier.lower())
    _forced_read_env = True
    for listener in _listeners:
        listener()


@contextlib.contextmanager
def use_isa(tier: str) -> Iterator[str]:
    """Run the body with kernels built for ``tier``; restores the previous choice."""
    current = selected_tier()  # reads KERNFORGE_ISA first, so a forced tier is restored
    previous = current if _forced is not None else None
    set_isa(tier)
    try:
        yield tier
    finally:
        set_isa(previous)


def cpu_info() -> dict[str, Any]:
    """Features, runnable tiers and the tier in use."""
    features = cpu_features()
    return {
        "features": {f: f in features for f in FEATURES},
        "runnable_tiers": runnable_tiers(),
        "best_tier": best_tier(),
        "selected_tier": selected_tier(),
        "amx_permission": "amx_tile" in features,
    }
