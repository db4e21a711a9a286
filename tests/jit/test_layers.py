"""The package's layers (README, Layout): a module imports only from its own layer or the ones
below, lazily imported names included, so the folders show the structure the code has."""

from __future__ import annotations

import ast

from conftest import REPO_ROOT

# Lowest first; a module belongs to the first layer whose prefix it has.
LAYERS = (
    ("kernforge._version", "kernforge.cache", "kernforge.jit"),
    ("kernforge.ops", "kernforge.distributed", "kernforge.memory"),
    ("kernforge.model_spec", "kernforge.prewarm", "kernforge.tune", "kernforge.torch_library"),
    ("kernforge.nn", "kernforge.cli", "kernforge.__main__", "kernforge.integrations"),
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
        assert level is not None, f"{module} is in no layer: add it to LAYERS (and the README's Layout)"
        for imported in _imports(path):
            target = _layer(imported)
            if target is not None and target > level:
                wrong.append(f"{module} (layer {level}) imports {imported} (layer {target})")
    assert not wrong, "\n".join(wrong)
