"""Module declarations of the test templates (tests/templates) and of the AMX smoke kernel.

Importing this registers them by name (``axpy``, ``broken``, ...), as ``kernforge.ops``
registers the built-in modules. The templates themselves are found only once
``tests/templates`` is on the template search path (the ``test_templates`` fixture);
``amx_tile_matmul.cpp.jinja`` is a package template.
"""

from kernforge.jit import ALL_TIERS, Entry, Enum, Module

# Scalar C++, built for every tier as its own binary (amx included, so pre-warm can cross-build
# a tier this CPU lacks); the ops declare VECTOR_TIERS instead (their avx512 build serves amx).
AXPY = Module(
    "axpy",
    "axpy.cpp.jinja",
    params={"dtype": Enum(("fp32", "fp64", "i64"))},
    entries=[Entry("run", "int64_t x, int64_t y, int64_t n, double a", returns="int64_t")],
    tiers=ALL_TIERS,
)

# Rejected by the compiler (an undeclared identifier naming the tier).
BROKEN = Module(
    "broken",
    "broken.cpp.jinja",
    params={},
    entries=[Entry("run", "int64_t n", returns="int64_t")],
)

# kf::sampling::philox4x32_10 on words[0:4] (counter) and words[4:6] (key), in place.
PHILOX_KAT = Module(
    "philox_kat",
    "philox_kat.cpp.jinja",
    params={},
    entries=[Entry("run", "int64_t words")],
)

_MATMUL = [Entry("run", "int64_t c, int64_t a, int64_t b", returns="int64_t")]

# Scalar reference with the AMX smoke kernel's interface: plain C++, one generic build for every tier.
VNNI_MATMUL_REF = Module(
    "vnni_matmul_ref",
    "vnni_matmul_ref.cpp.jinja",
    params={},
    entries=_MATMUL,
    tiers={tier: "generic" for tier in ALL_TIERS},
)

# The AMX smoke kernel (a package template): one 16x16x32 bf16 tile product, built for amx only.
AMX_TILE_MATMUL = Module(
    "amx_tile_matmul",
    "amx_tile_matmul.cpp.jinja",
    params={},
    entries=_MATMUL,
    tiers={"amx": "amx"},
)

# Two deliberate bugs, reached only when asked: `sum` reads one int32 past the end when
# past_end=1 (ASan), `shift` shifts 1 by s (UBSan for s >= 32). The sanitizer tests' proof that a
# report fails a run (tests/jit/test_build_modes.py).
SANITIZER_BUGS = Module(
    "sanitizer_bugs",
    "sanitizer_bugs.cpp.jinja",
    params={},
    entries=[
        Entry("sum", "int64_t x, int64_t n, int64_t past_end", returns="int64_t"),
        Entry("shift", "int32_t s", returns="int64_t"),
    ],
)
