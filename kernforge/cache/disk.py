"""The on-disk variant cache.

Layout: ``<root>/<key>/`` holds ``source.cpp`` (the rendered kernel), the
cffi wrapper (API mode), ``kernel.so``, ``build.log`` and ``meta.json``;
``<root>/.locks/<key>.lock`` are the per-key file locks (never deleted, so two
processes can never hold locks on different inodes of one name).

Trust rule: an entry is used only if ``meta.json`` names its key and the
``.so`` has exactly the size and SHA-256 recorded there. ``meta.json`` is
written last, after the ``.so`` has been atomically renamed into place, so a
killed compile, a truncated file or a half-copied cache is rebuilt, never
loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import filelock

from kernforge._version import __version__

_checked_roots: set[Path] = set()
_checked_lock = threading.Lock()


class CacheSecurityError(PermissionError):
    """The cache directory could be written by someone else: loading from it
    would run their code."""


class CacheWriteError(OSError):
    """The cache cannot take a new kernel (full disk, read-only directory, ...). What was
    there is unchanged; a half-written entry is never trusted."""


def write_error(root: Path, what: str, exc: OSError) -> CacheWriteError:
    """A CacheWriteError for ``exc`` (keeps its errno), saying what to do about it."""
    error = CacheWriteError(
        f"kernforge: cannot write {what} to the kernel cache {root}: {exc}. Free space there or point "
        "KERNFORGE_CACHE_DIR at a writable directory; a read-only cache serves only the kernels already in it "
        "(build them first with `python -m kernforge prewarm`)"
    )
    error.errno = exc.errno
    return error


def cache_root() -> Path:
    """``KERNFORGE_CACHE_DIR``, else ``$XDG_CACHE_HOME/kernforge/<version>``,
    else ``~/.cache/kernforge/<version>``; created 0700 and verified private."""
    explicit = os.environ.get("KERNFORGE_CACHE_DIR")
    if explicit:
        root = Path(explicit).expanduser()
        private_from = root
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
        root = base / "kernforge" / __version__
        private_from = base / "kernforge"
    root = root.absolute()
    if root not in _checked_roots:
        with _checked_lock:
            try:
                _make_private_dirs(private_from.absolute(), root)
            except OSError as exc:
                raise write_error(root, "the cache directory itself", exc) from exc
            check_private(root)
            _checked_roots.add(root)
    return root


def _make_private_dirs(first: Path, leaf: Path) -> None:
    """Create ``first`` .. ``leaf`` with mode 0700 (parents of ``first`` as usual)."""
    first.parent.mkdir(parents=True, exist_ok=True)
    for path in [leaf, *leaf.parents][::-1]:
        if path == first or first in path.parents:
            try:
                path.mkdir(mode=0o700)
            except FileExistsError:
                pass


def check_private(path: Path) -> None:
    st = path.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise CacheSecurityError(f"kernforge cache {path} is not a directory")
    if st.st_uid != os.geteuid():
        raise CacheSecurityError(
            f"refusing kernforge cache {path}: owned by uid {st.st_uid}, not by this user ({os.geteuid()}); "
            "loading its kernels would run another user's code. Set KERNFORGE_CACHE_DIR to a directory of your own."
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheSecurityError(
            f"refusing kernforge cache {path}: mode {stat.S_IMODE(st.st_mode):o} lets group or others write "
            f"kernels that this process would load. Fix with `chmod go-w {path}` or choose another "
            "KERNFORGE_CACHE_DIR."
        )


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)  # e.g. a full disk: leave no partial file behind
        raise


@dataclass(frozen=True)
class Entry:
    """One variant's folder in the cache."""

    root: Path
    key: str

    @property
    def dir(self) -> Path:
        return self.root / self.key

    source = property(lambda self: self.dir / "source.cpp")
    wrapper = property(lambda self: self.dir / "module.cpp")
    so = property(lambda self: self.dir / "kernel.so")
    log = property(lambda self: self.dir / "build.log")
    meta_path = property(lambda self: self.dir / "meta.json")

    def lock(self, timeout: float | None = None) -> filelock.FileLock:
        locks = self.root / ".locks"
        locks.mkdir(mode=0o700, exist_ok=True)
        if timeout is None:
            timeout = float(os.environ.get("KERNFORGE_LOCK_TIMEOUT", "600"))
        return filelock.FileLock(str(locks / f"{self.key}.lock"), timeout=timeout, thread_local=False)

    def trusted_meta(self) -> dict[str, Any] | None:
        """The metadata if the entry is complete and its .so is intact, else None."""
        try:
            meta = json.loads(self.meta_path.read_text())
            intact = (
                meta.get("key") == self.key
                and meta.get("kernforge_version") == __version__
                and self.so.stat().st_size == meta.get("so_size")
                and file_digest(self.so) == meta.get("so_sha256")
            )
        except (OSError, ValueError, AttributeError):
            return None
        return meta if intact else None

    def begin_build(self) -> None:
        """Under the lock: make the folder and drop what a dead build left."""
        self.dir.mkdir(mode=0o700, exist_ok=True)
        self.meta_path.unlink(missing_ok=True)  # untrusted from here until commit()
        for stale in self.dir.glob("*.tmp-*"):
            stale.unlink(missing_ok=True)

    def temp_so(self) -> Path:
        return self.dir / f"kernel.so.tmp-{os.getpid()}-{threading.get_ident()}"

    def commit(self, built_so: Path, meta: dict[str, Any]) -> dict[str, Any]:
        os.replace(built_so, self.so)
        try:
            meta = {
                **meta,
                "key": self.key,
                "kernforge_version": __version__,
                "so_size": self.so.stat().st_size,
                "so_sha256": file_digest(self.so),
            }
            _write_atomic(self.meta_path, json.dumps(meta, indent=1, sort_keys=True))
        except BaseException:
            self.so.unlink(missing_ok=True)  # untrusted without its metadata anyway: leave no stray kernel
            raise
        return meta

    def discard(self) -> None:
        self.meta_path.unlink(missing_ok=True)
        self.so.unlink(missing_ok=True)


def entries(root: Path | None = None) -> list[tuple[Entry, dict[str, Any] | None]]:
    """Every entry folder with its trusted metadata (None if incomplete)."""
    root = root or cache_root()
    found = []
    for path in sorted(root.iterdir()):
        if path.is_dir() and not path.name.startswith("."):
            entry = Entry(root, path.name)
            found.append((entry, entry.trusted_meta()))
    return found


def entries_with_prefix(root: Path, prefix: str) -> list[Entry]:
    """Entries whose key is ``<prefix>-<hash>`` (one per compiler that built it)."""
    return [Entry(root, p.name) for p in sorted(root.glob(f"{prefix}-*")) if p.name.rsplit("-", 1)[0] == prefix]


def size_bytes(root: Path | None = None) -> int:
    root = root or cache_root()
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def clear(root: Path | None = None) -> int:
    """Delete every entry (locks stay); returns how many were removed."""
    found = entries(root)
    for entry, _ in found:
        with entry.lock():
            shutil.rmtree(entry.dir, ignore_errors=True)
    return len(found)
