"""The JIT pipeline: ISA detection, spec, render, compile, load."""

from kernforge.jit.compiler import CompilerNotFoundError, KernelCompileError
from kernforge.jit.core import KernelNotCachedError, KernelSpec, Variant, build, load_kernel
from kernforge.jit.isa import IsaError, cpu_info, runnable_tiers, selected_tier, set_isa, use_isa
from kernforge.jit.render import register_template_dir

__all__ = [
    "CompilerNotFoundError", "IsaError", "KernelCompileError", "KernelNotCachedError", "KernelSpec", "Variant",
    "build", "cpu_info", "load_kernel", "register_template_dir", "runnable_tiers", "selected_tier", "set_isa",
    "use_isa",
]
