"""The op reference (``docs/op-reference.md``), generated from the op registry.

``op_reference()`` returns the page as Markdown: one section per public op (every name
``kernforge.ops`` exports, the registry's ``PUBLIC``), grouped by the family that defines it, with
its signature (``inspect.signature``), its docstring's first paragraph and what the registry
records about it: for an op declared with ``@kernel_op`` (``OPS``), the kernel module, its fixed
parameters, the input dtypes and the tiers with the build that serves each; for a ``Traced`` op, the
``torch.ops.kernforge`` custom op(s) and the arguments written in place; for a name added with
``export``, whether it is an alias. Nothing here renders or compiles a kernel: it reads declarations.

Regenerate the page after changing an op (``tests/test_docs.py`` checks that it is current)::

    python -m kernforge._docs > docs/op-reference.md
    python -m kernforge._docs --write            # the same, into the repository's docs/
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kernforge.ops._registry import DTYPE_NAMES, PUBLIC, OpKernels

_ROOT = Path(__file__).resolve().parent.parent  # the repository (the folder holding kernforge/)
PAGE = _ROOT / "docs" / "op-reference.md"
REGENERATE = "python -m kernforge._docs > docs/op-reference.md"
_WIDTH = 100  # a signature longer than this is written one parameter per line
_METHODS = ("plan", "run")  # a wrapper class's methods that get a signature of their own
_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data):(?=`)")  # Sphinx roles: Markdown shows the code alone


class _Raw:
    """An annotation kept as the string it was written as (``from __future__ import annotations``),
    so a signature reads ``x: torch.Tensor`` rather than ``x: 'torch.Tensor'``."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _raw(annotation: Any) -> Any:
    return _Raw(annotation) if isinstance(annotation, str) else annotation


def signature_text(name: str, fn: Callable[..., Any], drop_self: bool = False) -> str:
    """``name(<parameters>) -> <return>`` for ``fn``, one parameter per line when long."""
    sig = inspect.signature(fn)
    params = [p.replace(annotation=_raw(p.annotation)) for p in sig.parameters.values()]
    sig = sig.replace(parameters=params[1:] if drop_self else params, return_annotation=_raw(sig.return_annotation))
    one_line = f"{name}{sig}"
    if len(one_line) <= _WIDTH:
        return one_line
    parts: list[str] = []  # each parameter as Python spells it, with the "/" and "*" markers
    star_written = False
    kinds = [p.kind for p in sig.parameters.values()]
    for i, param in enumerate(sig.parameters.values()):
        if param.kind is param.KEYWORD_ONLY and not star_written and param.VAR_POSITIONAL not in kinds:
            parts.append("*")
            star_written = True
        parts.append(str(param))
        if param.kind is param.POSITIONAL_ONLY and (i + 1 == len(kinds) or kinds[i + 1] is not param.POSITIONAL_ONLY):
            parts.append("/")
    body = "".join(f"    {part},\n" for part in parts)
    returns = sig.return_annotation
    arrow = "" if returns is inspect.Signature.empty else f" -> {inspect.formatannotation(returns)}"
    return f"{name}(\n{body}){arrow}"


def _target(fn: Any) -> Any:
    """The function or class a public name stands for (a partial's function)."""
    return fn.func if isinstance(fn, functools.partial) else fn


def _family(fn: Any) -> tuple[str, str]:
    """(family, source file relative to the repository) of the module that defines ``fn``."""
    target = _target(fn)
    module: str = target.__module__  # kernforge.ops.<family>[.<part>]
    parts = module.split(".")
    family = parts[2] if len(parts) > 2 and parts[:2] == ["kernforge", "ops"] else module
    source = Path(inspect.getsourcefile(target) or "").resolve()
    return family, (source.relative_to(_ROOT) if source.is_relative_to(_ROOT) else source).as_posix()


def _summary(fn: Any) -> str:
    """The docstring's first paragraph, on one line."""
    doc = inspect.getdoc(_target(fn)) or ""
    return _ROLE.sub("", " ".join(doc.split("\n\n", 1)[0].split()))


def _dtype_names(kernels: OpKernels) -> str:
    return ", ".join(DTYPE_NAMES.get(d, str(d).removeprefix("torch.")) for d in kernels.dtypes)


def _tiers(kernels: OpKernels) -> str:
    built = kernels.module.tiers
    return ", ".join(tier if build == tier else f"{tier} (runs the {build} build)" for tier, build in built.items())


def _facts(name: str, fn: Any) -> list[str]:
    """What the registry records about public name ``name``, as bullet texts."""
    target = _target(fn)
    facts = []
    if isinstance(fn, functools.partial):
        bound = ", ".join(f"{k}={v!r}" for k, v in fn.keywords.items())
        facts.append(f"Alias: `{target.__name__}` with `{bound}` (`functools.partial`, added with `export`).")
    elif target.__name__ != name:
        facts.append(f"Alias of `{target.__name__}` (added with `export`).")
    kernels = getattr(target, "kernels", None)  # set by @kernel_op: OPS[target.__name__]
    if isinstance(kernels, OpKernels):
        fixed = ", ".join(f"{k}={v!r}" for k, v in kernels.fixed.items())
        module = f"`{kernels.module.name}` (template `{kernels.module.template}`)"
        facts.append(f"Kernel module: {module}" + (f", fixed parameters `{fixed}`." if fixed else "."))
        facts.append(f"Input dtypes: {_dtype_names(kernels)}.")
        facts.append(f"Tiers: {_tiers(kernels)}.")
    elif isinstance(target, type):
        facts.append("Kernels: not recorded in the registry (a plan/run class, exported with `export`).")
    else:
        facts.append("Kernels: not recorded in the registry (exported with `export`).")
    traced = getattr(target, "traced", None)
    if traced is not None:
        ops = [f"`torch.ops.kernforge.{target.__name__}`"]
        if traced.with_out:
            ops.append(f"`torch.ops.kernforge.{target.__name__}_out`")
        writes = ", ".join(f"`{w}`" for w in traced.writes)
        facts.append("Custom op: " + " and ".join(ops) + (f"; writes {writes} in place." if writes else "."))
    return facts


def _section(name: str, fn: Any, source: str) -> list[str]:
    target = _target(fn)
    lines = [f"### `{name}`", "", "```python", signature_text(name, fn)]
    if isinstance(target, type):
        for method in _METHODS:
            if callable(getattr(target, method, None)):
                lines.append(signature_text(f".{method}", getattr(target, method), drop_self=True))
    lines += ["```", ""]
    summary = _summary(fn)
    if summary:
        lines += [summary, ""]
    lines += [f"- {fact}" for fact in _facts(name, fn)]
    lines += [f"- Defined in [`{source}`](../{source}).", ""]
    return lines


def op_reference() -> str:
    """The op reference page, Markdown, from the registry (imports the ops; compiles nothing)."""
    import kernforge.ops  # noqa: F401  (imports every family, which fills the registry)

    families: dict[str, list[tuple[str, Any, str]]] = {}
    for name, fn in PUBLIC.items():
        family, source = _family(fn)
        families.setdefault(family, []).append((name, fn, source))
    count = sum(len(ops) for ops in families.values())
    lines = [
        "# Op reference",
        "",
        f"<!-- Generated from the op registry by kernforge/_docs.py: `{REGENERATE}`.",
        "     Do not edit by hand; tests/test_docs.py fails when this page and the registry disagree. -->",
        "",
        f"Every public op kernforge exports ({count} names, `kernforge.<name>` and `kernforge.ops.<name>`),",
        "by family, as the op registry (`kernforge/ops/_registry.py`) records it: the signature, the",
        "docstring's first paragraph, and, for an op declared with `@kernel_op`, the kernel module it",
        "runs, the input dtypes it takes (each selects a variant of the module; other dtypes raise",
        "`ValueError`) and the ISA tiers with the build that serves each. Ops exported with `export`",
        "(plan/run wrapper classes, packers, aliases) run kernels the registry does not record. The",
        "registry does not record the FlashInfer / sgl-kernel counterpart either: the docstrings",
        "quoted here often name it, and [ops.md](ops.md) lists them family by family.",
        "",
    ]
    for family, ops in sorted(families.items()):
        lines.append(f"- [{family}](#{family}): " + ", ".join(sorted(f"`{n}`" for n, _, _ in ops)))
    lines.append("")
    for family, ops in sorted(families.items()):
        lines += [f"## {family}", ""]
        for name, fn, source in sorted(ops, key=lambda op: op[0]):
            lines += _section(name, fn, source)
    return "\n".join(lines).rstrip("\n") + "\n"


def write(path: Path = PAGE) -> Path:
    """Write the op reference to ``path`` (default: the repository's ``docs/op-reference.md``)."""
    path.write_text(op_reference())
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--write"]:
        print(f"wrote {write()}")
    elif not argv:
        sys.stdout.write(op_reference())
    else:
        print(f"usage: python -m kernforge._docs [--write]   (prints the op reference; --write: into {PAGE})")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
