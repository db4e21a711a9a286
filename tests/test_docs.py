"""The documentation stays true to the tree: README.md and docs/ (no kernel is compiled).

* ``docs/op-reference.md`` is exactly what ``kernforge._docs.op_reference()`` generates from the op
  registry (regenerate: ``python -m kernforge._docs > docs/op-reference.md``).
* Every relative Markdown link in README.md and docs/**/*.md points to a file or folder that
  exists. Anchors are checked too where the target is a Markdown file (``page.md#section``, or
  ``#section`` within the page): the anchor must be one of the page's headings as GitHub spells
  it (lowercased, punctuation but ``-`` and ``_`` dropped, spaces to ``-``, ``-1``, ``-2`` for
  repeats); an anchor into any other file (``file.py#L10``) is not checked.
* Every repository path named in a command block (a fenced block marked ``bash``, ``sh``,
  ``shell``, ``console`` or unmarked: ``python examples/foo.py``, ``tests/vllm``) exists: a path
  under one of the repository's top-level folders, or a ``python -m kernforge...`` module.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from kernforge._docs import REGENERATE, op_reference

from conftest import REPO_ROOT

DOCS = REPO_ROOT / "docs"
PAGES = [REPO_ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
COMMAND_LANGUAGES = {"", "bash", "sh", "shell", "console"}
# Paths in command blocks are checked when they start with one of these (a placeholder such as
# config.json or /path/to/model, or an environment such as .venv/, is not a repository path).
REPO_FOLDERS = ("examples", "benchmarks", "tests", "kernforge", "docs", ".ci")

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
_INLINE_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_REPO_PATH = re.compile(r"(?<![\w./$-])((?:\.ci|[A-Za-z_][\w-]*)(?:/[\w.-]+)+/?)")
_MODULE = re.compile(r"-m\s+(kernforge(?:\.\w+)*)")


def _blocks(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(the page without its fenced blocks, [(language, block body), ...])."""
    prose, blocks, fence, language, body = [], [], None, "", []
    for line in text.splitlines():
        match = _FENCE.match(line)
        if fence is None and match:
            fence, language, body = match.group(2), match.group(3).lower(), []
        elif fence is not None and line.strip().startswith(fence[0] * len(fence)) and not line.strip(fence[0]).strip():
            blocks.append((language, "\n".join(body)))
            fence = None
        elif fence is not None:
            body.append(line)
        else:
            prose.append(line)
    assert fence is None, "an unclosed fenced block"
    return "\n".join(prose), blocks


def _slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")  # links and code keep their text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    prose, _ = _blocks(page.read_text())
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose.splitlines():
        match = _HEADING.match(line)
        if match:
            slug = _slug(match.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def _links(page: Path) -> list[str]:
    prose, _ = _blocks(page.read_text())
    prose = _CODE_SPAN.sub("", prose)
    return _INLINE_LINK.findall(prose) + _REFERENCE_LINK.findall(prose)


def test_op_reference_is_generated_from_the_registry():
    page = DOCS / "op-reference.md"
    expected = op_reference()
    current = page.read_text() if page.exists() else ""
    if current != expected:
        diff = difflib.unified_diff(
            current.splitlines(), expected.splitlines(), "docs/op-reference.md", "op_reference()", n=1, lineterm=""
        )
        shown = "\n".join(list(diff)[:40])
        raise AssertionError(
            f"docs/op-reference.md is not what the op registry generates; regenerate it with\n    {REGENERATE}\n"
            f"(from the repository root) and commit it. First differences:\n{shown}"
        )


def test_relative_links_point_to_existing_files_and_headings():
    broken, checked = [], 0
    for page in PAGES:
        for link in _links(page):
            if re.match(r"[a-z][a-z0-9+.-]*:", link, re.IGNORECASE):  # http:, https:, mailto:
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(REPO_ROOT)}: {link}"
            checked += 1
            if not target.exists():
                broken.append(f"{where} (no such file)")
            elif REPO_ROOT.resolve() not in (target, *target.parents):
                broken.append(f"{where} (outside the repository)")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{where} (no heading #{anchor} in {target.relative_to(REPO_ROOT.resolve())})")
    assert checked > 20, f"only {checked} relative links found: is the link pattern still right?"
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_paths_in_command_blocks_exist():
    missing, checked = [], 0
    for page in PAGES:
        _, blocks = _blocks(page.read_text())
        for language, body in blocks:
            if language not in COMMAND_LANGUAGES:
                continue
            where = page.relative_to(REPO_ROOT)
            for path in _REPO_PATH.findall(body):
                path = path.rstrip(".")
                if path.split("/", 1)[0] not in REPO_FOLDERS:
                    continue
                checked += 1
                if not (REPO_ROOT / path).exists():
                    missing.append(f"{where}: {path}")
            for module in _MODULE.findall(body):
                checked += 1
                base = REPO_ROOT / module.replace(".", "/")
                if not (base.with_suffix(".py").exists() or (base / "__init__.py").exists()):
                    missing.append(f"{where}: python -m {module}")
    assert checked > 10, f"only {checked} paths found in command blocks: is the path pattern still right?"
    assert not missing, "command blocks name paths that do not exist:\n" + "\n".join(missing)
