"""Spec -> render -> compile -> cache -> load.

``KernelSpec`` names a variant: a declared :class:`~kernforge.jit.module.Module`,
its checked parameters and the tier it is built for. Its key is a readable
prefix plus a hash of everything that decides the binary: rendered source, the
headers it includes (exactly those), full compiler command (with the build
mode's flags: ``KERNFORGE_JIT_DEBUG``, ``KERNFORGE_SANITIZE``,
``KERNFORGE_EXTRA_CFLAGS``; the mode's tag also ends the prefix), compiler
version, kernforge version and cffi mode. ``build`` compiles on first use (once across
processes: per-key file lock, checked before and after taking it) and loads a
:class:`~kernforge.jit.module.Kernel`. ``Variant`` is what ops hold: after the
first call, getting the kernel is one integer compare, with no hashing,
rendering or filesystem work.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernforge._version import __version__
from kernforge.cache import disk
from kernforge.jit import compiler, isa, loader, render
from kernforge.jit.module import Entry, Kernel, Module, registered

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
    module: Module
    params: tuple[tuple[str, Any], ...]  # checked, in declaration order
    tier: str

    @classmethod
    def make(cls, module: Module | str, params: Mapping[str, Any], tier: str) -> KernelSpec:
        module = registered(module) if isinstance(module, str) else module
        if tier not in isa.TIERS:
            raise isa.IsaError(f"unknown ISA tier {tier!r}; choose one of {', '.join(isa.TIER_ORDER)}")
        return cls(module, tuple(module.checked_params(params).items()), tier)

    @property
    def template(self) -> str:
        return self.module.template

    def prefix(self) -> str:
        """Readable part of the key, e.g. ``norm_dtype-bf16_fused_add-0_gemma-0_avx512``."""
        return self.module.prefix(dict(self.params), self.tier)

    def variables(self) -> dict:
        return self.module.render_variables(dict(self.params), self.tier)


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
    source: str
    mode: str
    build_mode: compiler.BuildMode
    prefix: str  # the spec's readable prefix and the build mode's tag
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
    source = render.render(spec.template, spec.variables())
    missing = [e.name for e in spec.module.entries.values() if e.symbol(spec.module.name) not in source]
    if missing:  # else: a cffi compile error (api) or a .so without the symbol (abi)
        raise ValueError(
            f"template {spec.template!r} does not define entry {missing[0]!r} of module "
            f"{spec.module.name!r}; write `{{{{ decl.{missing[0]} }}}} {{ ... }}` in it"
        )
    mode = loader.cffi_mode()
    build_mode = compiler.build_mode()
    prefix = spec.prefix() + build_mode.tag
    # The headers this source includes (by content) and the Python ABI stand in for include
    # paths, so a cache copied to another install location or machine still matches, and an
    # edited header rebuilds only the variants that include it.
    content = [
        source,
        spec.module.cdef,
        render.headers_digest(source),
        flags,
        __version__,
        mode,
        loader.python_abi(mode),
    ]
    if build_mode != compiler.BuildMode():  # (the default adds nothing: release keys stay as they were)
        content.append([*build_mode.flags(), *build_mode.extra])
    content_digest = _sha(content)
    try:
        argv = compiler.compiler_argv()
    except compiler.CompilerNotFoundError:
        if jit_enabled():
            raise
        # KERNFORGE_JIT=0 on a machine without a compiler: serve a prewarmed entry.
        return _Plan(
            spec, source, mode, build_mode, prefix, tier.used_features(flags), runnable, content_digest, None, None
        )
    includes = render.include_dirs() + ([loader.python_include()] if mode == "api" else [])
    command = compiler.build_command(argv, flags, includes, "<source>", "<output>", build_mode)
    compiler_identity = [
        compiler.build_command(argv, flags, [], "", "", build_mode),
        compiler.compiler_version(tuple(argv)),
    ]
    key = f"{prefix}-{_sha([content_digest, compiler_identity])[:20]}"
    return _Plan(
        spec, source, mode, build_mode, prefix, tier.used_features(flags), runnable, content_digest, command, key
    )


def _sha(parts: list) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def jit_enabled() -> bool:
    return os.environ.get("KERNFORGE_JIT", "1").strip().lower() not in ("0", "false", "no", "off")


def _prewarm_hint(spec: KernelSpec) -> str:
    words = ["python -m kernforge prewarm --module", spec.module.name]
    origin = render.template_origin(spec.template)
    if origin is not None:
        words += ["--template-dir", str(origin)]
    words += [f"--param {k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in spec.params]
    return " ".join(words + ["--isa", spec.tier])


def _ready(plan: _Plan, entry: disk.Entry, load: bool) -> Kernel | bool | None:
    """If the entry is intact and built from the plan's content: its loaded kernel
    (``load``) or True; else None, and the caller rebuilds it."""
    meta = entry.trusted_meta()
    if meta is None or meta.get("content_digest") != plan.content_digest:
        return None
    if not load:
        return True
    missing = [f for f in meta.get("requires", []) if f not in isa.cpu_features()]
    if missing:
        raise isa.IsaError(f"cached kernel {entry.key} needs {', '.join(missing)}, which this CPU lacks")
    module = plan.spec.module
    symbols = {name: e.symbol(module.name) for name, e in module.entries.items()}
    try:
        ffi, functions = loader.load(plan.mode, entry.so, meta["extension"], module.cdef, symbols)
    except (OSError, ImportError, AttributeError) as exc:
        log.warning("cached %s does not load (%s); rebuilding it", entry.key, exc)
        return None
    return Kernel(module, ffi, functions)


def _compile(plan: _Plan, entry: disk.Entry) -> float:
    """Under the entry's lock: render to disk, compile to a temp name, commit."""
    entry.begin_build()
    entry.source.write_text(plan.source)
    source = entry.source
    if plan.mode == "api":
        loader.write_api_wrapper(_module_name(plan.key), plan.spec.module.cdef, plan.source, entry.wrapper)
        source = entry.wrapper
    tmp = entry.temp_so()
    command = [str(source) if a == "<source>" else str(tmp) if a == "<output>" else a for a in plan.command]
    log.info("compiling %s ...", plan.key)
    try:
        seconds = compiler.run(command, plan.key, entry.source, entry.log)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    entry.commit(
        tmp,
        {
            "module": plan.spec.module.name,
            "template": plan.spec.template,
            "params": _jsonable(plan.spec.params),
            "tier": plan.spec.tier,
            "requires": list(plan.requires),
            "command": command,
            "cffi_mode": plan.mode,
            "build_mode": plan.build_mode.describe(),
            "content_digest": plan.content_digest,
            "extension": _module_name(plan.key),
            "cdef": plan.spec.module.cdef,
            "compile_seconds": round(seconds, 3),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
    )
    log.info("compiled %s in %.2f s", plan.key, seconds)
    return seconds


def _jsonable(params: tuple[tuple[str, Any], ...]) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in params}


def _module_name(key: str) -> str:
    """The cffi extension's name: unique per key, a valid identifier."""
    return "_kf_" + key.rsplit("-", 1)[1]


def build(
    spec: KernelSpec, load: bool | None = True, allow_compile: bool | None = None
) -> tuple[BuildResult, Kernel | None]:
    """Make sure ``spec`` is in the cache (compiling it if needed); load it if
    asked (``load=None``: load only if this CPU can run the tier and this process the build mode).
    ``allow_compile`` defaults to ``KERNFORGE_JIT``; prewarm passes True."""
    plan = _plan(spec)
    if load is None:  # (prewarm: a sanitized build outside the sanitizer's launcher is built, not loaded)
        load = plan.runnable and compiler.can_load(plan.build_mode)
    if load and not plan.runnable:
        isa.validate(spec.tier)  # raises with the missing features
    if load:
        compiler.check_runtime(plan.build_mode)  # before compiling: a sanitized kernel must be loadable
    root = disk.cache_root()
    if plan.key is None:
        return _build_without_compiler(plan, root, load)
    entry = disk.Entry(root, plan.key)
    found = _ready(plan, entry, load)  # fast path: no lock once the entry is committed
    seconds, compiled = 0.0, False
    if not found:
        if not (jit_enabled() if allow_compile is None else allow_compile):
            raise _not_cached(spec, plan.key, root)
        try:
            with entry.lock():
                found = _ready(plan, entry, load)  # another process may have built it while we waited
                if not found:
                    seconds, compiled = _compile(plan, entry), True
                    found = _ready(plan, entry, load)
        except (TimeoutError, disk.CacheWriteError):
            raise  # a lock held too long (KERNFORGE_LOCK_TIMEOUT); already explained
        except OSError as exc:  # a full disk, a read-only cache: nothing trusted was written
            raise disk.write_error(root, f"kernel {plan.key}", exc) from exc
        if not found:
            raise RuntimeError(f"kernforge: {plan.key} was just built but does not load; see {entry.log}")
    result = BuildResult(spec, plan.key, compiled, seconds, entry.dir)
    return result, (found if load else None)


def _build_without_compiler(plan: _Plan, root: Path, load: bool) -> tuple[BuildResult, Kernel | None]:
    """No compiler and KERNFORGE_JIT=0: use a prewarmed entry with the same content."""
    for entry in disk.entries_with_prefix(root, plan.prefix):
        found = _ready(plan, entry, load)
        if found:
            return BuildResult(plan.spec, entry.key, False, 0.0, entry.dir), (found if load else None)
    raise _not_cached(plan.spec, f"{plan.prefix}-*", root)


def _not_cached(spec: KernelSpec, key: str, root: Path) -> KernelNotCachedError:
    return KernelNotCachedError(
        f"kernel {key} is not in the cache {root} and KERNFORGE_JIT=0 forbids compiling it; "
        f"build it first with: {_prewarm_hint(spec)}"
    )


# In-process memo of loaded kernels. Keyed by where the template and headers are found as well
# as by the spec, so registering a template directory that shadows a built-in template (or
# header) after a first call loads the user's variant instead of the memoized built-in one.
_memo: dict[tuple, Kernel] = {}
_memo_lock = threading.Lock()


def load_kernel(module: Module | str, params: Mapping[str, Any], tier: str) -> Kernel:
    """The loaded variant, built on first use and memoized."""
    return load_spec(KernelSpec.make(module, params, tier))


def load_spec(spec: KernelSpec) -> Kernel:
    memo_key = (spec, render.template_path(spec.template), tuple(render.include_dirs()))
    kernel = _memo.get(memo_key)
    if kernel is None:
        _, kernel = build(spec)
        with _memo_lock:
            kernel = _memo.setdefault(memo_key, kernel)
    return kernel


# Bumped whenever the tier or the template search path changes, so every Variant re-resolves
# its kernel on its next call. isa and render report those changes through listeners, so
# neither imports this module.
_generation = 0


def invalidate_dispatch() -> None:
    global _generation
    _generation += 1


isa.on_change(invalidate_dispatch)
render.on_change(invalidate_dispatch)


class Variant:
    """One module's parameters, resolved to a kernel for the selected tier.

    ``kernel()`` is the hot path: one integer compare after the first call.
    Get variants from :meth:`Module.variant` / :meth:`Module.select` (memoized).
    """

    __slots__ = ("module", "params", "_kernel", "_generation")

    def __init__(self, module: Module, params: dict):
        self.module, self.params = module, params
        self._kernel: Kernel | None = None
        self._generation = -1

    def kernel(self) -> Kernel:
        if self._generation == _generation:
            return self._kernel
        return self._resolve()

    def spec(self, tier: str | None = None) -> KernelSpec:
        built = self.module.built_tier(tier or isa.selected_tier())
        return KernelSpec(self.module, tuple(self.params.items()), built)

    def _resolve(self) -> Kernel:
        generation = _generation
        self._kernel = load_spec(self.spec())
        self._generation = generation
        return self._kernel

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"Variant({self.module.name}, {params})"


# The CPU probe is itself a cached JIT kernel (generic C++, so any x86 CPU runs it).
CPU_PROBE = Module(
    "cpu_probe",
    "cpu_probe.cpp.jinja",
    params={},
    entries=[Entry("read", (("regs_out", "int64_t"),), returns="int64_t")],
    tiers={tier: "generic" for tier in isa.TIER_ORDER},
)


def _read_cpu_registers() -> list[int]:
    kernel = load_kernel(CPU_PROBE, {}, "generic")
    regs = kernel.ffi.new("int64_t[8]")
    kernel.read(kernel.address(regs))
    return list(regs)


isa.set_register_reader(_read_cpu_registers)
