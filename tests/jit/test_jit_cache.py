"""The JIT pipeline and the on-disk variant cache.

Everything here runs the tiny self-contained module ``AXPY`` (tests/kernels.py, template
``tests/templates/axpy.cpp.jinja``: ``y = a*x + y`` over raw addresses), never the op
kernels, so these tests keep working while the norm/activation kernels change.

Each test that touches the cache gets its own fresh 0700 ``KERNFORGE_CACHE_DIR``
(the ``cache`` fixture). The in-process memo (``core._memo``) would hide the disk
from a second in-process call, so cross-process behaviour runs real child
processes (``sys.executable -c CHILD``) and counts the ``kernforge: compiling
<key> ...`` lines in their stderr; in-process checks call ``core.build`` directly
(it never consults the memo) and read ``BuildResult.compiled``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import kernforge
from kernforge.cache import disk
from kernforge.jit import Bool, Entry, Enum, Int, Module, Struct, compiler, core, loader, render

from conftest import TEST_TEMPLATES, TESTS_DIR, clean_env
from kernels import AXPY, BROKEN

CHILD_TIMEOUT = 180
_COMPILING = re.compile(r"^kernforge: compiling (\S+) \.\.\.$", re.MULTILINE)


# --------------------------------------------------------------------------- fixtures and helpers


pytestmark = pytest.mark.usefixtures("test_templates")


def axpy_spec(dtype="fp32", tier="generic") -> core.KernelSpec:
    return core.KernelSpec.make(AXPY, {"dtype": dtype}, tier)


def key_of(spec: core.KernelSpec) -> str:
    return core._plan(spec).key


_TORCH_DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "i64": torch.int64}


def axpy_inputs(dtype="fp32", n=1003):
    """x, y and the exact expected y after ``y = 3*x + y`` (all values exactly representable)."""
    t = _TORCH_DTYPES[dtype]
    x = (torch.arange(n) % 17 - 8).to(t)
    y = (torch.arange(n) % 5).to(t)
    return x, y, 3 * x + y


def run_axpy(kernel, dtype="fp32"):
    x, y, expected = axpy_inputs(dtype)
    assert kernel.run(x.data_ptr(), y.data_ptr(), x.numel(), 3.0) == x.numel()
    assert torch.equal(y, expected), f"axpy {dtype}: got {y[:8].tolist()}, expected {expected[:8].tolist()}"
    return y


# A child process: register the test templates, optionally wait on a barrier, load the axpy
# kernel through load_kernel, run it on torch tensors and report one JSON line.
CHILD = r"""
import json, os, sys, time
args = json.loads(sys.argv[1])
import torch
import kernforge
from kernforge.jit import core
sys.path.insert(0, args["tests"])
from kernels import AXPY
kernforge.register_template_dir(args["templates"])
if "ready" in args:  # barrier: announce we are imported, wait for the go file
    open(args["ready"], "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(args["go"]):
        if time.monotonic() > deadline:
            sys.exit("child: timed out waiting for the go file")
        time.sleep(0.002)
dtype, tier = args.get("dtype", "fp32"), args.get("tier", "generic")
tdtype = {"fp32": torch.float32, "fp64": torch.float64, "i64": torch.int64}[dtype]
n = 1003
x = (torch.arange(n) % 17 - 8).to(tdtype)
y = (torch.arange(n) % 5).to(tdtype)
expected = 3 * x + y
result = {}
try:
    spec = core.KernelSpec.make(AXPY, {"dtype": dtype}, tier)
    kernel = core.load_kernel(spec.module, dict(spec.params), spec.tier)
    result["ret"] = kernel.run(x.data_ptr(), y.data_ptr(), n, 3.0)
    result["ok"] = bool(torch.equal(y, expected))
    result["y"] = y[:16].tolist()
    result["key"] = core._plan(spec).key
except Exception as exc:
    result["error"] = type(exc).__name__
    result["message"] = str(exc)
root = os.environ["KERNFORGE_CACHE_DIR"]
with open("/proc/self/maps") as maps:
    result["mapped_from_cache"] = sorted({line.split()[-1] for line in maps if root in line})
print("RESULT " + json.dumps(result), flush=True)
"""


def child_env(cache_root: Path, **extra) -> dict:
    # KERNFORGE_LOCK_TIMEOUT: a leaked lock fails the test instead of hanging it
    return clean_env(KERNFORGE_CACHE_DIR=cache_root, KERNFORGE_LOCK_TIMEOUT=120, **extra)


def start_child(cache_root: Path, args: dict | None = None, **env) -> subprocess.Popen:
    args = {"templates": str(TEST_TEMPLATES), "tests": str(TESTS_DIR), **(args or {})}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(args)],
        env=child_env(cache_root, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish_child(proc: subprocess.Popen) -> tuple[dict, str]:
    """(the child's RESULT dict, its stderr); fails the test if the child crashed."""
    try:
        out, err = proc.communicate(timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"child timed out\nstdout:\n{out}\nstderr:\n{err}")
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"child failed (rc {proc.returncode})\nstdout:\n{out}\nstderr:\n{err}"
    return json.loads(lines[-1][len("RESULT ") :]), err


def run_child(cache_root: Path, args: dict | None = None, **env) -> tuple[dict, str]:
    return finish_child(start_child(cache_root, args, **env))


def compiles(stderr: str, key_prefix: str = "axpy_") -> list[str]:
    """Keys of the ``kernforge: compiling <key> ...`` lines for our template."""
    return [k for k in _COMPILING.findall(stderr) if k.startswith(key_prefix)]


def assert_child_ok(result: dict, stderr: str) -> None:
    assert "error" not in result, f"child raised {result.get('error')}: {result.get('message')}\nstderr:\n{stderr}"
    assert result["ok"] and result["ret"] == 1003, f"wrong result {result}\nstderr:\n{stderr}"


def assert_trusted(root: Path, key: str) -> dict:
    entry = disk.Entry(root, key)
    meta = entry.trusted_meta()
    assert meta is not None, f"entry {key} is not trusted; files: {sorted(p.name for p in entry.dir.iterdir())}"
    assert meta["so_size"] == entry.so.stat().st_size
    assert meta["so_sha256"] == disk.file_digest(entry.so)
    assert not list(entry.dir.glob("*.tmp-*")), f"leftover temp files in {entry.dir}"
    return meta


# --------------------------------------------------------------------------- 1. second process


@pytest.mark.slow  # child processes (each imports torch)
def test_second_process_loads_from_cache_without_compiling(cache):
    spec = axpy_spec()
    result, fn = core.build(spec)
    assert result.compiled and result.path == cache / result.key
    run_axpy(fn)
    entry = disk.Entry(cache, result.key)
    for f in (entry.source, entry.so, entry.log, entry.meta_path):
        assert f.is_file(), f"{f.name} missing from the cache entry"
    assert_trusted(cache, result.key)

    child, err = run_child(cache)
    assert_child_ok(child, err)
    assert child["key"] == result.key, "the key is not stable across processes"
    assert compiles(err) == [], f"the second process compiled again:\n{err}"


def test_in_process_second_build_does_not_compile(cache):
    first, _ = core.build(axpy_spec("fp64"), load=False)
    second, fn = core.build(axpy_spec("fp64"))
    assert first.compiled and not second.compiled
    assert first.key == second.key
    run_axpy(fn, "fp64")


def test_load_kernel_memoizes_in_process(cache):
    fn = core.load_kernel(AXPY, {"dtype": "i64"}, "generic")
    assert core.load_kernel(AXPY, {"dtype": "i64"}, "generic") is fn
    run_axpy(fn, "i64")


# --------------------------------------------------------------------------- 2. racing processes


@pytest.mark.slow  # child processes (each imports torch)
def test_racing_processes_compile_exactly_once(cache, tmp_path):
    n = 4
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    go = barrier / "go"
    procs = [
        start_child(cache, {"ready": str(barrier / f"ready-{i}"), "go": str(go), "dtype": "fp32"}) for i in range(n)
    ]
    try:
        deadline = time.monotonic() + CHILD_TIMEOUT
        while len(list(barrier.glob("ready-*"))) < n:
            dead = [p for p in procs if p.poll() is not None]
            assert not dead, f"a child died before the barrier: {dead[0].communicate()}"
            assert time.monotonic() < deadline, "children never reached the barrier"
            time.sleep(0.01)
        go.touch()
        results = [finish_child(p) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    keys = set()
    all_compiles = []
    for result, err in results:
        assert_child_ok(result, err)
        keys.add(result["key"])
        all_compiles += compiles(err)
    assert len(keys) == 1
    assert all_compiles == [keys.pop()], (
        f"expected exactly one compile across {n} racing processes, got {len(all_compiles)}:\n"
        + "\n---\n".join(err for _, err in results)
    )
    assert len(set(json.dumps(r["y"]) for r, _ in results)) == 1
    assert_trusted(cache, results[0][0]["key"])


# --------------------------------------------------------------------------- 3. killed mid-compile


def _stalling_compiler(tmp_path: Path) -> Path:
    """A compiler wrapper. With KF_TEST_STALL_DIR set it really compiles, then also plants the
    complete output as kernel.so (as if the rename had happened but meta.json was never written),
    touches $KF_TEST_STALL_DIR/started and hangs; otherwise it is plain g++."""
    gxx = shutil.which("g++")
    assert gxx, "these tests need g++"
    script = tmp_path / "stalling-g++"
    script.write_text(f"""#!/bin/sh
if [ "$1" = "--version" ] || [ -z "$KF_TEST_STALL_DIR" ]; then exec {shlex.quote(gxx)} "$@"; fi
out=""; prev=""
for arg in "$@"; do [ "$prev" = "-o" ] && out="$arg"; prev="$arg"; done
{shlex.quote(gxx)} "$@" || exit 1
cp "$out" "$(dirname "$out")/kernel.so"
: > "$KF_TEST_STALL_DIR/started"
exec sleep 300
""")
    script.chmod(0o755)
    return script


@pytest.mark.slow  # child processes (each imports torch)
def test_process_killed_mid_compile_leaves_nothing_trusted(cache, tmp_path, monkeypatch):
    cxx = _stalling_compiler(tmp_path)
    stall = tmp_path / "stall"
    stall.mkdir()
    proc = start_child(cache, KERNFORGE_CXX=cxx, KF_TEST_STALL_DIR=stall)
    try:
        deadline = time.monotonic() + CHILD_TIMEOUT
        while not (stall / "started").exists():
            assert proc.poll() is None, f"child exited before the compile stalled: {proc.communicate()}"
            assert time.monotonic() < deadline, "the compile never started"
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the Python process, the wrapper and its sleep
        proc.communicate()

    monkeypatch.setenv("KERNFORGE_CXX", str(cxx))  # same compiler command, so the same key
    spec = axpy_spec()
    key = key_of(spec)
    entry = disk.Entry(cache, key)
    assert entry.dir.is_dir(), f"the killed build left no entry for {key}: {list(cache.iterdir())}"
    assert entry.so.is_file() and list(entry.dir.glob("kernel.so.tmp-*")), "the stall did not happen mid-build"
    assert not entry.meta_path.exists(), "meta.json was written before the compile finished"
    assert entry.trusted_meta() is None

    result, fn = core.build(spec)  # the same compiler, no stall this time
    assert result.compiled, "a later call trusted what the killed compile left behind"
    run_axpy(fn)
    meta = assert_trusted(cache, key)
    assert meta["command"][0] == str(cxx)


# --------------------------------------------------------------------------- 4. damaged entries


@pytest.mark.slow  # child processes (each imports torch)
def test_truncated_so_is_rebuilt_by_a_new_process(cache):
    result, _ = core.build(axpy_spec(), load=False)
    entry = disk.Entry(cache, result.key)
    size = entry.so.stat().st_size
    os.truncate(entry.so, size // 2)

    child, err = run_child(cache)
    assert_child_ok(child, err)
    assert compiles(err) == [result.key], f"the truncated .so was not rebuilt exactly once:\n{err}"
    assert_trusted(cache, result.key)
    assert entry.so.stat().st_size == size


def _flip_byte(so: Path) -> None:
    data = bytearray(so.read_bytes())
    data[len(data) // 2] ^= 0xFF
    so.write_bytes(bytes(data))


def _edit_meta(**changes):
    def edit(entry: disk.Entry) -> None:
        meta = json.loads(entry.meta_path.read_text())
        meta.update(changes)
        entry.meta_path.write_text(json.dumps(meta))

    return edit


DAMAGE = {
    "so_truncated": lambda e: os.truncate(e.so, e.so.stat().st_size // 2),
    "so_empty": lambda e: os.truncate(e.so, 0),
    "so_byte_flipped": lambda e: _flip_byte(e.so),
    "so_missing": lambda e: e.so.unlink(),
    "meta_missing": lambda e: e.meta_path.unlink(),
    "meta_not_json": lambda e: e.meta_path.write_text('{"key": '),
    "meta_not_an_object": lambda e: e.meta_path.write_text("[1, 2, 3]"),
    "meta_wrong_key": _edit_meta(key="axpy_dtype-fp32_generic-00000000000000000000"),
    "meta_wrong_sha": _edit_meta(so_sha256="0" * 64),
    "meta_wrong_size": _edit_meta(so_size=1),
    "meta_other_kernforge_version": _edit_meta(kernforge_version="0.0.0+other"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_entry_is_not_trusted_and_is_rebuilt(cache, monkeypatch, damage):
    monkeypatch.setenv("KERNFORGE_CFFI_MODE", "abi")  # the trust rule is the same in both modes; abi builds faster
    spec = axpy_spec()
    first, _ = core.build(spec, load=False)
    entry = disk.Entry(cache, first.key)
    assert entry.trusted_meta() is not None
    DAMAGE[damage](entry)
    assert entry.trusted_meta() is None, f"{damage}: the damaged entry is still trusted"

    second, fn = core.build(spec)
    assert second.compiled, f"{damage}: the damaged entry was used instead of rebuilt"
    run_axpy(fn)
    assert_trusted(cache, first.key)
    third, _ = core.build(spec, load=False)
    assert not third.compiled


def test_stale_temp_files_are_dropped_by_the_next_build(cache):
    spec = axpy_spec()
    key = key_of(spec)
    entry = disk.Entry(cache, key)
    entry.dir.mkdir(mode=0o700)
    shutil.copy(Path(sys.executable).resolve(), entry.dir / "kernel.so.tmp-999999-1")  # junk, not a kernel
    (entry.dir / "meta.json.tmp-abc").write_text("{}")
    result, fn = core.build(spec)
    assert result.compiled
    run_axpy(fn)
    assert_trusted(cache, key)


# --------------------------------------------------------------------------- 5. KERNFORGE_JIT=0


@pytest.mark.parametrize("value", ["0", "false", "OFF", " no "])
def test_jit_disabled_values(monkeypatch, value):
    monkeypatch.setenv("KERNFORGE_JIT", value)
    assert not core.jit_enabled()


@pytest.mark.parametrize("value", ["1", "true", ""])
def test_jit_enabled_values(monkeypatch, value):
    monkeypatch.setenv("KERNFORGE_JIT", value)
    assert core.jit_enabled()


def test_jit_disabled_with_empty_cache_raises_not_cached(cache, monkeypatch):
    monkeypatch.setenv("KERNFORGE_JIT", "0")
    spec = axpy_spec()
    key = key_of(spec)
    with pytest.raises(kernforge.KernelNotCachedError) as info:
        core.load_kernel(AXPY, {"dtype": "fp32"}, "generic")
    message = str(info.value)
    assert key in message
    assert "prewarm" in message
    assert "python -m kernforge prewarm --module axpy --template-dir" in message
    assert "--param dtype=fp32 --isa generic" in message
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".")] == [], "JIT=0 wrote a cache entry"


def test_jit_disabled_loads_a_prewarmed_variant(cache, monkeypatch):
    spec = axpy_spec()
    (built,) = kernforge.prewarm([spec], progress=False)
    assert built.compiled
    monkeypatch.setenv("KERNFORGE_JIT", "0")
    result, fn = core.build(spec)
    assert not result.compiled and result.key == built.key
    run_axpy(fn)


@pytest.mark.slow  # a child process (imports torch)
def test_jit_disabled_new_process_loads_a_prewarmed_variant(cache):
    """A new process with JIT=0 loads a prewarmed variant too, without compiling."""
    kernforge.prewarm([axpy_spec()], progress=False)
    child, err = run_child(cache, KERNFORGE_JIT="0")
    assert_child_ok(child, err)
    assert compiles(err) == []


def test_jit_disabled_prewarmed_cache_needs_no_compiler(cache, monkeypatch, tmp_path):
    spec = axpy_spec()
    kernforge.prewarm([spec], progress=False)
    empty_bin = tmp_path / "empty-bin"
    empty_bin.mkdir()
    monkeypatch.setenv("PATH", str(empty_bin))  # deployment image: no g++
    monkeypatch.setenv("KERNFORGE_JIT", "0")
    result, fn = core.build(spec)
    assert not result.compiled
    run_axpy(fn)


# --------------------------------------------------------------------------- 6. compile errors


@pytest.mark.parametrize("mode", ["api", "abi"])
def test_broken_template_raises_compile_error_with_details(cache, monkeypatch, mode):
    monkeypatch.setenv("KERNFORGE_CFFI_MODE", mode)
    spec = core.KernelSpec.make(BROKEN, {}, "generic")
    key = key_of(spec)
    with pytest.raises(kernforge.KernelCompileError) as info:
        core.build(spec)
    exc = info.value
    message = str(exc)
    # the compiler's own diagnostic, verbatim
    assert "kf_undeclared_identifier_generic" in exc.output
    assert re.search(r"error: .*kf_undeclared_identifier_generic.* not declared", exc.output), exc.output
    assert "not declared" in message and "kf_undeclared_identifier_generic" in message
    # the command
    assert exc.command[0] == shutil.which("g++")
    assert shlex.join(exc.command) in message
    assert "-shared" in exc.command and "-o" in exc.command
    # the rendered source, on disk
    assert exc.key == key and key in message
    assert isinstance(exc.source, Path) and exc.source.is_file()
    assert str(exc.source) in message
    assert "kf_undeclared_identifier_generic" in exc.source.read_text()
    entry = disk.Entry(cache, key)
    assert "kf_undeclared_identifier_generic" in entry.log.read_text()
    # nothing trusted, nothing half-built left, and the next call fails the same way
    assert entry.trusted_meta() is None and not entry.so.exists() and not list(entry.dir.glob("*.tmp-*"))
    with pytest.raises(kernforge.KernelCompileError):
        core.build(spec)


@pytest.mark.parametrize("mode", ["api", "abi"])
def test_template_without_its_entry_declaration_is_a_clear_error(
    cache, tmp_path, user_template_dirs, monkeypatch, mode
):
    monkeypatch.setenv("KERNFORGE_CFFI_MODE", mode)
    (tmp_path / "nodecl.cpp.jinja").write_text("int x;\n")
    kernforge.register_template_dir(tmp_path)
    nodecl = Module(
        "nodecl", "nodecl.cpp.jinja", params={}, entries=[Entry("run", "int64_t n", returns="int64_t")], register=False
    )
    with pytest.raises(ValueError, match=r"nodecl.cpp.jinja.*does not define entry 'run'.*decl\.run"):
        core.build(core.KernelSpec.make(nodecl, {}, "generic"))
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".")] == [], "nothing should be compiled"


def test_unknown_template_is_a_clear_error(cache):
    missing = Module(
        "missing", "no_such_template.cpp.jinja", params={}, entries=[Entry("run", "int64_t n")], register=False
    )
    with pytest.raises(ValueError, match="no_such_template.cpp.jinja.*not found"):
        core.build(core.KernelSpec.make(missing, {}, "generic"))


# --------------------------------------------------------------------------- 7. the compiler


@pytest.mark.slow  # child processes (each imports torch)
def test_missing_compiler_in_new_process(cache):
    child, err = run_child(cache, KERNFORGE_CXX="/nonexistent/g++")
    assert child.get("error") == "CompilerNotFoundError", child
    assert "/nonexistent/g++" in child["message"]
    assert "KERNFORGE_CXX" in child["message"]
    assert "C++ compiler" in child["message"]
    assert compiles(err) == []


def test_no_compiler_on_path(cache, monkeypatch, tmp_path):
    empty_bin = tmp_path / "empty-bin"
    empty_bin.mkdir()
    monkeypatch.setenv("PATH", str(empty_bin))
    with pytest.raises(kernforge.CompilerNotFoundError, match=r"looked for g\+\+ on PATH"):
        core.build(axpy_spec())


def test_compiler_whose_version_fails_is_reported(cache, monkeypatch):
    monkeypatch.setenv("KERNFORGE_CXX", shutil.which("false"))
    with pytest.raises(kernforge.CompilerNotFoundError, match="--version"):
        core.build(axpy_spec())


@pytest.mark.parametrize("var", ["CXX", "KERNFORGE_CXX"])
def test_compiler_value_with_arguments_works(cache, monkeypatch, var):
    monkeypatch.setenv(var, "g++ -g0")
    result, fn = core.build(axpy_spec())
    assert result.compiled
    run_axpy(fn)
    command = assert_trusted(cache, result.key)["command"]
    assert command[0] == shutil.which("g++") and command[1] == "-g0"


def test_kernforge_cxx_takes_precedence_over_cxx(cache, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("KERNFORGE_CXX", "g++")
    assert compiler.compiler_argv() == [shutil.which("g++")]
    result, fn = core.build(axpy_spec())
    run_axpy(fn)


# --------------------------------------------------------------------------- 8. cache security


@pytest.mark.parametrize("mode", [0o770, 0o720, 0o707, 0o702, 0o777, 0o1777])
def test_group_or_other_writable_cache_is_refused(tmp_path, monkeypatch, mode):
    root = tmp_path / "shared-cache"
    root.mkdir()
    os.chmod(root, mode)
    monkeypatch.setenv("KERNFORGE_CACHE_DIR", str(root))
    monkeypatch.setattr(core, "_memo", {})
    with pytest.raises(disk.CacheSecurityError, match="group or others write") as info:
        disk.cache_root()
    assert str(root) in str(info.value) and "chmod go-w" in str(info.value)
    with pytest.raises(disk.CacheSecurityError):
        core.build(axpy_spec())
    assert list(root.iterdir()) == [], "kernforge wrote into a cache it refused"


@pytest.mark.slow  # child processes (each imports torch)
def test_shared_cache_refused_by_a_new_process_before_loading(cache):
    result, _ = core.build(axpy_spec(), load=False)  # a valid, trusted entry
    os.chmod(cache, 0o775)
    before = {p: p.stat().st_mtime_ns for p in cache.rglob("*")}
    child, err = run_child(cache)
    assert child.get("error") == "CacheSecurityError", child
    assert child["mapped_from_cache"] == [], f"a kernel was loaded from the refused cache: {child}"
    assert compiles(err) == []
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*")} == before


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the cache to another user")
def test_cache_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "their-cache"
    root.mkdir(mode=0o700)
    os.chown(root, 4242, -1)
    monkeypatch.setenv("KERNFORGE_CACHE_DIR", str(root))
    with pytest.raises(disk.CacheSecurityError, match="owned by uid 4242"):
        disk.cache_root()


def test_cache_dir_not_a_directory_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "a-file"
    path.write_text("")
    os.chmod(path, 0o600)
    monkeypatch.setenv("KERNFORGE_CACHE_DIR", str(path))
    with pytest.raises(disk.CacheSecurityError, match="not a directory"):
        disk.cache_root()


def test_default_cache_dir_is_created_private(tmp_path, monkeypatch):
    monkeypatch.delenv("KERNFORGE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    old = os.umask(0o002)  # a permissive umask must not make the cache group-writable
    try:
        root = disk.cache_root()
    finally:
        os.umask(old)
    assert root == tmp_path / "xdg" / "kernforge" / kernforge.__version__
    for path in (root, root.parent):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, f"{path} is {stat.S_IMODE(path.stat().st_mode):o}"


def test_new_explicit_cache_dir_is_created_private(tmp_path, monkeypatch):
    root = tmp_path / "new" / "cache"
    monkeypatch.setenv("KERNFORGE_CACHE_DIR", str(root))
    assert disk.cache_root() == root
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


# --------------------------------------------------------------------------- 9. the key


def _split(key: str) -> tuple[str, str]:
    prefix, digest = key.rsplit("-", 1)
    return prefix, digest


def test_key_is_readable_prefix_plus_hash():
    key = key_of(axpy_spec("fp32", "generic"))
    assert re.fullmatch(r"axpy_dtype-fp32_generic-[0-9a-f]{20}", key), key
    more = Module(
        "axpy",
        "axpy.cpp.jinja",
        params={"alpha": Int(), "dtype": Enum(("fp32", "fp64")), "zeta": Bool()},
        entries=AXPY.entries.values(),
        register=False,
    )
    spec = core.KernelSpec.make(more, {"zeta": True, "dtype": "fp64", "alpha": 3}, "avx2")
    assert spec.prefix() == "axpy_alpha-3_dtype-fp64_zeta-1_avx2"  # params in declaration order, bools as 0/1
    assert key_of(spec).startswith(spec.prefix() + "-")


def test_key_is_deterministic_and_depends_on_params():
    assert key_of(axpy_spec()) == key_of(axpy_spec())
    a, b = key_of(axpy_spec("fp32")), key_of(axpy_spec("fp64"))
    assert _split(a)[0] != _split(b)[0] and _split(a)[1] != _split(b)[1]


def test_key_changes_with_the_source(tmp_path, user_template_dirs):
    template = tmp_path / "keysrc.cpp.jinja"
    body = '#include <cstdint>\nextern "C" {{ decl.run }} { return n + ADDEND; }\n'
    template.write_text(body.replace("ADDEND", "1"))
    kernforge.register_template_dir(tmp_path)
    keysrc = Module(
        "keysrc", "keysrc.cpp.jinja", params={}, entries=[Entry("run", "int64_t n", returns="int64_t")], register=False
    )
    spec = core.KernelSpec.make(keysrc, {}, "generic")
    before = key_of(spec)
    template.write_text(body.replace("ADDEND", "2"))
    later = time.time() + 10
    os.utime(template, (later, later))  # a different mtime even on coarse-timestamp filesystems
    after = key_of(spec)
    assert _split(before)[0] == _split(after)[0] == "keysrc_generic"
    assert before != after, "editing the template did not change the key"


def _touch_later(path: Path, text: str) -> None:
    """Rewrite ``path`` with a later mtime (a change seen even on coarse-timestamp filesystems)."""
    later = path.stat().st_mtime + 10 if path.exists() else time.time() + 10
    path.write_text(text)
    os.utime(path, (later, later))


def test_key_changes_with_the_headers(tmp_path, user_template_dirs):
    """The key hashes exactly the headers the source includes, directly or not: editing one of
    them changes it; editing a header it does not include does not."""
    user = tmp_path / "hdr_kernels"
    headers = user / "include" / "keyhdr"
    headers.mkdir(parents=True)
    (headers / "used.h").write_text('#pragma once\n#include "inner.h"\nconstexpr int64_t kUsed = 1;\n')
    (headers / "inner.h").write_text("#pragma once\nconstexpr int64_t kInner = 2;\n")
    (headers / "unused.h").write_text("#pragma once\nconstexpr int64_t kUnused = 3;\n")
    (user / "keyhdr.cpp.jinja").write_text(
        '#include <cstdint>\n#include "keyhdr/used.h"\nextern "C" {{ decl.run }} { return n + kUsed + kInner; }\n'
    )
    kernforge.register_template_dir(user)
    keyhdr = Module(
        "keyhdr", "keyhdr.cpp.jinja", params={}, entries=[Entry("run", "int64_t n", returns="int64_t")], register=False
    )
    spec = core.KernelSpec.make(keyhdr, {}, "generic")
    source = render.render(keyhdr.template, spec.variables())
    assert [name for name, _ in render.included_headers(source)] == ["keyhdr/inner.h", "keyhdr/used.h"]

    before = key_of(spec)
    _touch_later(headers / "unused.h", "#pragma once\nconstexpr int64_t kUnused = 30;\n")
    assert key_of(spec) == before, "editing a header the source does not include changed the key"
    _touch_later(headers / "used.h", '#pragma once\n#include "inner.h"\nconstexpr int64_t kUsed = 10;\n')
    after_used = key_of(spec)
    assert after_used != before, "editing an included header did not change the key"
    _touch_later(headers / "inner.h", "#pragma once\nconstexpr int64_t kInner = 20;\n")
    assert key_of(spec) not in (before, after_used), "editing a header included by a header did not change the key"
    assert _split(key_of(spec))[0] == _split(before)[0] == "keyhdr_generic"
    # and the package headers, which this source does not include, are not in its key either
    assert render.included_headers(render.render(AXPY.template, axpy_spec().variables())) == []


def test_key_changes_with_the_tier():
    keys = {tier: key_of(axpy_spec(tier=tier)) for tier in ("generic", "avx2", "avx512", "amx")}
    assert len(set(keys.values())) == 4
    digests = {_split(k)[1] for k in keys.values()}
    assert len(digests) == 4, "different tier flags must give different hashes, not just prefixes"
    assert all(keys[t].startswith(f"axpy_dtype-fp32_{t}-") for t in keys)


def test_key_changes_with_a_compiler_flag(monkeypatch):
    before = key_of(axpy_spec())
    monkeypatch.setattr(compiler, "BASE_FLAGS", compiler.BASE_FLAGS + ("-fno-math-errno",))
    after = key_of(axpy_spec())
    assert _split(before)[0] == _split(after)[0]
    assert before != after


def test_key_changes_with_the_compiler_command(cache, monkeypatch):
    before = key_of(axpy_spec())
    monkeypatch.setenv("CXX", "g++ -g0")
    assert key_of(axpy_spec()) != before


def test_key_changes_with_the_compiler_version(monkeypatch):
    before = key_of(axpy_spec())
    monkeypatch.setattr(compiler, "compiler_version", lambda argv: "g++ (kernforge test) 99.9.9")
    after = key_of(axpy_spec())
    assert _split(before)[0] == _split(after)[0]
    assert before != after


def test_key_changes_with_the_kernforge_version(monkeypatch):
    before = key_of(axpy_spec())
    monkeypatch.setattr(core, "__version__", "999.0.0")
    after = key_of(axpy_spec())
    assert _split(before)[0] == _split(after)[0]
    assert before != after


def test_key_changes_with_the_cffi_mode(monkeypatch):
    monkeypatch.setenv("KERNFORGE_CFFI_MODE", "api")
    api = key_of(axpy_spec())
    monkeypatch.setenv("KERNFORGE_CFFI_MODE", "abi")
    assert key_of(axpy_spec()) != api


def test_unknown_tier_is_rejected():
    with pytest.raises(kernforge.IsaError, match="unknown ISA tier 'sse9'"):
        core.KernelSpec.make(AXPY, {"dtype": "fp32"}, "sse9")


# --------------------------------------------------------------------------- 11. cffi modes


@pytest.mark.slow  # child processes (each imports torch)
def test_both_cffi_modes_load_and_agree(cache):
    procs = {mode: start_child(cache, {"dtype": "fp32"}, KERNFORGE_CFFI_MODE=mode) for mode in ("api", "abi")}
    results = {mode: finish_child(p) for mode, p in procs.items()}
    for mode, (result, err) in results.items():
        assert_child_ok(result, err)
        assert compiles(err) == [result["key"]]
        meta = assert_trusted(cache, result["key"])
        assert meta["cffi_mode"] == mode
        assert disk.Entry(cache, result["key"]).wrapper.exists() == (mode == "api")
    (api, _), (abi, _) = results["api"], results["abi"]
    assert api["key"] != abi["key"]
    assert api["y"] == abi["y"]
    _, _, expected = axpy_inputs("fp32")
    assert api["y"] == expected[:16].tolist()


@pytest.mark.parametrize("mode", ["api", "abi"])
def test_struct_argument_in_both_cffi_modes(cache, tmp_path, user_template_dirs, monkeypatch, mode):
    """An entry taking a declared struct by pointer (``const S*``, as the C++ spells it) loads in
    both modes (cffi parses the cdef as C) and reads the fields set by name."""
    monkeypatch.setenv("KERNFORGE_CFFI_MODE", mode)
    (tmp_path / "structarg.cpp.jinja").write_text(
        "#include <cstdint>\n{{ abi_structs }}\n"
        'extern "C" __attribute__((visibility("default"))) {{ decl.run }} {\n'
        "  return args->n * 10 + static_cast<int64_t>(args->scale * 4);\n}\n"
    )
    kernforge.register_template_dir(tmp_path)
    structarg = Module(
        "structarg",
        "structarg.cpp.jinja",
        params={},
        structs=[Struct("structarg_args", (("n", "int64_t"), ("scale", "double")))],
        entries=[Entry("run", "const structarg_args* args", returns="int64_t")],
        register=False,
    )
    kernel = core.load_kernel(structarg, {}, "generic")
    assert kernel.run(kernel.new("structarg_args", {"n": 7, "scale": 0.75})) == 73


def test_invalid_cffi_mode_is_rejected(monkeypatch):
    monkeypatch.setenv("KERNFORGE_CFFI_MODE", "ctypes")
    with pytest.raises(ValueError, match="KERNFORGE_CFFI_MODE"):
        loader.cffi_mode()


# --------------------------------------------------------------------------- 13. user templates


def test_register_template_dir_with_a_user_template_and_header(cache, tmp_path, user_template_dirs):
    user = tmp_path / "my_kernels"
    (user / "include" / "my_kernels").mkdir(parents=True)
    (user / "include" / "my_kernels" / "scale.h").write_text(
        "#pragma once\nnamespace my_kernels { constexpr double kScale = 4.0; }\n"
    )
    (user / "user_scale.cpp.jinja").write_text(
        "#include <cstdint>\n"
        '#include "my_kernels/scale.h"\n'
        'extern "C" __attribute__((visibility("default"))) {{ decl.run }} {\n'
        "  double* xs = reinterpret_cast<double*>(x);\n"
        "  for (int64_t i = 0; i < n; ++i) xs[i] = my_kernels::kScale * xs[i] + {{ offset }};\n"
        "  return n;\n}\n"
    )
    generation = core._generation
    kernforge.register_template_dir(user)
    assert core._generation != generation, "registering a folder must re-resolve the ops' kernels"
    assert render.template_dirs()[0] == user.resolve()

    user_scale = Module(
        "user_scale",
        "user_scale.cpp.jinja",
        params={"offset": Int()},
        entries=[Entry("run", "int64_t x, int64_t n", returns="int64_t")],
        register=False,
    )
    kernel = core.load_kernel(user_scale, {"offset": 3}, "generic")
    x = torch.arange(10, dtype=torch.float64)
    assert kernel.run(x.data_ptr(), x.numel()) == 10
    assert torch.equal(x, 4.0 * torch.arange(10, dtype=torch.float64) + 3)
    (meta,) = [m for _, m in disk.entries(cache) if m and m["template"] == "user_scale.cpp.jinja"]
    assert f"-I{user.resolve() / 'include'}" in meta["command"]


def test_register_missing_template_dir_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        kernforge.register_template_dir(tmp_path / "nope")
