"""ISA detection, tier dispatch and the AMX path.

* ``decode_features`` on synthetic CPUID/XGETBV registers (bit positions written out
  here from the Intel SDM, independently of kernforge's table).
* the real probe agrees with the kernel's view in ``/proc/cpuinfo``.
* dispatch never picks a tier the CPU (or OS) cannot run; forcing one is a clear error.
* the AMX template cross-compiles anywhere and is checked against torch where AMX runs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernforge
from kernforge.cache import disk
from kernforge.jit import core, isa, render

from conftest import clean_env
from kernels import AMX_TILE_MATMUL, AXPY, VNNI_MATMUL_REF

AMX_TEMPLATE = AMX_TILE_MATMUL.template
AMX_FEATURES = ("amx_tile", "amx_bf16", "amx_int8")


pytestmark = pytest.mark.usefixtures("test_templates")


@pytest.fixture
def dispatch(monkeypatch):
    """Isolate the tier choice: no forced tier, KERNFORGE_ISA unread; restored afterwards."""
    monkeypatch.delenv("KERNFORGE_ISA", raising=False)
    monkeypatch.setattr(isa, "_forced", None)
    monkeypatch.setattr(isa, "_forced_read_env", False)
    yield monkeypatch
    core.invalidate_dispatch()


def fake_cpu(monkeypatch, features) -> None:
    """Pretend the probe found exactly ``features``."""
    monkeypatch.setattr(isa, "_features", frozenset(features))


def has_amx() -> bool:
    return "amx" in isa.runnable_tiers()


def proc_cpuinfo_flags() -> set[str] | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    match = re.search(r"^flags\s*:\s*(.*)$", text, re.MULTILINE)
    return set(match.group(1).split()) if match else None


# --------------------------------------------------------------------------- decode_features

# Probe output layout (see templates/cpu_probe.cpp.jinja): 0 max leaf, 1 CPUID.1:ECX,
# 2/3/4 CPUID.(7,0):EBX/ECX/EDX, 5 CPUID.(7,1):EAX, 6 XCR0, 7 AMX tile data granted.
SDM_BITS = {
    "fma": (1, 12),
    "f16c": (1, 29),
    "avx2": (2, 5),
    "avx512f": (2, 16),
    "avx512dq": (2, 17),
    "avx512bw": (2, 30),
    "avx512vl": (2, 31),
    "avx512vbmi": (3, 1),
    "avx512_vnni": (3, 11),
    "amx_bf16": (4, 22),
    "avx512_fp16": (4, 23),
    "amx_tile": (4, 24),
    "amx_int8": (4, 25),
    "avx512_bf16": (5, 5),
}
XCR0_AVX = 0b111  # x87, SSE, AVX
XCR0_AVX512 = XCR0_AVX | 0b1110_0000  # + opmask, ZMM_Hi256, Hi16_ZMM
XCR0_AMX = XCR0_AVX512 | (1 << 17) | (1 << 18)  # + XTILECFG, XTILEDATA
AVX2_SET = {"avx2", "fma", "f16c"}
AVX512_SET = AVX2_SET | {"avx512f", "avx512dq", "avx512bw", "avx512vl"}
ZEN5_SET = AVX512_SET | {"avx512_vnni", "avx512_bf16"}
SPR_SET = ZEN5_SET | {"avx512_fp16", *AMX_FEATURES}


def regs(features=(), xcr0=XCR0_AMX, amx_granted=True, noise=True) -> list[int]:
    r = [0x20, 0, 0, 0, 0, 0, xcr0, int(amx_granted)]
    for name in features:
        index, bit = SDM_BITS[name]
        r[index] |= 1 << bit
    if noise:  # unrelated bits (SSE4.2, OSXSAVE, BMI1, ...) must not matter
        r[1] |= (1 << 20) | (1 << 27)
        r[2] |= (1 << 3) | (1 << 8)
        r[3] |= 1 << 2
    return r


def test_decode_features_matches_the_sdm_bit_table():
    assert set(SDM_BITS) == set(isa.FEATURES)
    for name in SDM_BITS:
        assert isa.decode_features(regs([name])) == {name}, name


@pytest.mark.parametrize(
    "features, xcr0, granted, expected",
    [
        ((), XCR0_AMX, True, set()),
        (AVX2_SET, XCR0_AVX, False, AVX2_SET),
        (ZEN5_SET, XCR0_AVX512, False, ZEN5_SET),
        (SPR_SET, XCR0_AMX, True, SPR_SET),
        # AVX-512 in CPUID, but the OS did not enable ZMM state in XCR0: no AVX-512 at all
        (ZEN5_SET, XCR0_AVX, False, AVX2_SET),
        (ZEN5_SET, XCR0_AVX512 & ~(1 << 7), False, AVX2_SET),  # Hi16_ZMM missing
        (ZEN5_SET, XCR0_AVX512 & ~(1 << 5), False, AVX2_SET),  # opmask missing
        # no YMM state: not even AVX2/FMA/F16C
        (SPR_SET, 0b011, True, set()),
        # AMX in CPUID and XCR0, but the kernel did not grant this process the tile data
        (SPR_SET, XCR0_AMX, False, SPR_SET - set(AMX_FEATURES)),
        # AMX granted (so to speak) but the OS has no tile state in XCR0
        (SPR_SET, XCR0_AVX512, True, SPR_SET - set(AMX_FEATURES)),
        (SPR_SET, XCR0_AVX512 | (1 << 17), True, SPR_SET - set(AMX_FEATURES)),  # XTILECFG only
    ],
    ids=[
        "none",
        "avx2",
        "zen5",
        "sapphire-rapids",
        "avx512-no-zmm-state",
        "avx512-no-hi16",
        "avx512-no-opmask",
        "no-ymm-state",
        "amx-not-granted",
        "amx-no-xcr0",
        "amx-no-tiledata",
    ],
)
def test_decode_features(features, xcr0, granted, expected):
    assert isa.decode_features(regs(features, xcr0, granted)) == expected


def test_decode_features_tier_consequences():
    no_zmm = isa.decode_features(regs(SPR_SET, XCR0_AVX, True))
    assert [t for t in isa.TIER_ORDER if isa.runnable(t, no_zmm)] == ["avx2", "generic"]
    not_granted = isa.decode_features(regs(SPR_SET, XCR0_AMX, False))
    assert [t for t in isa.TIER_ORDER if isa.runnable(t, not_granted)] == ["avx512", "avx2", "generic"]
    full = isa.decode_features(regs(SPR_SET, XCR0_AMX, True))
    assert [t for t in isa.TIER_ORDER if isa.runnable(t, full)] == ["amx", "avx512", "avx2", "generic"]


def test_tier_flags_follow_the_features():
    avx512 = isa.TIERS["avx512"]
    zen5 = avx512.compile_flags(frozenset(ZEN5_SET))
    assert {"-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni"} <= set(zen5)
    assert "-mavx512fp16" not in zen5, "an optional flag for a feature the CPU lacks"
    assert "avx512_fp16" not in avx512.used_features(zen5)
    cross = avx512.compile_flags(None)  # building for another machine: every optional flag
    assert "-mavx512fp16" in cross and "avx512_fp16" in avx512.used_features(cross)
    assert isa.TIERS["generic"].compile_flags(None) == ()
    assert not any("-march" in f for t in isa.TIERS.values() for f in t.compile_flags(None))
    amx = isa.TIERS["amx"]
    assert {"-mamx-tile", "-mamx-bf16"} <= set(amx.compile_flags(frozenset(SPR_SET)))
    assert set(AMX_FEATURES) <= set(amx.requires)


# --------------------------------------------------------------------------- the real CPU


def test_probe_agrees_with_proc_cpuinfo():
    flags = proc_cpuinfo_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo flags line")
    features = isa.cpu_features()
    for name in isa.FEATURES:
        if name in AMX_FEATURES:  # usable only once the kernel grants tile state to this process
            assert name not in features or name in flags, name
        else:
            assert (name in features) == (name in flags), f"{name}: probe {name in features}, cpuinfo {name in flags}"


def test_runnable_tiers_match_the_features():
    features = isa.cpu_features()
    tiers = isa.runnable_tiers()
    assert tiers[-1] == "generic"
    assert tiers == [t for t in isa.TIER_ORDER if all(f in features for f in isa.TIERS[t].requires)]
    if not set(AMX_FEATURES) <= features:
        assert "amx" not in tiers
    info = kernforge.cpu_info()
    assert info["runnable_tiers"] == tiers and info["best_tier"] == tiers[0]
    assert info["amx_permission"] == ("amx_tile" in features)


def test_dispatch_picks_the_best_runnable_tier(dispatch):
    tier = isa.selected_tier()
    assert tier == isa.runnable_tiers()[0]
    if not has_amx():
        assert tier != "amx"


@pytest.mark.parametrize(
    "features, expected",
    [
        (SPR_SET, "amx"),
        (SPR_SET - {"amx_tile"}, "avx512"),  # e.g. AMX not granted by the OS
        (SPR_SET - {"avx512_bf16"}, "avx512"),
        (ZEN5_SET, "avx512"),
        (AVX512_SET - {"avx512vl"}, "avx2"),
        (AVX2_SET, "avx2"),
        (AVX2_SET - {"fma"}, "generic"),
        (set(), "generic"),
    ],
    ids=["spr", "amx-not-granted", "no-avx512bf16", "zen5", "no-avx512vl", "avx2", "no-fma", "none"],
)
def test_dispatch_never_selects_an_unrunnable_tier(dispatch, features, expected):
    fake_cpu(dispatch, features)
    assert isa.selected_tier() == expected
    assert isa.runnable_tiers()[0] == expected
    # an op's Variant (VECTOR_TIERS: no amx build) runs its avx512 build on amx
    variant = kernforge.ops.OPS["rmsnorm"].variant(torch.float32)
    assert variant.spec().tier == ("avx512" if expected == "amx" else expected)
    # a module built for every tier (ALL_TIERS) runs exactly the selected one
    assert AXPY.variant(dtype="fp32").spec().tier == expected


def test_forcing_amx_without_amx_is_a_clear_error(dispatch):
    if has_amx():
        pytest.skip("this CPU/OS has AMX")
    missing = [f for f in isa.TIERS["amx"].requires if f not in isa.cpu_features()]
    with pytest.raises(kernforge.IsaError) as info:
        kernforge.set_isa("amx")
    message = str(info.value)
    assert "'amx'" in message
    assert all(f in message for f in missing), message
    assert "runnable tiers" in message
    assert isa.selected_tier() != "amx"


def test_forcing_amx_on_a_fake_cpu_names_only_the_missing_features(dispatch):
    fake_cpu(dispatch, SPR_SET - {"amx_int8", "avx512_vnni"})
    with pytest.raises(kernforge.IsaError, match=r"needs avx512_vnni, amx_int8, which"):
        isa.set_isa("amx")


def test_unknown_tier_names_the_choices(dispatch):
    with pytest.raises(kernforge.IsaError, match="unknown ISA tier 'avx9'.*amx, avx512, avx2, generic"):
        kernforge.set_isa("avx9")


def test_kernforge_isa_env_forcing_unrunnable_tier_raises(dispatch):
    fake_cpu(dispatch, ZEN5_SET)
    dispatch.setenv("KERNFORGE_ISA", "amx")
    with pytest.raises(kernforge.IsaError, match="amx_tile"):
        isa.selected_tier()


def test_kernforge_isa_env_error_is_not_forgotten(dispatch):
    fake_cpu(dispatch, ZEN5_SET)
    dispatch.setenv("KERNFORGE_ISA", "amx")
    with pytest.raises(kernforge.IsaError):
        isa.selected_tier()
    with pytest.raises(kernforge.IsaError):
        isa.selected_tier()  # still forced to an unrunnable tier: must not quietly run avx512


def test_use_isa_restores_the_previous_choice(dispatch):
    fake_cpu(dispatch, ZEN5_SET)
    with kernforge.use_isa("avx2"):
        assert isa.selected_tier() == "avx2"
        with kernforge.use_isa("generic"):
            assert isa.selected_tier() == "generic"
        assert isa.selected_tier() == "avx2"
    assert isa.selected_tier() == "avx512"


def test_use_isa_restores_a_tier_forced_by_the_environment(dispatch):
    fake_cpu(dispatch, ZEN5_SET)
    dispatch.setenv("KERNFORGE_ISA", "avx2")
    with kernforge.use_isa("generic"):
        assert isa.selected_tier() == "generic"
    assert isa.selected_tier() == "avx2"


def test_loading_an_unrunnable_tier_is_refused_before_compiling(cache, dispatch):
    fake_cpu(dispatch, ZEN5_SET)
    with pytest.raises(kernforge.IsaError, match="amx_tile"):
        core.load_kernel(AXPY, {"dtype": "fp32"}, "amx")
    assert [p for p in cache.iterdir() if not p.name.startswith(".")] == []


def test_cross_build_for_an_unrunnable_tier(cache, dispatch):
    """Building (not loading) a tier this CPU lacks works, with every optional flag of the tier."""
    fake_cpu(dispatch, AVX2_SET)
    result, fn = core.build(core.KernelSpec.make(AXPY, {"dtype": "fp32"}, "avx512"), load=None)
    assert result.compiled and fn is None
    meta = disk.Entry(cache, result.key).trusted_meta()
    assert meta is not None
    assert {"-mavx512f", "-mavx512fp16", "-mavx512bf16"} <= set(meta["command"])
    assert {"avx512f", "avx512_fp16", "avx512_bf16"} <= set(meta["requires"])


# --------------------------------------------------------------------------- KERNFORGE_ISA in a new process

_INFO_CHILD = r"""
import json, sys
import kernforge
try:
    info = kernforge.cpu_info()
    print("RESULT " + json.dumps({"selected": info["selected_tier"], "runnable": info["runnable_tiers"]}))
except Exception as exc:
    print("RESULT " + json.dumps({"error": type(exc).__name__, "message": str(exc)}))
"""


@pytest.mark.slow  # four child processes (each imports torch)
def test_kernforge_isa_env_in_new_processes(cache):
    env = clean_env()
    wanted = {"avx2": "avx2", " AVX2 ": "avx2", "generic": "generic", "amx": None}
    procs = {
        value: subprocess.Popen(
            [sys.executable, "-c", _INFO_CHILD],
            env={**env, "KERNFORGE_ISA": value},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for value in wanted
    }
    results = {}
    try:
        for value, proc in procs.items():
            out, err = proc.communicate(timeout=180)
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            assert proc.returncode == 0 and lines, f"KERNFORGE_ISA={value!r}: rc {proc.returncode}\n{out}\n{err}"
            results[value] = json.loads(lines[-1][7:])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    for value, tier in wanted.items():
        if tier is not None:
            assert results[value].get("selected") == tier, (value, results[value])
    amx = results["amx"]
    if "amx" in results["avx2"]["runnable"]:
        assert amx.get("selected") == "amx"
    else:
        assert amx.get("error") == "IsaError", amx
        assert "amx_tile" in amx["message"] and "runnable tiers" in amx["message"]


# --------------------------------------------------------------------------- AMX


def test_amx_template_exists():
    assert (render.PACKAGE_TEMPLATES / AMX_TEMPLATE).is_file(), f"kernforge/templates/{AMX_TEMPLATE} is missing"


def test_amx_template_compiles_on_any_x86_cpu(cache):
    spec = core.KernelSpec.make(AMX_TILE_MATMUL, {}, "amx")
    result, fn = core.build(spec, load=False)
    assert result.compiled and fn is None
    meta = disk.Entry(cache, result.key).trusted_meta()
    assert meta is not None
    assert {"-mamx-tile", "-mamx-bf16"} <= set(meta["command"])
    assert set(AMX_FEATURES) <= set(meta["requires"])
    again, _ = core.build(spec, load=False)
    assert not again.compiled


def vnni_pack(b: torch.Tensor) -> torch.Tensor:
    """B [K, N] -> B_packed [K/2, 2N] with B_packed[k // 2][2n + k % 2] = B[k][n]."""
    k, n = b.shape
    return b.reshape(k // 2, 2, n).transpose(1, 2).reshape(k // 2, 2 * n).contiguous()


def test_vnni_pack_layout():
    b = torch.arange(32 * 16, dtype=torch.float32).reshape(32, 16)
    packed = vnni_pack(b)
    assert packed.shape == (16, 32)
    for k in range(32):
        for n in range(16):
            assert packed[k // 2, 2 * n + k % 2] == b[k, n]


def _matmul_args(module) -> tuple[str, ...]:
    """The entry's parameter names, from the module's declaration (c/a/b in any order)."""
    names = module.entries["run"].arg_names
    assert sorted(names) == ["a", "b", "c"], f"unexpected matmul entry signature: {module.entries['run']}"
    return names


def check_tile_matmul(module, tier: str, values: str) -> None:
    """C fp32 [16,16] = A bf16 [16,32] . B bf16 [32,16] (passed VNNI-packed), against torch."""
    kernel = core.load_kernel(module, {}, tier)
    gen = torch.Generator().manual_seed(0)
    if values == "exact":  # small multiples of 1/4: every product and sum is exact in fp32
        a = (torch.randint(-4, 5, (16, 32), generator=gen) / 4).to(torch.bfloat16)
        b = (torch.randint(-4, 5, (32, 16), generator=gen) / 4).to(torch.bfloat16)
    else:
        a = torch.randn(16, 32, generator=gen).to(torch.bfloat16)
        b = torch.randn(32, 16, generator=gen).to(torch.bfloat16)
    b_packed = vnni_pack(b)
    c = torch.full((16, 16), float("nan"), dtype=torch.float32)
    pointers = {"a": a.data_ptr(), "b": b_packed.data_ptr(), "c": c.data_ptr()}
    _matmul_args(module)
    ret = kernel.call("run", **pointers)  # bound by name: the declaration's argument order does not matter
    assert ret == 0, f"{module.name} returned {ret} (AMX tile permission refused?)"
    expected = a.float() @ b.float()
    if values == "exact":
        assert torch.equal(c, expected), f"max error {(c - expected).abs().max()}"
    else:
        torch.testing.assert_close(c, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("values", ["exact", "normal"])
def test_tile_matmul_harness_on_a_scalar_reference(cache, values):
    """The AMX test's packing and argument handling, checked on any CPU with a scalar kernel."""
    check_tile_matmul(VNNI_MATMUL_REF, "generic", values)


@pytest.mark.parametrize("values", ["exact", "normal"])
def test_amx_tile_matmul_matches_torch(cache, values):
    if not has_amx():
        pytest.skip("CPU/OS has no AMX (amx_tile/amx_bf16 missing or tile state not granted)")
    check_tile_matmul(AMX_TILE_MATMUL, "amx", values)
