"""The one benchmark result format: one figure per JSON line.

A routine calls :func:`emit` once per measured figure; at the end of the run :func:`write_jsonl`
appends them to a file, each line a self-contained JSON object (``FIELDS``): what was measured
(routine, case, impl, metric, value, unit, params, bound), on what (machine: kind, cpu, cores,
tier), when (date), from which tree (commit) and how (command, quick). The performance page is
generated from such files; files from several runs and machines concatenate.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kernforge.bench import machine

# Every line's keys, and the JSON types each may hold (None: null).
FIELDS: dict[str, tuple[type | None, ...]] = {
    "routine": (str,),
    "case": (str,),
    "impl": (str,),
    "metric": (str,),
    "value": (int, float, None),
    "unit": (str,),
    "params": (dict,),
    "bound": (dict, None),
    "machine": (dict,),
    "date": (str,),
    "commit": (str, None),
    "command": (str,),
    "quick": (bool,),
}
MACHINE_FIELDS = ("kind", "cpu", "cores", "tier")
# Fields a record may carry besides FIELDS: "source", the note a figure was transcribed from (a
# figure measured before the benchmarks wrote JSON lines).
OPTIONAL_FIELDS: dict[str, tuple[type | None, ...]] = {"source": (str,)}

# The figures this process measured so far, in order (emit appends, write_jsonl writes them).
RECORDS: list[dict[str, Any]] = []


def emit(
    case: str,
    impl: str,
    metric: str,
    value: float | None,
    unit: str,
    *,
    params: dict[str, Any] | None = None,
    bound: tuple[str, float] | None = None,
) -> None:
    """Record one figure: ``impl`` ("kernforge", "torch", "onednn", "vllm", "llama.cpp", ...) took
    ``value`` ``unit`` on ``case`` (a short stable name, e.g. "bf16 M=1 K=4096 N=4096"), with the
    case's parameters in ``params`` and the machine limit it is judged against in ``bound``
    (name, value in the same unit)."""
    RECORDS.append(
        {
            "case": case,
            "impl": impl,
            "metric": metric,
            "value": value,
            "unit": unit,
            "params": params or {},
            "bound": None if bound is None else {"name": bound[0], "value": bound[1]},
        }
    )


def _jsonable(value: Any) -> Any:
    """``value`` as strict JSON can hold it: NaN and infinities (no JSON number) become null, tuples
    lists, anything else without a JSON form (a torch dtype) its str."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    try:
        as_float = float(value)  # numpy and torch scalars
    except (TypeError, ValueError):
        return str(value)
    return as_float if math.isfinite(as_float) else None


def commit(checkout: Path | None = None) -> str | None:
    """The short git hash of the checkout kernforge runs from (or ``checkout``), with "-dirty" when
    tracked files differ from it (the figure then measured a tree no commit holds); None outside git."""
    where = checkout or Path(__file__).resolve().parents[2]
    head = _git(where, "rev-parse", "--short", "HEAD")
    if not head:
        return None
    return head + "-dirty" if _git(where, "status", "--porcelain", "--untracked-files=no") else head


def _git(where: Path, *args: str) -> str | None:
    """``git args`` in ``where``: its output, stripped, or None if git fails or is absent."""
    try:
        done = subprocess.run(["git", *args], cwd=where, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def machine_facts() -> dict[str, Any]:
    """The ``machine`` object of every line: kind (zen4, zen5, xeon-amx, xeon, other), CPU model,
    cores, kernforge's ISA tier."""
    return {
        "kind": machine.machine_kind(),
        "cpu": machine.cpu_model(),
        "cores": os.cpu_count(),
        "tier": machine.selected_tier(),
    }


def lines(records: Iterable[dict[str, Any]], *, routine: str, command: str, quick: bool) -> list[str]:
    """``records`` (as emit made them) as JSON lines, each with the run's facts added."""
    run = {
        "routine": routine,
        "machine": machine_facts(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "command": command,
        "quick": quick,
    }
    ordered = ("routine", "case", "impl", "metric", "value", "unit", "params", "bound")
    out = []
    for record in records:
        full = {**run, **record}
        line = {key: full.get(key) for key in (*ordered, *FIELDS)}
        out.append(json.dumps(_jsonable(line), allow_nan=False))
    return out


def write_jsonl(path: str | Path, records: Iterable[dict[str, Any]], *, routine: str, command: str, quick: bool) -> int:
    """Append ``records`` to ``path`` as JSON lines (the file and its folder are created if need
    be); returns how many. Appending: several routines' runs go into one file."""
    text = lines(records, routine=routine, command=command, quick=quick)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("a") as f:
        f.writelines(line + "\n" for line in text)
    return len(text)


def problems(record: Any) -> list[str]:
    """What is wrong with one parsed line (``[]``: it follows ``FIELDS``)."""
    if not isinstance(record, dict):
        return [f"not a JSON object: {type(record).__name__}"]
    found = [f"missing {key!r}" for key in FIELDS if key not in record]
    found += [f"unknown {key!r}" for key in record if key not in FIELDS and key not in OPTIONAL_FIELDS]
    for key, kinds in {**FIELDS, **OPTIONAL_FIELDS}.items():
        value = record.get(key)
        if key in record and not any(value is None if k is None else isinstance(value, k) for k in kinds):
            found.append(f"{key!r} is {type(value).__name__}")
    if isinstance(record.get("value"), bool):
        found.append("'value' is bool")
    if isinstance(record.get("machine"), dict):
        found += [f"machine lacks {key!r}" for key in MACHINE_FIELDS if key not in record["machine"]]
    if isinstance(record.get("bound"), dict) and set(record["bound"]) != {"name", "value"}:
        found.append("'bound' is not {name, value}")
    return found


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every line of ``path``, parsed and checked; ValueError naming the first bad line."""
    found = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        record = json.loads(line)
        wrong = problems(record)
        if wrong:
            raise ValueError(f"{path}:{number}: {'; '.join(wrong)}")
        found.append(record)
    return found
