"""Render kernel templates, and find the headers a rendered source includes.

A template emits the C++ config block and the exported entry points, whose
declarations come from its module's declaration (``{{ decl.<entry> }}``);
kernel bodies live in the headers under ``templates/include``.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2

PACKAGE_TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
PACKAGE_INCLUDE = PACKAGE_TEMPLATES / "include"

_user_dirs: list[Path] = []
_lock = threading.Lock()
_listeners: list[Callable[[], None]] = []


def on_change(listener: Callable[[], None]) -> None:
    """Call ``listener`` whenever the template search path changes."""
    _listeners.append(listener)


def register_template_dir(path: str | Path) -> None:
    """Search ``path`` for templates before the built-in ones.

    Its ``include/`` subfolder, if any, goes on the compiler's include path.
    """
    path = Path(path).resolve()
    if not path.is_dir():
        raise ValueError(f"template directory {path} does not exist")
    with _lock:
        if path not in _user_dirs:
            _user_dirs.insert(0, path)
    search_path_changed()


def search_path_changed() -> None:
    for listener in _listeners:
        listener()


def user_template_dirs() -> list[Path]:
    """Registered directories, then ``KERNFORGE_TEMPLATE_PATH`` (os.pathsep-separated)."""
    env = [Path(p).resolve() for p in os.environ.get("KERNFORGE_TEMPLATE_PATH", "").split(os.pathsep) if p]
    return [*_user_dirs, *env]


def template_dirs() -> list[Path]:
    """The template search path: the user's directories before the built-ins."""
    return [*user_template_dirs(), PACKAGE_TEMPLATES]


def include_dirs() -> list[Path]:
    return [d / "include" for d in user_template_dirs() if (d / "include").is_dir()] + [PACKAGE_INCLUDE]


@lru_cache(maxsize=8)
def _environment_for(dirs: tuple[Path, ...]) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(d) for d in dirs]),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def template_origin(template: str) -> Path | None:
    """The user directory a template comes from (None: a built-in one)."""
    for d in user_template_dirs():
        if (d / template).is_file():
            return d
    return None


def template_path(template: str) -> Path | None:
    """The file the template resolves to on the current search path."""
    for d in template_dirs():
        if (d / template).is_file():
            return d / template
    return None


def render(template: str, variables: dict[str, Any]) -> str:
    try:
        return _environment_for(tuple(template_dirs())).get_template(template).render(variables)
    except jinja2.TemplateNotFound as exc:
        raise ValueError(f"kernel template {template!r} not found in {', '.join(map(str, template_dirs()))}") from exc
    except jinja2.UndefinedError as exc:
        raise ValueError(f"template {template!r}: {exc}") from exc


# --------------------------------------------------------------------------- included headers

# Quoted includes are ours (system headers <...> are covered by the compiler's version in the key).
_QUOTED_INCLUDE = re.compile(rb'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def headers_digest(source: str) -> str:
    """Hash of every header ``source`` includes, directly or not, by name and content.

    Includes are followed through every ``#if`` branch, so the set can be larger than what one
    tier compiles, never smaller: an edited header rebuilds exactly the variants that may use it.
    """
    digest = hashlib.sha256()
    for name, path in included_headers(source):
        digest.update(name.encode() + b"\0" + _read(path)[2] + b"\0")
    return digest.hexdigest()


def included_headers(source: str) -> list[tuple[str, Path]]:
    """(include name, resolved file) of every quoted include reachable from ``source``."""
    roots = tuple(include_dirs())
    found: dict[str, Path] = {}
    pending: list[tuple[str, Path | None]] = [(m.decode(), None) for m in _QUOTED_INCLUDE.findall(source.encode())]
    while pending:
        name, including_dir = pending.pop()
        path = _resolve(name, (including_dir, *roots) if including_dir else roots)
        if path is None:
            continue  # the compiler reports a missing header, with its location
        label = _label(path, roots)
        if label in found:
            continue
        found[label] = path
        pending.extend((child, path.parent) for child in _read(path)[3])
    return sorted(found.items())


def _label(path: Path, roots: tuple[Path, ...]) -> str:
    """A header's name relative to its include root: one name however it was reached."""
    for root in roots:
        if root in path.parents:
            return str(path.relative_to(root))
    return str(path)


def _resolve(name: str, roots: tuple[Path, ...]) -> Path | None:
    """Where the compiler finds a quoted include: the including file's folder, then -I."""
    for root in roots:
        candidate = root / name
        if candidate.is_file():
            return candidate
    return None


_read_cache: dict[Path, tuple[int, int, bytes, list[str]]] = {}


def _read(path: Path) -> tuple[int, int, bytes, list[str]]:
    """(mtime_ns, size, bytes, quoted includes) of a header, re-read only when it changes."""
    st = path.stat()
    cached = _read_cache.get(path)
    if cached is None or cached[:2] != (st.st_mtime_ns, st.st_size):
        data = path.read_bytes()
        cached = (st.st_mtime_ns, st.st_size, data, [m.decode() for m in _QUOTED_INCLUDE.findall(data)])
        _read_cache[path] = cached
    return cached
