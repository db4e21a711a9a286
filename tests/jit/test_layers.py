"""The package's layers (README, Layout): a module imports only from its own layer or the ones
below, lazily imported names included, so the folders show the structure the code has. Within
``ops/``, an op family (a package or module under ``kernforge.ops`` but the shared ``_common`` and
``_registry``) reaches another family through its public names only: no name or module of
another family whose name starts with ``_``, imported or read off an imported module; a module
outside the families (``kernforge.torch_library``, ``nn``, ...) reaches none of theirs."""

from __future__ import annotations

import ast

from conftest import REPO_ROOT

# Lowest first; a module belongs to the first layer whose prefix it has.
LAYERS = (
    ("kernforge._version", "kernforge.cache", "kernforge.jit", "kernforge.bench.timing"),
    ("kernforge.ops", "kernforge.distributed", "kernforge.memory"),
    ("kernforge.model_spec", "kernforge.prewarm", "kernforge.tune", "kernforge.torch_library", "kernforge.bench"),
    (
        "kernforge.nn",
        "kernforge.cli",
        "kernforge.__main__",
        "kernforge.sanitize",
        "kernforge.integrations",
        "kernforge._docs",
    ),
)


def _layer(module: str) -> int | None:
    for level, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    return None


def _imports(path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name.startswith("kernforge")}


def test_modules_import_only_their_layer_or_lower():
    package = REPO_ROOT / "kernforge"
    wrong = []
    for path in sorted(package.rglob("*.py")):
        module = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__")
        level = _layer(module)
        if module == "kernforge":
            continue  # the package's front door imports every layer
        assert level is not None, f"{module} is in no layer: add it to LAYERS (and docs/architecture.md)"
        for imported in _imports(path):
            target = _layer(imported)
            if target is not None and target > level:
                wrong.append(f"{module} (layer {level}) imports {imported} (layer {target})")
    assert not wrong, "\n".join(wrong)


# Another family's private names a family still reaches, each waiting for a public home in its owner's
# files: (importing module, the private name as a dotted path). Empty: every family reaches the others
# through public names; an entry here is debt, named.
PENDING_PRIVATE: set[tuple[str, str]] = set()


def _family(module: str) -> str | None:
    """The op family of a dotted name (``kernforge.ops.<family>...``), or None outside the families."""
    parts = module.split(".")
    if len(parts) < 3 or parts[:2] != ["kernforge", "ops"] or parts[2].startswith("_"):
        return None
    return parts[2]


def _is_module(dotted: str) -> bool:
    path = REPO_ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _reached_names(path) -> set[str]:
    """Every ``kernforge`` name a file reaches: what it imports (``module.name`` for ``from module
    import name``), and ``module._attr`` where it reads a private attribute off a module it imported."""
    tree = ast.parse(path.read_text())
    found, modules = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}"
                found.add(dotted)
                if _is_module(dotted):
                    modules[alias.asname or alias.name] = dotted
        elif isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name)
                if alias.asname:
                    modules[alias.asname] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            if node.attr.startswith("_"):
                found.add(f"{modules[node.value.id]}.{node.attr}")
    return {name for name in found if name.startswith("kernforge")}


def _others_private(names, own: str) -> set[str]:
    """The names of ``names`` that are private names of a family other than ``own``."""
    return {
        name
        for name in names
        if _family(name) not in (None, own) and any(part.startswith("_") for part in name.split(".")[3:])
    }


def _private_reaches() -> set[tuple[str, str]]:
    """(module, name) for each private name of an op family that a module outside the family reaches:
    another family's module, or one outside the families (``kernforge.torch_library``, ``nn``, ...)."""
    reaches = set()
    for path in sorted((REPO_ROOT / "kernforge").rglob("*.py")):
        module = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__")
        reaches |= {(module, name) for name in _others_private(_reached_names(path), _family(module))}
    return reaches


def test_families_reach_other_families_through_public_names_only():
    reaches = _private_reaches()
    wrong = sorted(reaches - PENDING_PRIVATE)
    assert not wrong, "a family reaches another family's private names (give them a public one):\n" + "\n".join(
        f"{module} -> {name}" for module, name in wrong
    )
    gone = sorted(PENDING_PRIVATE - reaches)
    assert not gone, "no longer reached, drop from PENDING_PRIVATE:\n" + "\n".join(map(str, gone))


def test_the_private_name_check_sees_imports_and_module_attributes(tmp_path):
    """The check itself: a private name imported from another family, a private module of another
    family, and a private attribute read off another family's module are found; the family's own
    private names and the shared ``_common`` are not."""
    source = tmp_path / "probe.py"
    source.write_text(
        "from kernforge.ops.rope import _index_tensor\n"
        "from kernforge.ops.attention._wrapper import fill_layer\n"
        "from kernforge.ops.gemm import fp8 as gemm_fp8\n"
        "from kernforge.ops._common import num_threads\n"
        "from kernforge.ops.mla.projections import _rotate\n"
        "def f():\n"
        "    return gemm_fp8._checked_block_size\n"
    )
    assert _others_private(_reached_names(source), "mla") == {
        "kernforge.ops.rope._index_tensor",
        "kernforge.ops.attention._wrapper.fill_layer",
        "kernforge.ops.gemm.fp8._checked_block_size",
    }
    # A module outside the families (family None, as kernforge.torch_library) may reach none of them.
    assert _others_private(_reached_names(source), None) == {
        "kernforge.ops.rope._index_tensor",
        "kernforge.ops.attention._wrapper.fill_layer",
        "kernforge.ops.gemm.fp8._checked_block_size",
        "kernforge.ops.mla.projections._rotate",
    }
