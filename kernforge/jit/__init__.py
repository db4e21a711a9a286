"""The JIT pipeline: ISA detection, module declarations, render, compile, load."""

from kernforge.cache.disk import CacheWriteError
from kernforge.jit.compiler import BuildModeError, CompilerNotFoundError, KernelCompileError
from kernforge.jit.core import KernelNotCachedError, KernelSpec, Variant, build, load_kernel
from kernforge.jit.isa import IsaError, cpu_info, runnable_tiers, selected_tier, set_isa, use_isa
from kernforge.jit.module import (
    ALL_TIERS,
    VECTOR_TIERS,
    Bool,
    Codes,
    DeclarationError,
    DType,
    Entry,
    Enum,
    Int,
    IntTuple,
    Kernel,
    Module,
    Struct,
)
from kernforge.jit.render import register_template_dir

__all__ = [
    "ALL_TIERS",
    "Bool",
    "BuildModeError",
    "CacheWriteError",
    "CompilerNotFoundError",
    "DeclarationError",
    "DType",
    "Entry",
    "Enum",
    "Int",
    "IntTuple",
    "IsaError",
    "Kernel",
    "KernelCompileError",
    "KernelNotCachedError",
    "KernelSpec",
    "Module",
    "Struct",
    "Codes",
    "VECTOR_TIERS",
    "Variant",
    "build",
    "cpu_info",
    "load_kernel",
    "register_template_dir",
    "runnable_tiers",
    "selected_tier",
    "set_isa",
    "use_isa",
]
