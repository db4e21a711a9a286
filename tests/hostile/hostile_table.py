"""The hostile-input table: every public op with the hostile inputs it is tried with, and the
docs page rendered from it (``docs/safety.md``; ``tests/hostile/test_hostile.py`` checks it is current).

Regenerate the page after changing the table::

    .venv/bin/python tests/hostile/hostile_table.py > docs/safety.md
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # run as a script: the helpers sit next to it
    sys.path.insert(0, str(HERE))

import hostile_attention  # noqa: E402
import hostile_gemm  # noqa: E402
import hostile_mla_moe  # noqa: E402
import hostile_rows  # noqa: E402
from hostile_harness import KINDS, Case, Refuses  # noqa: E402

from kernforge._docs import _family  # noqa: E402
from kernforge.ops._registry import PUBLIC  # noqa: E402

PAGE = HERE.parent.parent / "docs" / "safety.md"
REGENERATE = ".venv/bin/python tests/hostile/hostile_table.py > docs/safety.md"


def table() -> list[Case]:
    """Every case, op by op."""
    found: list[Case] = []
    for module in (hostile_rows, hostile_attention, hostile_gemm, hostile_mla_moe):
        for op_cases in module.cases():
            found.extend(op_cases)
    return found


TABLE = table()


def _cell(cases: list[Case]) -> str:
    return "<br>".join(f"{c.what} → {c.expect.describe()}" for c in cases) or "—"


def safety_page() -> str:
    """docs/safety.md: per family, a table of every public op against each kind of hostile input."""
    by_op: dict[str, list[Case]] = {}
    for case in TABLE:
        by_op.setdefault(case.op, []).append(case)
    families: dict[str, list[str]] = {}
    for name, fn in PUBLIC.items():
        families.setdefault(_family(fn)[0], []).append(name)
    refusals = sum(isinstance(c.expect, Refuses) for c in TABLE)
    lines = [
        "# Safety: hostile inputs",
        "",
        f"<!-- Generated from tests/hostile's table: `{REGENERATE}`.",
        "     Do not edit by hand; tests/hostile/test_hostile.py fails when this page and the table disagree. -->",
        "",
        "kernforge's promise for bad input: a clear `ValueError` or `TypeError` whose message names the",
        "argument, with nothing written (outputs and KV caches bit-identical to before the call), never a",
        "crash, an out-of-bounds read or write, or a hang. `tests/hostile/test_hostile.py` holds every public",
        f"op of the [op reference](op-reference.md) to it, from one table: {len(TABLE)} cases over {len(by_op)} ops",
        f"({refusals} of them refusals). A refusal must raise the exception type shown, with a message that",
        "names the argument shown, and leave every tensor the call could reach bit-identical (compared with",
        "a copy taken before the call). NaN and Inf are not refused: they must behave as in FlashInfer /",
        'sgl-kernel / torch, as each cell says. An input that "ends at a guard page" is copied to memory',
        "whose last byte precedes a page mapped `PROT_NONE`: the op must give exactly what it gives on",
        "ordinary memory, so it reads and writes nothing past the end. A wrapper's cases say which call they",
        "make (`plan:` or `run:`). `—`: that kind of input does not apply to the op.",
        "",
        "Exception types follow FlashInfer's and sgl-kernel's where they raise one for the same input; where",
        "theirs is another type, kernforge's class is both where that matters to callers (an unknown",
        "`kv_layout` raises `KVLayoutError`, a `ValueError` and a `KeyError`; `run()` before `plan()`",
        "`PlanStateError`, a `ValueError` and an `AttributeError`). The checks FlashInfer does not make are",
        "kernforge's own: outputs that overlap what a call reads (an exact alias is allowed where the op",
        "works in place: `rmsnorm`'s `out=input`, the renorm ops', `softmax`'s and `fused_experts`' in-place",
        "forms), `get_seq_lens`' and `get_batch_indices_positions`' table checks (bare torch arithmetic",
        "there: a length mismatch is torch's `RuntimeError`, a bad value a wrong length), and row ids past",
        "a GGUF weight's rows.",
        "",
        "Kinds of hostile input: " + "; ".join(f"**{title}**" for title in KINDS.values()) + ".",
        "",
    ]
    for family in sorted(families):
        lines += [f"## {family}", "", "| op | " + " | ".join(KINDS.values()) + " |"]
        lines.append("|---" * (len(KINDS) + 1) + "|")
        for name in sorted(families[family]):
            cases = by_op.get(name, [])
            cells = [_cell([c for c in cases if c.kind == kind]) for kind in KINDS]
            lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    sys.stdout.write(safety_page())
