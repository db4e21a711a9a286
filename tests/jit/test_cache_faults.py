"""The JIT cache under faults: a full disk, a read-only cache directory, a compiler missing from
PATH, ``KERNFORGE_JIT=0`` with a missing variant. Each must give a clear error and leave nothing
that a later run would trust (races and killed compiles: test_jit_cache.py).

Faults are real where an unprivileged test can make them: a compiler whose output hits a file-size
limit (``ulimit -f``: the kernel refuses the write, as a full disk does), a cache directory without
write permission in a child process (for root, which writes anywhere, the child first drops
CAP_DAC_OVERRIDE). ``ENOSPC`` in kernforge's own writes (source, wrapper, metadata, lock) is
injected at the one call that writes each file.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import kernforge
from kernforge.cache import disk
from kernforge.jit import core, loader

from conftest import TEST_TEMPLATES, TESTS_DIR, clean_env
from kernels import AXPY

pytestmark = pytest.mark.usefixtures("test_templates")


def axpy_spec(dtype="fp32") -> core.KernelSpec:
    return core.KernelSpec.make(AXPY, {"dtype": dtype}, "generic")


def entry_names(root: pathlib.Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not p.name.startswith("."))


def assert_nothing_trusted(root: pathlib.Path) -> None:
    """No entry is trusted, and no entry holds a kernel.so or a temp file."""
    for name in entry_names(root):
        entry = disk.Entry(root, name)
        assert entry.trusted_meta() is None, f"{name} is trusted after a failed build"
        assert not entry.so.exists(), f"{name} has a kernel.so after a failed build"
        left = [p.name for p in entry.dir.iterdir() if ".tmp-" in p.name]
        assert not left, f"temp files left in {name}: {left}"


def run_axpy(kernel) -> None:
    import torch

    x, y = torch.arange(10.0), torch.ones(10)
    assert kernel.run(x.data_ptr(), y.data_ptr(), 10, 2.0) == 10
    assert torch.equal(y, 2 * torch.arange(10.0) + 1)


# --------------------------------------------------------------------------- a full disk


def test_compiler_output_refused_by_the_kernel_is_a_compile_error_leaving_nothing(cache, monkeypatch):
    """The compiler's writes hit a 4 KiB file-size limit (as on a full disk): KernelCompileError with
    the compiler's own words, and no kernel.so, temp file or metadata left."""
    gxx = shutil.which("g++")
    monkeypatch.setenv("KERNFORGE_CXX", f"sh -c 'ulimit -f 8; exec {gxx} \"$@\"' g++")
    with pytest.raises(kernforge.KernelCompileError) as info:
        core.build(axpy_spec())
    assert "File size limit exceeded" in info.value.output or "signal" in info.value.output, info.value.output
    assert_nothing_trusted(cache)


class _FullDiskOs:
    """``os`` for kernforge.cache.disk alone, with ``fdopen`` (how meta.json is written) failing."""

    def __init__(self, fdopen):
        self.fdopen = fdopen

    def __getattr__(self, name):
        return getattr(os, name)


@pytest.mark.parametrize("stage", ["source", "wrapper", "log", "metadata"])
def test_full_disk_while_writing_the_entry(cache, monkeypatch, stage):
    """ENOSPC in each file kernforge writes: a CacheWriteError (an OSError with errno ENOSPC) naming
    the cache, KERNFORGE_CACHE_DIR and prewarm; nothing trusted; the next build, with space again,
    builds and loads the same key."""
    key = core._plan(axpy_spec()).key
    full = OSError(errno.ENOSPC, "No space left on device")
    real_write_text = pathlib.Path.write_text

    def write_text(path, *args, **kwargs):
        if path.name == {"source": "source.cpp", "log": "build.log"}.get(stage):
            real_write_text(path, "partial")  # what a full disk leaves: a truncated file
            raise full
        return real_write_text(path, *args, **kwargs)

    def failing(*args, **kwargs):
        raise full

    with monkeypatch.context() as patches:
        patches.setattr(pathlib.Path, "write_text", write_text)
        if stage == "wrapper":
            patches.setattr(loader, "write_api_wrapper", failing)
        if stage == "metadata":
            patches.setattr(disk, "os", _FullDiskOs(failing))
        with pytest.raises(disk.CacheWriteError) as info:
            core.build(axpy_spec())
    message = str(info.value)
    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
    assert str(cache) in message and key in message and "No space left on device" in message
    assert "KERNFORGE_CACHE_DIR" in message and "prewarm" in message
    assert_nothing_trusted(cache)
    result, kernel = core.build(axpy_spec())
    assert result.compiled and result.key == key
    run_axpy(kernel)


def test_full_disk_when_creating_the_cache_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNFORGE_CACHE_DIR", str(tmp_path / "new-cache"))

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "mkdir", full)
    with pytest.raises(disk.CacheWriteError, match=r"cannot write the cache directory itself.*No space left"):
        disk.cache_root()


# --------------------------------------------------------------------------- a read-only cache


def _without_dac_override() -> None:
    """In the child before exec: root drops the capability to write where the mode says no."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
            if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


READ_ONLY_CHILD = r"""
import json, os, sys
args = json.loads(sys.argv[1])
sys.path.insert(0, args["tests"])
import kernforge
from kernforge.jit import core
from kernels import AXPY
kernforge.register_template_dir(args["templates"])
result = {"can_write": os.access(os.environ["KERNFORGE_CACHE_DIR"], os.W_OK)}
for dtype in ("fp32", "fp64"):
    try:
        kernel = core.load_kernel(AXPY, {"dtype": dtype}, "generic")
        result[dtype] = "loaded"
    except Exception as exc:
        result[dtype] = {"error": type(exc).__name__, "message": str(exc), "errno": getattr(exc, "errno", None)}
print("RESULT " + json.dumps(result), flush=True)
"""


@pytest.mark.slow  # child processes (each imports torch)
@pytest.mark.parametrize("jit", ["1", "0"])
def test_read_only_cache_serves_what_it_has_and_refuses_clearly(cache, jit):
    """A pre-warmed cache made read-only (a deployment image): its kernels load, with no lock or
    write; a variant it lacks is a clear error (CacheWriteError, or KernelNotCachedError with
    KERNFORGE_JIT=0), and the cache is byte-for-byte what it was."""
    kernforge.prewarm([axpy_spec("fp32"), core.KernelSpec.make(core.CPU_PROBE, {}, "generic")], progress=False)
    before = {p: p.read_bytes() for p in cache.rglob("*") if p.is_file()}
    modes = {p: p.stat().st_mode for p in [cache, *cache.rglob("*")] if p.is_dir()}
    for path in modes:
        path.chmod(0o500)
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                READ_ONLY_CHILD,
                json.dumps({"tests": str(TESTS_DIR), "templates": str(TEST_TEMPLATES)}),
            ],
            env=clean_env(KERNFORGE_CACHE_DIR=cache, KERNFORGE_LOCK_TIMEOUT=30, KERNFORGE_JIT=jit),
            capture_output=True,
            text=True,
            timeout=180,
            preexec_fn=_without_dac_override,
        )
    finally:
        for path, mode in modes.items():
            path.chmod(mode)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["can_write"] is False, "the child could still write the cache: the test proves nothing"
    assert result["fp32"] == "loaded", result
    missing = result["fp64"]
    if jit == "0":
        assert missing["error"] == "KernelNotCachedError", missing
    else:
        assert missing["error"] == "CacheWriteError", missing
        assert missing["errno"] in (errno.EACCES, errno.EROFS, errno.EPERM), missing
        assert str(cache) in missing["message"] and "KERNFORGE_CACHE_DIR" in missing["message"], missing
    assert "compiling" not in proc.stderr
    after = {p: p.read_bytes() for p in cache.rglob("*") if p.is_file()}
    assert after == before, "the read-only cache changed"


# --------------------------------------------------------------------------- no compiler, no JIT


def test_compiler_missing_from_path_leaves_nothing(cache, monkeypatch, tmp_path):
    empty_bin = tmp_path / "empty-bin"
    empty_bin.mkdir()
    monkeypatch.setenv("PATH", str(empty_bin))
    with pytest.raises(kernforge.CompilerNotFoundError, match=r"looked for g\+\+ on PATH.*prewarm"):
        core.build(axpy_spec())
    assert entry_names(cache) == []


def test_compiler_vanishing_between_key_and_compile_leaves_nothing(cache, monkeypatch, tmp_path):
    """The compiler found for the key is gone when the compile starts (uninstalled meanwhile)."""
    gxx = tmp_path / "bin" / "g++"
    gxx.parent.mkdir()
    gxx.symlink_to(shutil.which("g++"))
    monkeypatch.setenv("KERNFORGE_CXX", str(gxx))
    plan = core._plan(axpy_spec())
    gxx.unlink()
    monkeypatch.setattr(core, "_plan", lambda spec: plan)
    with pytest.raises(kernforge.CompilerNotFoundError, match="cannot run the C\\+\\+ compiler"):
        core.build(axpy_spec())
    assert_nothing_trusted(cache)


def test_jit_disabled_missing_variant_leaves_nothing(cache, monkeypatch):
    kernforge.prewarm([axpy_spec("fp32")], progress=False)
    before = entry_names(cache)
    monkeypatch.setenv("KERNFORGE_JIT", "0")
    with pytest.raises(kernforge.KernelNotCachedError, match=r"axpy_dtype-fp64_generic-.*KERNFORGE_JIT=0.*prewarm"):
        core.build(axpy_spec("fp64"))
    assert entry_names(cache) == before
