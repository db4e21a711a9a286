"""Build modes: ``KERNFORGE_JIT_DEBUG``, ``KERNFORGE_SANITIZE``, ``KERNFORGE_EXTRA_CFLAGS``, and the
sanitizer launcher ``python -m kernforge.sanitize``.

Each mode must be its own key (a sanitized ``.so`` never serves a release run, nor the other way
round) with its tag in the readable prefix; the values are checked; a process without the ASan
runtime refuses an ASan build before compiling it; and under the launcher a deliberate
out-of-bounds read or undefined shift (``SANITIZER_BUGS``, tests/templates/sanitizer_bugs.cpp.jinja)
ends the process with the sanitizer's report, so a sanitized run with a report can never pass.
The sanitized runs are child processes (the ASan runtime must be preloaded at process start).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import kernforge
from kernforge import sanitize
from kernforge.cache import disk
from kernforge.jit import compiler, core

from conftest import TEST_TEMPLATES, TESTS_DIR, clean_env
from kernels import AXPY

pytestmark = pytest.mark.usefixtures("test_templates")

CHILD_TIMEOUT = 300


def axpy_spec(tier="generic") -> core.KernelSpec:
    return core.KernelSpec.make(AXPY, {"dtype": "fp32"}, tier)


def key_of(spec: core.KernelSpec) -> str:
    return core._plan(spec).key


def run_axpy(kernel) -> None:
    x = (torch.arange(1003) % 17 - 8).float()
    y = (torch.arange(1003) % 5).float()
    expected = 3 * x + y
    assert kernel.run(x.data_ptr(), y.data_ptr(), x.numel(), 3.0) == x.numel()
    assert torch.equal(y, expected)


# --------------------------------------------------------------------------- the values


@pytest.mark.parametrize(
    ("env", "debug", "sanitizers", "extra", "tag"),
    [
        ({}, False, (), (), ""),
        ({"KERNFORGE_JIT_DEBUG": "1"}, True, (), (), "_debug"),
        ({"KERNFORGE_JIT_DEBUG": " Off "}, False, (), (), ""),
        ({"KERNFORGE_SANITIZE": "undefined, ADDRESS"}, False, ("address", "undefined"), (), "_asan-ubsan"),
        ({"KERNFORGE_SANITIZE": "undefined"}, False, ("undefined",), (), "_ubsan"),
        ({"KERNFORGE_SANITIZE": " , "}, False, (), (), ""),
        (
            {"KERNFORGE_EXTRA_CFLAGS": "-DKF_X='a b' -fno-math-errno"},
            False,
            (),
            ("-DKF_X=a b", "-fno-math-errno"),
            None,
        ),
        (
            {"KERNFORGE_JIT_DEBUG": "yes", "KERNFORGE_SANITIZE": "address"},
            True,
            ("address",),
            (),
            "_debug_asan",
        ),
    ],
)
def test_build_mode_from_the_environment(env, debug, sanitizers, extra, tag):
    mode = compiler.build_mode(env)
    assert (mode.debug, mode.sanitize, mode.extra) == (debug, sanitizers, extra)
    if tag is None:  # extra flags: a digest of them
        assert mode.tag.startswith("_cflags-") and len(mode.tag) == len("_cflags-") + 8
        assert compiler.build_mode({"KERNFORGE_EXTRA_CFLAGS": "-fno-math-errno"}).tag != mode.tag
    else:
        assert mode.tag == tag


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"KERNFORGE_SANITIZE": "address,thread"},
            r"KERNFORGE_SANITIZE=.*unknown sanitizer 'thread'.*address, undefined",
        ),
        ({"KERNFORGE_SANITIZE": "asan"}, r"KERNFORGE_SANITIZE=.*unknown sanitizer 'asan'"),
        ({"KERNFORGE_JIT_DEBUG": "2"}, r"KERNFORGE_JIT_DEBUG must be one of .*not '2'"),
        ({"KERNFORGE_EXTRA_CFLAGS": "-DX='unclosed"}, r"KERNFORGE_EXTRA_CFLAGS cannot be split"),
    ],
)
def test_invalid_build_mode_values_are_rejected(env, message):
    with pytest.raises(ValueError, match=message):
        compiler.build_mode(env)


def test_invalid_build_mode_fails_the_build_before_compiling(cache, monkeypatch):
    monkeypatch.setenv("KERNFORGE_SANITIZE", "memory")
    with pytest.raises(compiler.BuildModeError, match="KERNFORGE_SANITIZE"):
        core.build(axpy_spec())
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".")] == []


def test_flags_of_each_mode():
    release = compiler.BuildMode().flags()
    assert release == compiler.BASE_FLAGS
    debug = compiler.BuildMode(debug=True).flags()
    assert "-O0" in debug and "-g" in debug and not any(f.startswith("-O") and f != "-O0" for f in debug)
    sanitized = compiler.BuildMode(sanitize=("address", "undefined")).flags()
    assert [f for f in sanitized if f.startswith("-O")] == ["-O0"] and "-fsanitize=address,undefined" in sanitized
    assert "-fno-omit-frame-pointer" in sanitized and "-fno-sanitize-recover=all" in sanitized and "-g" in sanitized
    both = compiler.BuildMode(debug=True, sanitize=("undefined",)).flags()
    assert [f for f in both if f.startswith("-O")] == ["-O0"] and "-fsanitize=undefined" in both
    assert "-DKF_DEBUG=1" in both and "-DKF_DEBUG=1" not in sanitized
    command = compiler.build_command(
        ["g++"], ("-mavx2",), [], "s.cpp", "k.so", compiler.BuildMode(extra=("-mno-avx2",))
    )
    assert command[-5:] == ["-mavx2", "-mno-avx2", "s.cpp", "-o", "k.so"]  # after the tier's flags: it can override


# --------------------------------------------------------------------------- the key


def test_each_build_mode_is_its_own_key_with_its_tag(cache, monkeypatch):
    keys = {}
    for name, env in {
        "release": {},
        "debug": {"KERNFORGE_JIT_DEBUG": "1"},
        "asan": {"KERNFORGE_SANITIZE": "address"},
        "asan-ubsan": {"KERNFORGE_SANITIZE": "address,undefined"},
        "ubsan": {"KERNFORGE_SANITIZE": "undefined"},
        "extra": {"KERNFORGE_EXTRA_CFLAGS": "-fno-math-errno"},
    }.items():
        for var in ("KERNFORGE_JIT_DEBUG", "KERNFORGE_SANITIZE", "KERNFORGE_EXTRA_CFLAGS"):
            monkeypatch.delenv(var, raising=False)
        for var, value in env.items():
            monkeypatch.setenv(var, value)
        keys[name] = key_of(axpy_spec())
    assert len(set(keys.values())) == len(keys), keys
    prefixes = {name: key.rsplit("-", 1)[0] for name, key in keys.items()}
    assert prefixes["release"] == "axpy_dtype-fp32_generic"
    assert prefixes["debug"] == "axpy_dtype-fp32_generic_debug"
    assert prefixes["asan"] == "axpy_dtype-fp32_generic_asan"
    assert prefixes["asan-ubsan"] == "axpy_dtype-fp32_generic_asan-ubsan"
    assert prefixes["ubsan"] == "axpy_dtype-fp32_generic_ubsan"
    assert prefixes["extra"].startswith("axpy_dtype-fp32_generic_cflags-")


def test_empty_build_mode_variables_keep_the_release_key(cache, monkeypatch):
    release = key_of(axpy_spec())
    for var in ("KERNFORGE_JIT_DEBUG", "KERNFORGE_SANITIZE", "KERNFORGE_EXTRA_CFLAGS"):
        monkeypatch.setenv(var, "")
    monkeypatch.setenv("KERNFORGE_JIT_DEBUG", "0")
    assert key_of(axpy_spec()) == release


def test_debug_build_compiles_runs_and_records_its_mode(cache, monkeypatch):
    monkeypatch.setenv("KERNFORGE_JIT_DEBUG", "1")
    result, kernel = core.build(axpy_spec())
    assert result.compiled and result.key.rsplit("-", 1)[0].endswith("_debug")
    run_axpy(kernel)
    meta = disk.Entry(cache, result.key).trusted_meta()
    assert meta["build_mode"] == "debug"
    assert "-O0" in meta["command"] and "-O3" not in meta["command"] and "-g" in meta["command"]


def test_extra_cflags_reach_the_compiler(cache, monkeypatch):
    monkeypatch.setenv("KERNFORGE_EXTRA_CFLAGS", "-DKF_TEST_MARK=1 -fno-math-errno")
    result, kernel = core.build(axpy_spec())
    run_axpy(kernel)
    command = disk.Entry(cache, result.key).trusted_meta()["command"]
    at = command.index("-DKF_TEST_MARK=1")
    assert command[at + 1] == "-fno-math-errno" and at > command.index("-O3")  # after the other flags
    monkeypatch.setenv("KERNFORGE_EXTRA_CFLAGS", "-fno-such-flag-kernforge")
    with pytest.raises(kernforge.KernelCompileError, match="fno-such-flag-kernforge"):
        core.build(axpy_spec())


def test_release_entry_never_serves_a_sanitized_request_without_compiler(cache, monkeypatch, tmp_path):
    """KERNFORGE_JIT=0 on a machine without a compiler picks a cached entry by content: a release
    build must not stand in for a sanitized (or debug) one."""
    kernforge.prewarm([axpy_spec()], progress=False)
    empty_bin = tmp_path / "empty-bin"
    empty_bin.mkdir()
    monkeypatch.setenv("PATH", str(empty_bin))
    monkeypatch.setenv("KERNFORGE_JIT", "0")
    core.build(axpy_spec())  # the release request is served
    monkeypatch.setenv("KERNFORGE_JIT_DEBUG", "1")
    with pytest.raises(kernforge.KernelNotCachedError, match=r"axpy_dtype-fp32_generic_debug-\*"):
        core.build(axpy_spec())


# --------------------------------------------------------------------------- the ASan runtime


def test_asan_runtime_is_detected():
    probe = "from kernforge.jit import compiler; print(compiler.asan_runtime_loaded())"
    plain = subprocess.run([sys.executable, "-c", probe], env=clean_env(), capture_output=True, text=True)
    launched = subprocess.run(
        [sys.executable, "-m", "kernforge.sanitize", "-c", probe], env=clean_env(), capture_output=True, text=True
    )
    assert (plain.stdout.strip(), launched.stdout.strip()) == ("False", "True"), (plain.stderr, launched.stderr)


def test_asan_build_is_refused_without_the_runtime_before_compiling(cache, monkeypatch):
    monkeypatch.setattr(compiler, "asan_runtime_loaded", lambda: False)
    monkeypatch.setenv("KERNFORGE_SANITIZE", "address,undefined")
    with pytest.raises(compiler.BuildModeError, match=r"KERNFORGE_SANITIZE.*preloaded.*kernforge\.sanitize"):
        core.build(axpy_spec())
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".")] == [], "it compiled anyway"
    # prewarm (load=None) builds it for a sanitized process to load, without loading it here
    result, kernel = core.build(axpy_spec(), load=None, allow_compile=True)
    assert kernel is None and result.compiled
    assert disk.Entry(cache, result.key).trusted_meta()["build_mode"] == "asan-ubsan"


def test_ubsan_alone_needs_no_preloaded_runtime(cache, monkeypatch):
    monkeypatch.setenv("KERNFORGE_SANITIZE", "undefined")
    _, kernel = core.build(axpy_spec())
    run_axpy(kernel)


def test_compiler_runs_without_the_preloaded_runtime(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libasan.so.8 /opt/libkeep.so:/usr/lib/x86_64/libubsan.so.1")
    assert compiler.compiler_env()["LD_PRELOAD"] == "/opt/libkeep.so"
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libasan.so.8")
    assert "LD_PRELOAD" not in compiler.compiler_env()


# --------------------------------------------------------------------------- the launcher

# A child under the launcher: load SANITIZER_BUGS and call one entry as told; print what it returned.
BUGS_CHILD = r"""
import json, sys
args = json.loads(sys.argv[1])
import torch, kernforge
from kernforge.jit import core
sys.path.insert(0, args["tests"])
from kernels import SANITIZER_BUGS
kernforge.register_template_dir(args["templates"])
kernel = core.load_kernel(SANITIZER_BUGS, {}, "generic")
xs = torch.arange(1, 6, dtype=torch.int32)  # its own allocation, so past the end is a redzone
if args["call"] == "sum":
    value = kernel.sum(xs.data_ptr(), xs.numel(), args["past_end"])
else:
    value = kernel.shift(args["s"])
print("RESULT " + json.dumps(value), flush=True)
"""


def run_sanitized(cache, call: dict, sanitizers="address,undefined") -> subprocess.CompletedProcess:
    args = {"templates": str(TEST_TEMPLATES), "tests": str(TESTS_DIR), **call}
    return subprocess.run(
        [sys.executable, "-m", "kernforge.sanitize", "--sanitize", sanitizers, "-c", BUGS_CHILD, json.dumps(args)],
        env=clean_env(KERNFORGE_CACHE_DIR=cache, KERNFORGE_LOCK_TIMEOUT=120),
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
    )


def result_of(proc: subprocess.CompletedProcess):
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.slow  # child processes under ASan (each imports torch)
def test_launcher_runs_clean_kernels_and_reports_each_bug(cache):
    # clean calls pass, from the sanitized build's own key
    assert result_of(run_sanitized(cache, {"call": "sum", "past_end": 0})) == 15
    assert result_of(run_sanitized(cache, {"call": "shift", "s": 4})) == 16
    keys = [p.name for p in cache.iterdir() if p.name.startswith("sanitizer_bugs_")]
    assert len(keys) == 1 and keys[0].rsplit("-", 1)[0] == "sanitizer_bugs_generic_asan-ubsan", keys
    # one int32 past the end: ASan's report names the kernel's source line, and the process fails
    proc = run_sanitized(cache, {"call": "sum", "past_end": 1})
    assert proc.returncode != 0 and "RESULT" not in proc.stdout
    assert "AddressSanitizer: heap-buffer-overflow" in proc.stderr, proc.stderr
    assert "source.cpp" in proc.stderr or "module.cpp" in proc.stderr, proc.stderr
    # an undefined shift: UBSan's report, and the process fails (no recovery)
    proc = run_sanitized(cache, {"call": "shift", "s": 40})
    assert proc.returncode != 0 and "RESULT" not in proc.stdout
    assert "runtime error: shift exponent 40" in proc.stderr, proc.stderr


def test_launcher_environment(monkeypatch):
    monkeypatch.setenv("ASAN_OPTIONS", "detect_leaks=1")
    monkeypatch.setenv("LD_PRELOAD", "/opt/libkeep.so")
    env = sanitize.sanitizer_env("address,undefined")
    runtime = str(sanitize.asan_runtime())
    assert os.path.isfile(runtime) and "libasan" in runtime
    cxx = sanitize.cxx_runtime()
    assert cxx is not None and "libstdc++" in str(cxx)
    assert env["LD_PRELOAD"].split() == [runtime, str(cxx), "/opt/libkeep.so"]  # the runtimes first
    assert env["ASAN_OPTIONS"].endswith(":detect_leaks=1") and "abort_on_error=1" in env["ASAN_OPTIONS"]
    assert "halt_on_error=1" in env["UBSAN_OPTIONS"]
    assert env["KERNFORGE_SANITIZE"] == "address,undefined"
    ubsan = sanitize.sanitizer_env("undefined")
    assert ubsan["LD_PRELOAD"] == "/opt/libkeep.so" and ubsan["ASAN_OPTIONS"] == "detect_leaks=1"


def test_a_cpp_exception_caught_in_python_under_the_launcher():
    # torch raises RuntimeError through a C++ throw (a view that needs a copy); under ASan's preload
    # without the C++ runtime preloaded too, ASan's __cxa_throw interceptor found no real one and aborted
    code = "import torch\ntry:\n    torch.zeros(2, 3).t().view(6)\nexcept RuntimeError:\n    print('caught')"
    proc = subprocess.run(
        [sys.executable, "-m", "kernforge.sanitize", "-c", code], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "caught", proc.stderr[-3000:]


@pytest.mark.parametrize("value", ["thread", ","])
def test_launcher_rejects_bad_sanitizer_lists(value, capsys):
    assert sanitize.main(["--sanitize", value, "-c", "pass"]) == 2
    assert "KERNFORGE_SANITIZE" in capsys.readouterr().err


def test_launcher_print_env(capsys, monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert sanitize.main(["--sanitize=undefined", "--print-env"]) == 0
    out = capsys.readouterr().out
    assert "export KERNFORGE_SANITIZE=undefined" in out and "UBSAN_OPTIONS=" in out and "LD_PRELOAD" not in out
