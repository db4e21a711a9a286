"""kf::VecF conformance: every vector operation against scalar C++, on every runnable tier.

The vector layer (kernforge/templates/include/kernforge/core/vec*.h) promises one interface on
every tier; the op tests only see it through whole kernels. Here
``tests/templates/vec_conformance.cpp.jinja`` runs each VecF operation over input arrays
and, in the same translation unit, computes the scalar C++ reference; this file feeds the
inputs (awkward values first: +-0, subnormals, +-inf, NaNs with payloads, huge/tiny,
rounding ties) and compares lane by lane. A failure names the op, the tier, the lane and
the inputs.

What is compared, and how:

* Exact (bit for bit): loads/stores (full, partial for every count 0..kWidth and beyond,
  fp32/bf16/fp16/fp8_e4m3/fp8_e5m2, narrowing RNE with ties, NaN quieting, overflow to Inf,
  fp8 saturation), stream (fp32/bf16/fp16),
  broadcast, zero, unary -, abs, copysign, clamp, max, select, to_bits, < and >=,
  compress_store, reduce_add (against the pairwise halving tree every tier uses), + - * /,
  fma, rint, ldexp, add_if. Where IEEE leaves a NaN's payload to the operand order the
  compiler picked (arithmetic), any NaN matches a NaN; ops that only move bits (neg, abs,
  copysign, clamp, max, select, loads/stores) must keep the payload.
* fma is fused (one rounding) on the FMA tiers; the generic tier documents two roundings
  (a*b, then +c), and its reference does exactly that.
* Partial loads/stores must never touch element ``count`` or later: stores are checked
  with sentinels, loads with nonzero data past ``count`` (the lanes must read +0), and
  both with a guard page (an inaccessible page starting at element ``count``; a touch
  faults, the template catches it). A positive control (a full access into the guard)
  shows the probe detects touches.
* fp8: every one of the 256 bit patterns in every lane, and the scalar kf::to_float, against
  torch's ``.to(torch.float32)`` bit for bit (NaN payloads included); kf::from_float against
  torch's ``.to(torch.float8_*)`` on every rounding tie and its neighbours, the subnormal and
  saturation/overflow edges, and random bits.
* Where the interface leaves a choice, the test accepts exactly that choice:
  reduce_max is tested on NaN-free vectors and a zero result by value (which signed zero
  wins is order-dependent); add_if may return ``acc`` itself or ``acc + 0`` where the mask
  is clear (they differ only for acc = -0: the AVX-512 masked add keeps -0).
* exp, erf, tanh, sigmoid: against the std:: functions in double, in units of the fp32
  ulp of the exact result (2^-149 for subnormal results): at most MATH_ULP[op] ulp, with
  the sign and special values (NaN, +-Inf, signed zeros) exact. See MATH_ULP for why.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kernforge
from kernforge.jit import core, isa, render
from kernforge.jit.module import DeclarationError, DType, Entry, Module
from kernforge.ops._registry import FP8_DTYPE_NAMES

from conftest import TEST_TEMPLATES

TEMPLATES = TEST_TEMPLATES

_ENTRIES = {
    "width": "",
    "exact": "int64_t op, int64_t n, int64_t a_addr, int64_t b_addr, int64_t c_addr, int64_t d_addr, "
    "int64_t got_addr, int64_t want_addr",
    "masks": "int64_t op, int64_t n, int64_t a_addr, int64_t b_addr, int64_t got_addr, int64_t want_addr",
    "reduce": "int64_t op, int64_t n, int64_t a_addr, int64_t got_addr, int64_t want_addr",
    "compress": "int64_t n, int64_t a_addr, int64_t b_addr, int64_t c_addr, int64_t got_addr, "
    "int64_t got_count_addr, int64_t want_addr, int64_t want_count_addr",
    "splat": "int64_t n, int64_t a_addr, int64_t got_addr",
    "load_full": "int64_t dtype, int64_t n, int64_t src_addr, int64_t got_addr, int64_t want_addr",
    "load_partial": "int64_t dtype, int64_t count, int64_t n, int64_t src_addr, int64_t got_addr, int64_t want_addr",
    "store_full": "int64_t dtype, int64_t n, int64_t src_addr, int64_t got_addr, int64_t want_addr",
    "store_partial": "int64_t dtype, int64_t count, int64_t n, int64_t src_addr, int64_t got_addr, int64_t want_addr",
    "stream": "int64_t dtype, int64_t n, int64_t src_addr, int64_t got_addr, int64_t want_addr",
    "guard": "int64_t dtype, int64_t op, int64_t count, int64_t got_addr",
    "math": "int64_t op, int64_t n, int64_t x_addr, int64_t got_addr, int64_t want_addr",
    "i32_width": "",
    "i32_moves": "int64_t n, int64_t src_addr, int64_t got_addr",
    "dot4_u8s8": "int64_t n, int64_t acc_addr, int64_t a_addr, int64_t b_addr, int64_t got_addr, int64_t want_addr",
}

# One build per vector tier; amx machines run the avx512 vector code (the VECTOR_TIERS rule), so
# the avx512 build is what the amx tier would run.
VEC_CONFORMANCE = Module(
    "vec_conformance",
    "vec_conformance.cpp.jinja",
    params={},
    entries=[Entry(name, args, returns="int64_t") for name, args in _ENTRIES.items()],
    tiers={"avx512": "avx512", "avx2": "avx2", "generic": "generic"},
    register=False,
)

TIERS = [t for t in isa.runnable_tiers() if t != "amx"]
pytestmark = [pytest.mark.all_tiers, pytest.mark.parametrize("isa_tier", TIERS, ids=[f"vec={t}" for t in TIERS])]

# Op codes of the template's `exact` entry.
EXACT_OPS = {
    name: code
    for code, name in enumerate(
        [
            "add",
            "sub",
            "mul",
            "div",
            "neg",
            "fma",
            "abs",
            "copysign",
            "clamp",
            "rint",
            "ldexp",
            "max",
            "select_lt",
            "select_ge",
            "add_if_lt",
            "add_if_ge",
            "add_assign",
            "mul_assign",
        ]
    )
}
# Ops that only move bits: a NaN must come out with its payload and sign intact.
BIT_EXACT_NAN = {"neg", "abs", "copysign", "clamp", "max", "select_lt", "select_ge"}
DTYPES = {
    "fp32": (0, np.float32, np.uint32),
    "bf16": (1, np.uint16, np.uint16),
    "fp16": (2, np.uint16, np.uint16),
    "fp8_e4m3": (3, np.uint8, np.uint8),
    "fp8_e5m2": (4, np.uint8, np.uint8),
}
FP8 = {name: dtype for dtype, name in FP8_DTYPE_NAMES.items()}  # kernforge name -> torch dtype
STREAM_DTYPES = ["fp32", "bf16", "fp16"]  # no non-temporal fp8 stores
MATH_OPS = {"exp": 0, "erf": 1, "tanh": 2, "sigmoid": 3}

# Max error in fp32 ulp of the exact result (the std:: function in double). The headers claim
# max relative errors of 1.8e-7 (exp) and ~2e-7 (erf, tanh); one ulp is 6e-8..1.2e-7 relative
# depending on where in its binade the result falls, so that is up to ~3.4 ulp. Measured
# maxima over a fifth of all fp32 with |x| in [2^-30, 128) (every 5th bit pattern), all tiers:
# exp 2.41 (generic; 2.18 with hardware FMA), erf 2.33, tanh 1.92, sigmoid 3.51. sigmoid
# compounds exp's error with the rounding of 1 + e^-x and of the division, hence 4; the others
# get 3. Still far below what a wrong coefficient, range reduction or sign gives (tens of ulp
# and up; special values, signs and overflow are checked exactly besides).
MATH_ULP = {"exp": 3.0, "erf": 3.0, "tanh": 3.0, "sigmoid": 4.0}

FLT_MAX = float(np.finfo(np.float32).max)
FLT_MIN = float(np.finfo(np.float32).tiny)


def f32(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def bits_of(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view({4: np.uint32, 2: np.uint16, 1: np.uint8}[x.dtype.itemsize])


# Awkward fp32 values: signed zeros, subnormals, the normal range's edges, infinities, quiet and
# signaling NaNs with payloads and both signs, rint ties, values around 2^23, huge and tiny.
SPECIAL_BITS = [
    0x00000000,
    0x80000000,  # +-0
    0x00000001,
    0x80000001,
    0x00000003,
    0x007FFFFF,
    0x807FFFFF,
    0x00400000,  # subnormals
    0x00800000,
    0x80800000,
    0x00800005,  # smallest normals (and one just above)
    0x7F7FFFFF,
    0xFF7FFFFF,
    0x7F000000,  # FLT_MAX, 2^127
    0x7F800000,
    0xFF800000,  # +-inf
    0x7FC00000,
    0xFFC00000,
    0x7FC12345,
    0x7F800001,
    0xFFA00000,
    0x7FBFFFFF,  # NaNs
]
SPECIAL_VALUES = [
    1.0,
    -1.0,
    0.5,
    -0.5,
    1.5,
    -1.5,
    2.5,
    -2.5,
    3.5,
    -3.5,
    0.49999997,
    -0.49999997,
    0.50000006,
    1.0000001,
    0.99999994,
    2.0,
    3.0,
    -7.0,
    0.1,
    -0.1,
    100.0,
    -100.0,
    88.72,
    -87.3,
    4194303.5,
    4194304.5,
    8388607.5,
    -8388607.5,
    8388608.0,
    8388609.0,
    16777215.0,
    16777217.0,
    1e30,
    -1e30,
    3e38,
    -3e38,
    1e-30,
    -1e-30,
    1e-38,
    1e-40,
    -1e-44,
    65504.0,
    65520.0,
    1e5,
]
SPECIALS = np.concatenate([f32(SPECIAL_BITS), np.array(SPECIAL_VALUES, dtype=np.float32)])


class Vec:
    """One tier's build of the conformance module, with numpy-friendly calls."""

    def __init__(self, tier: str):
        self.tier = tier
        self.kernel = core.load_kernel(VEC_CONFORMANCE, {}, tier)
        self.width = int(self.kernel.width())

    def pad(self, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
        """Arrays (same length) padded with their own leading elements to a multiple of kWidth."""
        n = len(arrays[0])
        assert all(len(a) == n for a in arrays), [len(a) for a in arrays]
        extra = -n % self.width
        out = []
        for a in arrays:
            a = np.ascontiguousarray(a)
            out.append(np.concatenate([a, np.resize(a, extra)]) if extra else a)
        return tuple(out)


@pytest.fixture(scope="module")
def _templates():
    """tests/templates on the template search path for this module (restored afterwards)."""
    saved = list(render._user_dirs)
    kernforge.register_template_dir(TEMPLATES)
    # One build per tier, compiled in parallel up front rather than one by one in the first tests.
    kernforge.prewarm([core.KernelSpec.make(VEC_CONFORMANCE, {}, t) for t in TIERS], progress=False)
    yield
    render._user_dirs[:] = saved
    render.search_path_changed()


_built: dict[str, Vec] = {}


@pytest.fixture
def vec(isa_tier, _templates) -> Vec:
    if isa_tier not in _built:
        _built[isa_tier] = Vec(isa_tier)
    return _built[isa_tier]


def addr(a: np.ndarray) -> int:
    assert a.flags.c_contiguous
    return a.ctypes.data


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def random_bits(gen: np.random.Generator, n: int) -> np.ndarray:
    """fp32 with uniformly random bit patterns: every exponent, subnormals, NaNs, Infs."""
    return gen.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)


def random_moderate(gen: np.random.Generator, n: int) -> np.ndarray:
    return (gen.standard_normal(n) * 10.0 ** gen.integers(-3, 4, n)).astype(np.float32)


def show(x) -> str:
    """A value with its bit pattern."""
    if isinstance(x, np.floating) and x.dtype == np.float32:
        return f"{float(x)!r} (0x{int(x.view(np.uint32)):08x})"
    if isinstance(x, np.float64):
        return repr(float(x))
    if isinstance(x, np.uint16):
        return f"0x{int(x):04x}"
    if isinstance(x, np.uint8):
        return f"0x{int(x):02x}"
    return repr(x)


def report(what: str, vec: Vec, bad: np.ndarray, columns: dict[str, np.ndarray], limit: int = 8) -> str:
    """A failure message: the op, the tier, and for the first few failing elements their vector,
    lane and every named column (inputs, got, want)."""
    idx = np.flatnonzero(bad)
    lines = [f"{what} on tier {vec.tier} (kWidth {vec.width}): {len(idx)} of {bad.size} elements differ"]
    for i in idx[:limit]:
        cells = ", ".join(f"{name}={show(col[i])}" for name, col in columns.items())
        lines.append(f"  vector {i // vec.width} lane {i % vec.width}: {cells}")
    return "\n".join(lines)


def same_bits(got: np.ndarray, want: np.ndarray, nan_payloads: bool = True) -> np.ndarray:
    """Elementwise: identical bit patterns (or, with nan_payloads=False, both NaN)."""
    ok = bits_of(got) == bits_of(want)
    if not nan_payloads:
        ok |= np.isnan(got) & np.isnan(want)
    return ok


# --------------------------------------------------------------------------- input sets


def pairs(gen, extra: int = 20000):
    """All SPECIALS x SPECIALS pairs, then random-bit and moderate random pairs."""
    a, b = (m.ravel() for m in np.meshgrid(SPECIALS, SPECIALS, indexing="ij"))
    return (
        np.concatenate([a, random_bits(gen, extra), random_moderate(gen, extra)]),
        np.concatenate([b, random_bits(gen, extra), random_moderate(gen, extra)]),
    )


def exact_inputs(op: str, gen: np.random.Generator):
    """(a, b, c, d) for an `exact` op."""
    a, b = pairs(gen)
    n = len(a)
    c, d = random_bits(gen, n), random_moderate(gen, n)
    if op == "fma":
        s = SPECIALS
        ta, tb, tc = (m.ravel() for m in np.meshgrid(s, s, s, indexing="ij"))
        # Cancellation: c = -round(a*b) leaves exactly the product's rounding error when fused,
        # and 0 when rounded twice.
        x, y = random_moderate(gen, 20000), random_moderate(gen, 20000)
        with np.errstate(all="ignore"):
            z = -(x * y)
        a = np.concatenate([ta, a, x])
        b = np.concatenate([tb, b, y])
        c = np.concatenate([tc, random_bits(gen, n), z])
    elif op == "clamp":
        finite = np.array(sorted({float(v) for v in SPECIALS if not np.isnan(v)}), dtype=np.float32)
        bounds = [(lo, hi) for lo in finite[::3] for hi in finite[::3] if lo <= hi]
        lo = np.array([p[0] for p in bounds], dtype=np.float32)
        hi = np.array([p[1] for p in bounds], dtype=np.float32)
        x = np.concatenate([SPECIALS, random_moderate(gen, 64)])
        a = np.repeat(x, len(lo))
        b, c = np.tile(lo, len(x)), np.tile(hi, len(x))
        # Plus random x against random ordered bounds.
        r = np.sort(random_moderate(gen, (2, 20000)), axis=0)
        a = np.concatenate([a, random_bits(gen, 20000), random_moderate(gen, 20000)])
        b = np.concatenate([b, r[0], r[0]])
        c = np.concatenate([c, r[1], r[1]])
    elif op == "rint":
        ties = np.arange(-40, 40, dtype=np.float32) + np.float32(0.5)
        big = np.float32(2.0**22) + np.arange(-8, 8, dtype=np.float32) * np.float32(0.5)
        near = np.concatenate(
            [ties, big, -big, np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, np.float32(-np.inf))]
        ).astype(np.float32)
        span = (gen.uniform(-(2.0**24), 2.0**24, 20000)).astype(np.float32)
        a = np.concatenate([SPECIALS, near, span, a])
        b = np.zeros_like(a)
    elif op == "ldexp":
        n_range = np.arange(-252, 255, dtype=np.float32)
        xs = np.concatenate([SPECIALS, f32([0x00800005, 0x00FFFFFF, 0x3FFFFFFF, 0x00C00001])])
        ga, gb = (m.ravel() for m in np.meshgrid(xs, n_range[::7], indexing="ij"))
        # Every exponent for a few mantissas whose scaled results land on subnormal ties.
        ta, tb = (
            m.ravel()
            for m in np.meshgrid(f32([0x00800005, 0x3F80000B, 0x3FFFFFFF, 0x00000007]), n_range, indexing="ij")
        )
        m = 40000
        a = np.concatenate([ga, ta, random_bits(gen, m), random_moderate(gen, m)])
        b = np.concatenate([gb, tb, gen.integers(-252, 255, 2 * m).astype(np.float32)])
    elif op in ("add_if_lt", "add_if_ge"):
        # acc = c (with the special values, -0 included), v = d.
        c = np.concatenate([np.resize(SPECIALS, n // 2), random_moderate(gen, n - n // 2)])
        d = np.concatenate([random_bits(gen, n // 2), np.resize(SPECIALS[::-1], n - n // 2)])
    elif op in ("select_lt", "select_ge"):
        c, d = random_bits(gen, n), np.resize(SPECIALS, n)
    return a, b, np.resize(c, len(a)), np.resize(d, len(a))


# --------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("op", list(EXACT_OPS))
def test_exact_ops(vec, op):
    a, b, c, d = vec.pad(*exact_inputs(op, rng(EXACT_OPS[op])))
    got, want = np.empty_like(a), np.empty_like(a)
    assert vec.kernel.exact(EXACT_OPS[op], len(a), addr(a), addr(b), addr(c), addr(d), addr(got), addr(want)) == 0
    ok = same_bits(got, want, nan_payloads=op in BIT_EXACT_NAN)
    if op.startswith("add_if"):
        # Where the mask is clear, acc itself is as good as acc + 0 (they differ only for -0).
        with np.errstate(invalid="ignore"):
            clear = ~(a < b) if op == "add_if_lt" else ~(a >= b)
        ok |= clear & same_bits(got, c)
    names = {
        "select_lt": ("a", "b", "if_true", "if_false"),
        "select_ge": ("a", "b", "if_true", "if_false"),
        "add_if_lt": ("a", "b", "acc", "v"),
        "add_if_ge": ("a", "b", "acc", "v"),
        "fma": ("a", "b", "c"),
        "clamp": ("x", "lo", "hi"),
        "ldexp": ("x", "n"),
    }
    inputs = dict(zip(names.get(op, ("a", "b")), (a, b, c, d)))
    if op in ("neg", "abs", "rint"):
        inputs = {"a": a}
    assert ok.all(), report(op, vec, ~ok, {**inputs, "got": got, "want": want})


@pytest.mark.parametrize("op", ["lt", "ge"])
def test_comparison_masks(vec, op):
    a, b = vec.pad(*pairs(rng(100)))
    n = len(a)
    got, want = np.empty(n // vec.width, np.int64), np.empty(n // vec.width, np.int64)
    assert vec.kernel.masks(0 if op == "lt" else 1, n, addr(a), addr(b), addr(got), addr(want)) == 0
    # Expand to one boolean per lane, so the report names lanes.
    lanes = np.arange(vec.width)
    got_lane = ((got[:, None] >> lanes) & 1).ravel().astype(bool)
    want_lane = ((want[:, None] >> lanes) & 1).ravel().astype(bool)
    with np.errstate(invalid="ignore"):
        python = (a < b) if op == "lt" else (a >= b)  # IEEE: false whenever a NaN is involved
    assert (want_lane == python).all(), "scalar reference disagrees with IEEE comparison"
    assert np.all(got >> vec.width == 0), f"to_bits set bits at or above kWidth on {vec.tier}"
    ok = got_lane == want_lane
    assert ok.all(), report(
        f"to_bits(a {'<' if op == 'lt' else '>='} b)", vec, ~ok, {"a": a, "b": b, "got": got_lane, "want": want_lane}
    )


def reduction_vectors(vec: Vec, gen: np.random.Generator, with_nan: bool) -> np.ndarray:
    w = vec.width
    pool = SPECIALS if with_nan else SPECIALS[~np.isnan(SPECIALS)]
    rows = [
        np.resize(pool, (len(pool) // w + 1) * w).reshape(-1, w),  # specials, in order
        gen.choice(pool, (4000, w)),  # specials, shuffled together
        random_moderate(gen, 4000 * w).reshape(-1, w),
        np.full((1, w), -0.0, np.float32),
        np.full((1, w), np.float32(-np.inf)),
        np.full((1, w), np.float32(FLT_MAX)),  # sums overflow
        np.array([[0.0, -0.0] * (w // 2)], np.float32),
        np.array([[1e30, 1.0, -1e30, 2.0] * (w // 4)], np.float32),  # cancellation: order matters
    ]
    if with_nan:
        rows.append(random_bits(gen, 4000 * w).reshape(-1, w))
        rows.append(np.array([[np.inf, -np.inf] + [1.0] * (w - 2)], np.float32))
    else:
        r = random_bits(gen, 8000 * w)
        rows.append(r[~np.isnan(r)][: 4000 * w].reshape(-1, w))
    return np.ascontiguousarray(np.concatenate(rows).astype(np.float32).ravel())


@pytest.mark.parametrize("op", ["reduce_add", "reduce_max"])
def test_reductions(vec, op):
    # reduce_max's result for NaN lanes is not specified (it depends on the tree), so it is tested on
    # NaN-free vectors; reduce_add propagates NaN whatever the order.
    a = reduction_vectors(vec, rng(200), with_nan=op == "reduce_add")
    nvec = len(a) // vec.width
    got, want = np.empty(nvec, np.float32), np.empty(nvec, np.float32)
    assert vec.kernel.reduce(0 if op == "reduce_add" else 1, len(a), addr(a), addr(got), addr(want)) == 0
    ok = same_bits(got, want, nan_payloads=False)
    if op == "reduce_max":
        ok |= (got == 0) & (want == 0)  # which signed zero wins depends on the order
        assert not np.isnan(want).any()
    rows = a.reshape(nvec, vec.width)
    bad = np.flatnonzero(~ok)
    detail = "\n".join(
        f"  vector {i}: lanes={[show(x) for x in rows[i]]} got={show(got[i])} want={show(want[i])}" for i in bad[:4]
    )
    assert ok.all(), f"{op} on tier {vec.tier}: {len(bad)} of {nvec} vectors differ\n{detail}"


def test_compress_store(vec):
    w = vec.width
    gen = rng(300)
    a, b = vec.pad(*pairs(gen, extra=8000))
    c = np.resize(np.concatenate([SPECIALS, random_bits(gen, 977)]), len(a))
    nvec = len(a) // w
    sentinel = np.uint32(0x7FBADBAD)
    got = np.full(2 * len(a), sentinel, np.uint32).view(np.float32)
    want = np.full(2 * len(a), sentinel, np.uint32).view(np.float32)
    got_count, want_count = np.empty(nvec, np.int64), np.empty(nvec, np.int64)
    assert (
        vec.kernel.compress(len(a), addr(a), addr(b), addr(c), addr(got), addr(got_count), addr(want), addr(want_count))
        == 0
    )
    got_slots, want_slots = bits_of(got).reshape(nvec, 2 * w), bits_of(want).reshape(nvec, 2 * w)
    for j in range(nvec):
        k = int(want_count[j])
        problems = []
        if got_count[j] != k:
            problems.append(f"returned {got_count[j]}, want {k}")
        elif not np.array_equal(got_slots[j, :k], want_slots[j, :k]):
            problems.append("packed lanes differ")
        if not np.all(got_slots[j, w:] == sentinel):
            problems.append("wrote past kWidth floats")  # [k, kWidth) may be written (AVX-512 stores a vector)
        if problems:
            sl = slice(j * w, (j + 1) * w)
            raise AssertionError(
                f"compress_store(dst, a < b, v) on tier {vec.tier}, vector {j}: {'; '.join(problems)}\n"
                f"  a={[show(x) for x in a[sl]]}\n  b={[show(x) for x in b[sl]]}\n  v={[show(x) for x in c[sl]]}\n"
                f"  got={[hex(x) for x in got_slots[j, :w]]}\n  want={[hex(x) for x in want_slots[j, :k]]}"
            )


def test_broadcast_and_zero(vec):
    w = vec.width
    a = np.ascontiguousarray(SPECIALS)
    got = np.empty((len(a) + 1) * w, np.float32)
    assert vec.kernel.splat(len(a), addr(a), addr(got)) == 0
    rows = bits_of(got).reshape(-1, w)
    want = np.concatenate([np.repeat(bits_of(a), w), np.zeros(w, np.uint32)]).reshape(-1, w)
    ok = (rows == want).ravel()
    value = np.concatenate([np.repeat(a, w), np.zeros(w, np.float32)])
    assert ok.all(), report(
        "broadcast(x) / zero() (last row)", vec, ~ok, {"x": value, "got": got, "want": want.ravel().view(np.float32)}
    )


# ---- loads and stores


def storage_values(dtype: str, gen: np.random.Generator) -> np.ndarray:
    """Raw storage elements to load: every 16-bit pattern for bf16/fp16; every 8-bit pattern in
    every lane for fp8 (256 * 17: 17 is coprime to kWidth); fp32 specials + random bits."""
    if dtype == "fp32":
        return np.concatenate([SPECIALS, random_bits(gen, 1 << 16)])
    if dtype in FP8:
        return (np.arange(256 * 17) % 256).astype(np.uint8)
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def fp8_ties(dtype: str) -> np.ndarray:
    """Every fp32 that rounds delicately to fp8: for each fp32 sign/exponent/kept-mantissa prefix,
    the dropped bits at the tie, either side of it, zero, one and all-ones (the normal range's RNE,
    carries into the exponent, to Inf and past the saturation bound); plus midpoints between
    consecutive fp8 values (the subnormal ties, exact in fp32) and their neighbours."""
    dropped = 20 if dtype == "fp8_e4m3" else 21
    tie = 1 << (dropped - 1)
    prefixes = np.arange(1 << (32 - dropped), dtype=np.uint32) << dropped
    lows = [0, 1, tie - 1, tie, tie + 1, (1 << dropped) - 1]
    values = torch.arange(256, dtype=torch.uint8).view(FP8[dtype]).double()
    finite = np.sort(np.unique(values[torch.isfinite(values)].numpy()))
    mids = ((finite[:-1] + finite[1:]) / 2).astype(np.float32)
    core_ = np.concatenate([mids, finite.astype(np.float32)])
    return np.concatenate(
        [
            f32(prefixes[:, None] | np.array(lows, np.uint32)).ravel(),
            core_,
            np.nextafter(core_, np.float32(np.inf)),
            np.nextafter(core_, np.float32(-np.inf)),
        ]
    )


def narrowing_inputs(dtype: str, gen: np.random.Generator) -> np.ndarray:
    """fp32 values whose narrowing is delicate: exact RNE ties and their neighbours, overflow to
    Inf, NaNs whose payload lives only in the dropped bits, subnormals, plus random bits."""
    parts = [
        SPECIALS,
        random_bits(gen, 1 << 16),
        f32([0x7F800001, 0xFF800001, 0x7F80FFFF, 0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x00008000, 0x00018000]),
    ]
    if dtype == "bf16":
        # Every bf16 top half with the dropped half at the tie, either side of it, zero and all-ones.
        tops = np.arange(1 << 16, dtype=np.uint32) << 16
        parts += [f32(tops | low) for low in (0x7FFF, 0x8000, 0x8001, 0x0000, 0xFFFF)]
    elif dtype == "fp16":
        # Midpoints between consecutive fp16 values (exact in fp32) and their fp32 neighbours.
        halves = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
        mids = ((halves[:-1] + halves[1:]) / 2).astype(np.float32)
        above_max = np.array([65519.996, 65520.0, 65520.004, 65535.0, 65536.0, 1e6], np.float32)
        core_ = np.concatenate([mids, above_max, halves.astype(np.float32)])
        parts += [core_, -core_, np.nextafter(core_, np.float32(np.inf)), np.nextafter(core_, np.float32(-np.inf))]
    elif dtype in FP8:
        parts += [
            fp8_ties(dtype),
            np.array(
                [448, 449, 463.99997, 464, 464.00003, 479.99997, 480, 57344, 61439.996, 61440, 61440.004, 65536, 1e6],
                np.float32,
            ),
        ]
    return np.concatenate(parts).astype(np.float32)


def to_storage(dtype: str, x: np.ndarray) -> np.ndarray:
    """torch's narrowing of fp32 x to an fp8 dtype, as raw bytes, e4m3 saturating (+-Inf and finite
    overflow to +-448) as torch 2.13 does whatever torch is installed: torch 2.11 turns e4m3
    overflow into NaN (pytorch#178817 made the CPU cast saturate)."""
    if dtype == "fp8_e4m3":
        x = np.clip(x, -448.0, 448.0)  # NaN stays NaN
    return torch.from_numpy(np.ascontiguousarray(x)).to(FP8[dtype]).view(torch.uint8).numpy()


def as_float(dtype: str, raw: np.ndarray) -> np.ndarray:
    if dtype == "fp32":
        return raw
    if dtype in FP8:  # torch's widening (numpy has no fp8)
        return torch.from_numpy(np.ascontiguousarray(raw)).view(FP8[dtype]).float().numpy()
    if dtype == "fp16":
        return raw.view(np.float16).astype(np.float32)
    return (raw.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_load_full(vec, dtype):
    code, storage, _ = DTYPES[dtype]
    (src,) = vec.pad(storage_values(dtype, rng(400)).astype(storage))
    got, want = np.empty(len(src), np.float32), np.empty(len(src), np.float32)
    assert vec.kernel.load_full(code, len(src), addr(src), addr(got), addr(want)) == 0
    # The scalar conversion itself agrees with numpy's (NaN payloads aside), and with torch's for fp8
    # bit for bit.
    reference = as_float(dtype, src)
    agrees = same_bits(want, reference, nan_payloads=dtype in FP8)
    assert agrees.all(), report(
        f"kf::to_float({dtype}) vs {'torch' if dtype in FP8 else 'numpy'}",
        vec,
        ~agrees,
        {"stored": src, "to_float": want, "reference": reference},
    )
    ok = same_bits(got, want)
    assert ok.all(), report(f"VecF::load(const {dtype}*)", vec, ~ok, {"stored": src, "got": got, "want": want})


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_store_full(vec, dtype):
    code, storage, _ = DTYPES[dtype]
    (src,) = vec.pad(narrowing_inputs(dtype, rng(500)))
    got, want = np.empty(len(src), storage), np.empty(len(src), storage)
    assert vec.kernel.store_full(code, len(src), addr(src), addr(got), addr(want)) == 0
    if dtype == "fp16":  # the scalar reference agrees with numpy's RNE narrowing (NaN payloads aside)
        with np.errstate(over="ignore"):
            ref = src.astype(np.float16)
        assert same_bits(want.view(np.float16).astype(np.float32), ref.astype(np.float32), nan_payloads=False).all()
    if dtype in FP8:  # kf::from_float is torch's narrowing, bit for bit
        ref = to_storage(dtype, src)
        agrees = want == ref
        assert agrees.all(), report(
            f"kf::from_float<{dtype}> vs torch", vec, ~agrees, {"x": src, "from_float": want, "torch": ref}
        )
    ok = bits_of(got) == bits_of(want)
    assert ok.all(), report(f"VecF::store({dtype}*)", vec, ~ok, {"x": src, "got": got, "want": want})


def partial_counts(vec: Vec) -> list[int]:
    return [*range(vec.width + 1), vec.width + 1, 1000]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_load_partial(vec, dtype):
    code, storage, _ = DTYPES[dtype]
    raw = storage_values(dtype, rng(600)).astype(storage)
    raw = raw[bits_of(raw) != 0][: 256 * vec.width]  # nonzero data everywhere, so a lane read past count shows
    (src,) = vec.pad(raw)
    for count in partial_counts(vec):
        got, want = np.empty(len(src), np.float32), np.empty(len(src), np.float32)
        assert vec.kernel.load_partial(code, count, len(src), addr(src), addr(got), addr(want)) == 0
        ok = same_bits(got, want)
        assert ok.all(), report(
            f"VecF::load(const {dtype}*, count={count})", vec, ~ok, {"stored": src, "got": got, "want": want}
        )


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_store_partial(vec, dtype):
    code, storage, _ = DTYPES[dtype]
    (src,) = vec.pad(narrowing_inputs(dtype, rng(700))[: 512 * vec.width])
    sentinel = {"fp32": 0x7FBADBAD, "bf16": 0xBADB, "fp16": 0xBADB}.get(dtype, 0x5A)
    for count in partial_counts(vec):
        got, want = np.full(len(src), sentinel, storage), np.full(len(src), sentinel, storage)
        assert vec.kernel.store_partial(code, count, len(src), addr(src), addr(got), addr(want)) == 0
        ok = bits_of(got) == bits_of(want)
        assert ok.all(), report(
            f"v.store({dtype}*, count={count}) (sentinel 0x{sentinel:x} past count)",
            vec,
            ~ok,
            {"x": src, "got": got, "want": want},
        )


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_partial_access_guard_page(vec, dtype):
    """Element `count` is the first byte of an inaccessible page: the partial forms must not fault."""
    code = DTYPES[dtype][0]
    w = vec.width
    for count in partial_counts(vec):
        got = np.full(w, 99.0, np.float32)
        assert vec.kernel.guard(code, 0, count, addr(got)) == 0, (
            f"VecF::load(const {dtype}*, count={count}) touched memory at or past element count on {vec.tier}"
        )
        valid = min(count, w)
        # The template stores from_float<T>(1..valid) before the guard: exact except for e5m2 (9 -> 8 ...).
        stored = np.arange(1, valid + 1, dtype=np.float32)
        if dtype in FP8:
            stored = as_float(dtype, to_storage(dtype, stored))
        want = np.concatenate([stored, np.zeros(w - valid, np.float32)])
        assert np.array_equal(bits_of(got), bits_of(want)), f"guarded load count={count}: {got} != {want}"
        assert vec.kernel.guard(code, 1, count, 0) == 0, (
            f"v.store({dtype}*, count={count}) touched memory at or past element count on {vec.tier}"
        )


def test_guard_page_detects_touches(vec):
    """Positive control for the guard probe: a full load/store that straddles it faults, caught."""
    got = np.zeros(vec.width, np.float32)
    for code, _, _ in DTYPES.values():
        for count in (0, vec.width - 1):
            assert vec.kernel.guard(code, 2, count, addr(got)) == 1, f"full load, guard at {count}: not detected"
            assert vec.kernel.guard(code, 3, count, 0) == 1, f"full store, guard at {count}: not detected"
        assert vec.kernel.guard(code, 2, vec.width, addr(got)) == 0  # exactly kWidth before the guard: fits
        assert vec.kernel.guard(code, 3, vec.width, 0) == 0


@pytest.mark.parametrize("dtype", STREAM_DTYPES)
def test_stream(vec, dtype):
    code, storage, _ = DTYPES[dtype]
    (src,) = vec.pad(narrowing_inputs(dtype, rng(800))[: 1024 * vec.width])
    got, want = np.empty(len(src), storage), np.empty(len(src), storage)
    assert vec.kernel.stream(code, len(src), addr(src), addr(got), addr(want)) == 0
    ok = bits_of(got) == bits_of(want)
    assert ok.all(), report(f"v.stream({dtype}*)", vec, ~ok, {"x": src, "got": got, "want": want})


# ---- math


def math_inputs(op: str, gen: np.random.Generator) -> np.ndarray:
    sweep = {"exp": (-110.0, 95.0), "erf": (-6.0, 6.0), "tanh": (-12.0, 12.0), "sigmoid": (-110.0, 110.0)}[op]
    edges = {
        # overflow threshold, FLT_MIN and subnormal underflow thresholds, the clamp bounds
        "exp": [88.72283935546875, 88.7228, 88.8, -87.33654, -103.27893, -103.97208, -104.0, 0.34657359, -0.34657359],
        "erf": [1.0, 4.0, -1.0, -4.0, 2.5, 1e-20, -1e-20, 3.9, 0.1],  # region boundaries
        "tanh": [0.625, -0.625, 9.0, 9.1, 1e-20, 0.0001],  # branch boundary, saturation
        "sigmoid": [88.72283935546875, -88.72283935546875, -87.33654, 16.6, -16.6, 0.0001],
    }[op]
    e = np.array(edges, np.float32)
    near = np.concatenate([e, np.nextafter(e, np.float32(np.inf)), np.nextafter(e, np.float32(-np.inf))])
    return np.concatenate(
        [
            SPECIALS,
            near,
            -near,
            np.linspace(*sweep, 1 << 17, dtype=np.float32),
            random_bits(gen, 1 << 15),
            (gen.standard_normal(1 << 15) * 2).astype(np.float32),
        ]
    ).astype(np.float32)


def ulp_of(exact: np.ndarray) -> np.ndarray:
    """The fp32 ulp at |exact| (a float64 array): 2^(e-23) in binade [2^e, 2^(e+1)), 2^-149 below 2^-126."""
    _, e = np.frexp(np.abs(exact))
    return np.ldexp(1.0, np.maximum(e - 1, -126) - 23)


@pytest.mark.parametrize("op", list(MATH_OPS))
def test_math(vec, op):
    (x,) = vec.pad(math_inputs(op, rng(900 + MATH_OPS[op])))
    got, want = np.empty(len(x), np.float32), np.empty(len(x), np.float64)
    assert vec.kernel.math(MATH_OPS[op], len(x), addr(x), addr(got), addr(want)) == 0
    with np.errstate(over="ignore", invalid="ignore"):
        want32 = want.astype(np.float32)  # the correctly rounded fp32 result
        err = np.abs(got.astype(np.float64) - want) / ulp_of(want)
    nan_in = np.isnan(want)
    special = nan_in | np.isinf(want32) | (want == 0)  # NaN, overflow, exact zero: exact match
    ok = np.where(
        special,
        same_bits(got, want32, nan_payloads=False),
        (err <= MATH_ULP[op]) & (np.signbit(got) == np.signbit(want)),
    )
    if op == "sigmoid":
        # 1 / (1 + e^-x) gives +0 once e^-x overflows fp32 (x < -88.72), as torch.sigmoid does; the
        # exact result there is subnormal (below FLT_MIN).
        ok |= (x < -88.7) & (bits_of(got) == 0) & (want < FLT_MIN)
    assert ok.all(), report(
        f"{op} (max {MATH_ULP[op]} ulp)", vec, ~ok, {"x": x, "got": got, "want": want, "ulp_err": err}
    )


# ---- int32 lanes: kf::VecI32 and the u8 x s8 dot of 4


def dot4_reference(acc: np.ndarray, a_words: np.ndarray, b: np.ndarray, width: int) -> np.ndarray:
    """acc + sum_j u8(byte j of a) * s8(byte j of b), per lane, in int64 (numpy, independent of the template)."""
    a_bytes = np.repeat(a_words.astype("<u4"), width).view(np.uint8).reshape(-1, 4).astype(np.int64)
    b_bytes = b.astype("<i4").view(np.int8).reshape(-1, 4).astype(np.int64)
    return acc.astype(np.int64) + (a_bytes * b_bytes).sum(axis=1)


def test_i32_moves(vec):
    """VecI32::load (from any byte alignment) and v.store (to any int32 alignment) move int32 lanes bit
    for bit, and touch nothing outside their vector; zero() is 0."""
    w = int(vec.kernel.i32_width())
    assert w == vec.width, "VecI32 has VecF's lane count"
    values = rng(1000).integers(-(2**31), 2**31, 64 * w, dtype=np.int64).astype(np.int32)
    values[:8] = [0, -1, 2**31 - 1, -(2**31), 1, -2, 0x01020304, -0x01020305]
    for offset in (0, 1, 3, 4, 60):
        src = np.zeros(4 * len(values) + 64, np.uint8)
        src[offset : offset + 4 * len(values)] = values.view(np.uint8)
        out = offset // 4 * 4
        got = np.full(4 * (len(values) + w) + 64, 0xA5, np.uint8)
        assert vec.kernel.i32_moves(len(values), addr(src) + offset, addr(got) + out) == 0
        moved = got[out : out + 4 * len(values)].view(np.int32)
        assert np.array_equal(moved, values), f"VecI32 load at byte offset {offset}, store at {out} on {vec.tier}"
        zero = got[out + 4 * len(values) : out + 4 * (len(values) + w)].view(np.int32)
        assert not zero.any(), f"VecI32::zero() on {vec.tier}: {zero}"
        assert (got[:out] == 0xA5).all() and (got[out + 4 * (len(values) + w) :] == 0xA5).all(), (
            f"VecI32 store wrote outside its vectors at byte offset {out} on {vec.tier}"
        )


def dot4_inputs(gen: np.random.Generator, w: int):
    """(acc, a_words, b): every byte extreme of a against every one of b, sums reaching exactly
    INT32_MAX and INT32_MIN, accumulators near both ends, and random words."""
    extremes = np.array([0, 1, 127, 128, 254, 255], np.uint32)  # as u8; as s8 128 is -128, 255 is -1
    quads = lambda v: v | v << 8 | v << 16 | v << 24  # noqa: E731
    words = [quads(extremes), np.array([0x00FF00FF, 0xFF00FF00, 0x80FF0180, 0x7F80FF01], np.uint32)]
    a_special = np.concatenate(words)
    b_special = np.concatenate(words)
    ga, gb = (m.ravel() for m in np.meshgrid(a_special, b_special, indexing="ij"))  # one a word per vector
    a_words = [ga]
    b = [np.repeat(gb, w)]
    acc = [np.zeros(len(ga) * w, np.int64)]
    # The largest and smallest sums of a dot of 4: 4 * 255 * 127 and 4 * 255 * -128 (beyond int16:
    # no vpmaddubsw-style saturation), landing exactly on INT32_MAX / INT32_MIN.
    top, bottom = 4 * 255 * 127, 4 * 255 * -128
    for word_a, word_b, start in (
        (0xFFFFFFFF, 0x7F7F7F7F, 2**31 - 1 - top),
        (0xFFFFFFFF, 0x80808080, -(2**31) - bottom),
        (0xFFFFFFFF, 0x80808080, 2**31 - 1),
        (0xFFFFFFFF, 0x7F7F7F7F, -(2**31)),
    ):
        a_words.append(np.array([word_a], np.uint32))
        b.append(np.full(w, word_b, np.uint32))
        acc.append(np.full(w, start, np.int64))
    n_random = 4096
    a_words.append(gen.integers(0, 2**32, n_random, dtype=np.uint64).astype(np.uint32))
    b.append(gen.integers(0, 2**32, n_random * w, dtype=np.uint64).astype(np.uint32))
    acc.append(gen.integers(-(2**30), 2**30, n_random * w, dtype=np.int64))
    acc, a_words = np.concatenate(acc).astype(np.int32), np.concatenate(a_words).astype(np.uint32)
    b = np.concatenate(b).astype(np.uint32).view(np.int32)
    return acc, a_words, b


def test_dot4_u8s8(vec):
    """dot4_u8s8(acc, U8Quad::broadcast(word), b): per lane acc + sum of 4 u8 x s8 products, exact in
    int32 with no intermediate saturation, against numpy's int64 sum and the template's scalar one."""
    w = vec.width
    acc, a_words, b = dot4_inputs(rng(1100), w)
    reference = dot4_reference(acc, a_words, b, w)
    assert reference.min() >= -(2**31) and reference.max() <= 2**31 - 1, "inputs must keep every sum in int32"
    assert reference.max() == 2**31 - 1 and reference.min() == -(2**31), "the int32 ends are reached"
    got, want = np.empty_like(acc), np.empty_like(acc)
    assert vec.kernel.dot4_u8s8(len(acc), addr(acc), addr(a_words), addr(b), addr(got), addr(want)) == 0
    assert np.array_equal(want, reference), "the template's scalar reference disagrees with numpy"
    ok = got == reference
    assert ok.all(), report(
        "dot4_u8s8(acc, U8Quad::broadcast(a), b)",
        vec,
        ~ok,
        {"acc": acc, "a": np.repeat(a_words, w), "b": b.view(np.uint32), "got": got, "want": reference},
    )


# ---- fp8 as a module parameter


def test_fp8_dtype_param(isa_tier):
    """A module lists the fp8 storage types in its DType to get them (any tier: isa_tier is unused);
    the default DType, which the float ops use, still rejects them."""
    module = Module(
        "fp8_param_probe",
        "vec_conformance.cpp.jinja",
        params={"kv_dtype": DType(("bf16", "fp16", "fp8_e4m3", "fp8_e5m2"))},
        entries=[Entry("width", "", returns="int64_t")],
        register=False,
    )
    for torch_dtype, name in FP8_DTYPE_NAMES.items():
        for spelling in (torch_dtype, str(torch_dtype), name):
            assert module.variant(kv_dtype=spelling).params["kv_dtype"] == name
    with pytest.raises(DeclarationError, match="one of fp32, bf16, fp16"):
        DType().check("probe", "dtype", torch.float8_e4m3fn)
