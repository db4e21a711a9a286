"""Render kernel templates.

A template emits the C++ config block and the exported entry point; its
top-level ``{% set cdecl = "..." %}`` is the entry's C declaration, which cffi
reads, so the declaration has one source of truth. Kernel bodies live in the
headers under ``templates/include``.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import jinja2

PACKAGE_TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
PACKAGE_INCLUDE = PACKAGE_TEMPLATES / "include"

_user_dirs: list[Path] = []
_lock = threading.Lock()
_ENTRY_NAME = re.compile(r"([A-Za-z_]\w*)\s*\(")


@dataclass(frozen=True)
class Rendered:
    source: str
    cdecl: str  # C declaration of the entry point, without ';'
    entry: str  # the entry point's name


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
    from kernforge.jit import core

    core.invalidate_dispatch()


def user_template_dirs() -> list[Path]:
    """Registered directories, then ``KERNFORGE_TEMPLATE_PATH`` (os.pathsep-separated)."""
    env = [Path(p).resolve() for p in os.environ.get("KERNFORGE_TEMPLATE_PATH", "").split(os.pathsep) if p]
    return [*_user_dirs, *env]


def template_dirs() -> list[Path]:
    """The template search path: the user's directories before the built-ins."""
    return [*user_template_dirs(), PACKAGE_TEMPLATES]


def include_dirs() -> list[Path]:
    return [d / "include" for d in user_template_dirs() if (d / "include").is_dir()] + [PACKAGE_INCLUDE]


def _environment() -> jinja2.Environment:
    return _environment_for(tuple(template_dirs()))


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


def render(template: str, variables: dict) -> Rendered:
    try:
        module = _environment().get_template(template).make_module(variables)
    except jinja2.TemplateNotFound as exc:
        raise ValueError(
            f"kernel template {template!r} not found in {', '.join(map(str, template_dirs()))}"
        ) from exc
    cdecl = getattr(module, "cdecl", None)
    if not isinstance(cdecl, str):
        raise ValueError(f"template {template!r} must set a top-level `cdecl` (the entry's C declaration)")
    cdecl = cdecl.strip().rstrip(";")
    match = _ENTRY_NAME.search(cdecl)
    if match is None:
        raise ValueError(f"template {template!r}: cannot find the function name in cdecl {cdecl!r}")
    return Rendered(str(module), cdecl, match.group(1))


def include_digest() -> str:
    """Hash of every header a kernel may include: part of each variant's key,
    so an edited header can never load a stale artifact."""
    return _digest_of(tuple(include_dirs()))


@lru_cache(maxsize=8)
def _digest_of(roots: tuple[Path, ...]) -> str:
    digest = hashlib.sha256()
    for root in roots:
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()
