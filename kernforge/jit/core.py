"""Spec -> render -> compile -> cache -> load.

``KernelSpec`` names a variant (template, parameters, tier). Its key is a
readable prefix plus a hash of everything that decides the binary: rendered
source, headers, full compiler command, compiler version, kernforge version
and cffi mode. ``load_kernel`` returns the entry point, compiling on first use
(once across processes: per-key file lock, checked before and after taking
it). ``Variant`` is what ops hold: after the first call, getting the kernel is
one attribute compare, with no hashing, rendering or filesystem work.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kernforge._version import __version__
from kernforge.cache import disk
from kernforge.jit import compiler, isa, loader, render

log = logging.getLogger("kernforge")
if not log.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("kernforge: %(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.INFO)
    log.propagate = False


class KernelNotCachedError(RuntimeError):
    """``KERNFORGE_JIT=0`` and the variant is not in the cache."""


@dataclass(frozen=True)
class KernelSpec:
    template: str
    params: tuple[tuple[str, Any], ...]  # sorted (name, value) pairs
    tier: str

    @classmethod
    def make(cls, template: str, params: dict, tier: str) -> "KernelSpec":
        if tier not in isa.TIERS:
            raise isa.IsaError(f"unknown ISA tier {tier!r}; choose one of {', '.join(isa.TIER_ORDER)}")
        return cls(template, tuple(sorted(params.items())), tier)

    @property
    def op(self) -> str:
        return self.template.split(".", 1)[0]

    def prefix(self) -> str:
        """Readable part of the key, e.g. ``norm_dtype-bf16_fused_add-1_gemma-0_avx512``."""
        parts = [self.op, *(f"{k}-{_short(v)}" for k, v in self.params), self.tier]
        return "_".join(parts)

    def variables(self) -> dict:
        return {**dict(self.params), "op": self.op, "tier": self.tier}


def _short(value: Any) -> str:
    return str(int(value)) if isinstance(value, bool) else str(value)


@dataclass
class BuildResult:
    spec: KernelSpec
    key: str
    compiled: bool  # False: it was already cached
    seconds: float
    path: Path


@dataclass(frozen=True)
class _Plan:
    """Everything decided before touching the cache."""

    spec: KernelSpec
    rendered: render.Rendered
    mode: str
    requires: tuple[str, ...]
    runnable: bool
    content_digest: str  # what the binary is made of, whatever compiler builds it
    command: list[str] | None  # with placeholders for source and output; None: no compiler
    key: str | None  # None: no compiler, so only a cached entry with this content can serve


def _plan(spec: KernelSpec) -> _Plan:
    tier = isa.TIERS[spec.tier]
    features = isa.cpu_features() if tier.requires else frozenset()
    runnable = all(f in features for f in tier.requires)
    flags = tier.compile_flags(features if runnable else None)  # cross-build: every optional flag
    rendered = render.render(spec.template, spec.variables())
    mode = loader.cffi_mode()
    # Header contents and the Python ABI stand in for include paths, so a cache
    # copied to another install location or machine still matches.
    content = [rendered.source, render.include_digest(), flags, __version__, mode, loader.python_abi(mode)]
    content_digest = _sha(content)
    try:
        argv = compiler.compiler_argv()
    except compiler.CompilerNotFoundError:
        if jit_enabled():
            raise
        # KERNFORGE_JIT=0 on a machine without a compiler: serve a prewarmed entry.
        return _Plan(spec, rendered, mode, tier.used_features(flags), runnable, content_digest, None, None)
    includes = render.include_dirs() + ([loader.python_include()] if mode == "api" else [])
    command = compiler.build_command(argv, flags, includes, "<source>", "<output>")
    compiler_identity = [compiler.build_command(argv, flags, [], "", ""), compiler.compiler_version(tuple(argv))]
    key = f"{spec.prefix()}-{_sha([content_digest, compiler_identity])[:20]}"
    return _Plan(spec, rendered, mode, tier.used_features(flags), runnable, content_digest, command, key)


def _sha(parts: list) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def jit_enabled() -> bool:
    return os.environ.get("KERNFORGE_JIT", "1").strip().lower() not in ("0", "false", "no", "off")


def _prewarm_hint(spec: KernelSpec) -> str:
    words = ["python -m kernforge prewarm --template", spec.template]
    origin = render.template_origin(spec.template)
    if origin is not None:
        words += ["--template-dir", str(origin)]
    words += [f"--param {k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in spec.params]
    return " ".join(words + ["--isa", spec.tier])


def _ready(plan: _Plan, entry: disk.Entry, load: bool) -> Callable | bool | None:
    """If the entry is intact and built from the plan's content: its entry
    point (``load``) or True; else None, and the caller rebuilds it."""
    meta = entry.trusted_meta()
    if meta is None or meta.get("content_digest") != plan.content_digest:
        return None
    if not load:
        return True
    missing = [f for f in meta.get("requires", []) if f not in isa.cpu_features()]
    if missing:
        raise isa.IsaError(f"cached kernel {entry.key} needs {', '.join(missing)}, which this CPU lacks")
    try:
        return loader.load(plan.mode, entry.so, meta["module"], plan.rendered.cdecl, plan.rendered.entry)
    except (OSError, ImportError, AttributeError) as exc:
        log.warning("cached %s does not load (%s); rebuilding it", entry.key, exc)
        return None


def _compile(plan: _Plan, entry: disk.Entry) -> float:
    """Under the entry's lock: render to disk, compile to a temp name, commit."""
    entry.begin_build()
    entry.source.write_text(plan.rendered.source)
    source = entry.source
    if plan.mode == "api":
        loader.write_api_wrapper(_module_name(plan.key), plan.rendered.cdecl, plan.rendered.source, entry.wrapper)
        source = entry.wrapper
    tmp = entry.temp_so()
    command = [str(source) if a == "<source>" else str(tmp) if a == "<output>" else a for a in plan.command]
    log.info("compiling %s ...", plan.key)
    try:
        seconds = compiler.run(command, plan.key, entry.source, entry.log)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    entry.commit(tmp, {
        "template": plan.spec.template, "params": dict(plan.spec.params), "tier": plan.spec.tier,
        "requires": list(plan.requires), "command": command, "cffi_mode": plan.mode,
        "content_digest": plan.content_digest, "module": _module_name(plan.key), "cdecl": plan.rendered.cdecl,
        "compile_seconds": round(seconds, 3), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    })
    log.info("compiled %s in %.2f s", plan.key, seconds)
    return seconds


def _module_name(key: str) -> str:
    """The cffi extension's name: unique per key, a valid identifier."""
    return "_kf_" + key.rsplit("-", 1)[1]


def build(
    spec: KernelSpec, load: bool | None = True, allow_compile: bool | None = None
) -> tuple[BuildResult, Callable | None]:
    """Make sure ``spec`` is in the cache (compiling it if needed); load it if
    asked (``load=None``: load only if this CPU can run the tier).
    ``allow_compile`` defaults to ``KERNFORGE_JIT``; prewarm passes True."""
    plan = _plan(spec)
    if load is None:
        load = plan.runnable
    if load and not plan.runnable:
        isa._validate(spec.tier)  # raises with the missing features
    root = disk.cache_root()
    if plan.key is None:
        return _build_without_compiler(plan, root, load)
    entry = disk.Entry(root, plan.key)
    found = _ready(plan, entry, load)  # fast path: no lock once the entry is committed
    seconds, compiled = 0.0, False
    if not found:
        if not (jit_enabled() if allow_compile is None else allow_compile):
            raise _not_cached(spec, plan.key, root)
        with entry.lock():
            found = _ready(plan, entry, load)  # another process may have built it while we waited
            if not found:
                seconds, compiled = _compile(plan, entry), True
                found = _ready(plan, entry, load)
        if not found:
            raise RuntimeError(f"kernforge: {plan.key} was just built but does not load; see {entry.log}")
    result = BuildResult(spec, plan.key, compiled, seconds, entry.dir)
    return result, (found if load else None)


def _build_without_compiler(plan: _Plan, root: Path, load: bool) -> tuple[BuildResult, Callable | None]:
    """No compiler and KERNFORGE_JIT=0: use a prewarmed entry with the same content."""
    for entry in disk.entries_with_prefix(root, plan.spec.prefix()):
        found = _ready(plan, entry, load)
        if found:
            return BuildResult(plan.spec, entry.key, False, 0.0, entry.dir), (found if load else None)
    raise _not_cached(plan.spec, f"{plan.spec.prefix()}-*", root)


def _not_cached(spec: KernelSpec, key: str, root: Path) -> KernelNotCachedError:
    return KernelNotCachedError(
        f"kernel {key} is not in the cache {root} and KERNFORGE_JIT=0 forbids compiling it; "
        f"build it first with: {_prewarm_hint(spec)}"
    )


_memo: dict[KernelSpec, Callable] = {}
_memo_lock = threading.Lock()


def load_kernel(template: str, params: dict, tier: str) -> Callable:
    """The entry point of a variant, built on first use and memoized."""
    spec = KernelSpec.make(template, params, tier)
    fn = _memo.get(spec)
    if fn is None:
        _, fn = build(spec)
        with _memo_lock:
            fn = _memo.setdefault(spec, fn)
    return fn


# Bumped whenever the tier or template search path changes, so every
# Variant re-resolves its kernel on its next call.
_generation = 0


def invalidate_dispatch() -> None:
    global _generation
    _generation += 1


class Variant:
    """An op's handle on one template + parameters, over the tiers it has.

    ``kernel()`` is the hot path: one integer compare after the first call.
    """

    __slots__ = ("template", "params", "tiers", "_fn", "_generation")

    def __init__(self, template: str, params: dict, tiers: tuple[str, ...] = ("avx512", "avx2", "generic")):
        self.template, self.params, self.tiers = template, params, tiers
        self._fn: Callable | None = None
        self._generation = -1

    def kernel(self) -> Callable:
        if self._generation == _generation:
            return self._fn
        return self._resolve()

    def spec(self, tier: str | None = None) -> KernelSpec:
        return KernelSpec.make(self.template, self.params, self.tier_for(tier or isa.selected_tier()))

    def tier_for(self, wanted: str) -> str:
        """The best tier this variant has at or below ``wanted``."""
        for tier in isa.TIER_ORDER[isa.TIER_ORDER.index(wanted):]:
            if tier in self.tiers:
                return tier
        raise isa.IsaError(f"{self.template} has no variant at or below tier {wanted!r}")

    def _resolve(self) -> Callable:
        generation = _generation
        spec = self.spec()
        self._fn = load_kernel(spec.template, dict(spec.params), spec.tier)
        self._generation = generation
        return self._fn

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"Variant({self.template!r}, {params})"
