"""The performance page stays what its result files say (no kernel is compiled).

* ``docs/performance.md`` is exactly what ``benchmarks/report.py`` generates from
  ``benchmarks/results/*.jsonl`` (regenerate: ``python benchmarks/report.py``).
* Every record in ``benchmarks/results/`` is a valid result record, and a transcribed one names a
  note under ``docs/notes/`` and one of its headings.
* Every plot the page links exists.
* The report's rules on synthetic records: the newest record of a key wins, quick runs never show,
  a ratio says how many times faster kernforge is whether the unit is a time or a rate.
"""

from __future__ import annotations

import copy
import difflib
import importlib.util
import json
import re
import sys
from types import ModuleType
from typing import Any

import pytest
from test_docs import _anchors

from conftest import REPO_ROOT


def _load_report() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kernforge_bench_report", REPO_ROOT / "benchmarks" / "report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


report = _load_report()
RESULT_FILES = sorted(report.RESULTS.glob("*.jsonl"))


def _record(**changes: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "routine": "gemm",
        "case": "bf16 M=1024 K=4096 N=4096",
        "impl": "kernforge",
        "metric": "gflops",
        "value": 400.0,
        "unit": "GFLOP/s",
        "params": {"dtype": "bf16", "M": 1024, "K": 4096, "N": 4096},
        "bound": {"name": "bf16 peak", "value": 500.0},
        "machine": {"kind": "zen4", "cpu": "test CPU", "cores": 2, "tier": "avx512"},
        "date": "2026-11-28",
        "commit": None,
        "command": "python benchmarks/bench_gemm.py",
        "quick": False,
    }
    record.update(changes)
    return record


def test_page_is_generated_from_the_results():
    expected = report.markdown(report.read_records(RESULT_FILES))
    current = report.PAGE.read_text() if report.PAGE.exists() else ""
    if current != expected:
        diff = difflib.unified_diff(
            current.splitlines(), expected.splitlines(), "docs/performance.md", "report.py", n=1
        )
        shown = "\n".join(list(diff)[:40])
        raise AssertionError(
            f"docs/performance.md is not what benchmarks/results/ generates; regenerate it with\n"
            f"    {report.REGENERATE}\n(from the repository root) and commit it. First differences:\n{shown}"
        )


def test_every_result_record_is_valid():
    assert RESULT_FILES, "no result files in benchmarks/results/"
    bad = []
    for path in RESULT_FILES:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                bad += [f"{path.name}:{number}: {problem}" for problem in report.problems(json.loads(line))]
    assert not bad, "invalid result records:\n" + "\n".join(bad)


def test_transcribed_records_name_an_existing_note_and_heading():
    missing = []
    for record in report.read_records(RESULT_FILES):
        if "source" not in record:
            continue
        path, _, anchor = record["source"].partition("#")
        note = REPO_ROOT / path
        if not note.is_file():
            missing.append(f"{record['source']} (no such note)")
        elif anchor and anchor not in _anchors(note):
            missing.append(f"{record['source']} (no such heading)")
    assert not missing, "transcribed records cite missing notes:\n" + "\n".join(sorted(set(missing)))


def test_every_plot_the_page_links_exists():
    linked = re.findall(r"!\[[^\]]*\]\((performance/[^)]+\.png)\)", report.PAGE.read_text())
    assert linked, "the page links no plot"
    missing = [name for name in linked if not (report.PAGE.parent / name).is_file()]
    assert not missing, f"plots missing (run {report.REGENERATE}): {missing}"


def test_newest_record_of_a_key_wins_and_quick_runs_never_show():
    old = _record(value=300.0, date="2026-11-20")
    new = _record(value=420.0, date="2026-11-29")
    quick = _record(value=999.0, date="2026-11-30", quick=True)
    same_day_later = _record(value=430.0, date="2026-11-29")
    other_kind = _record(machine={**old["machine"], "kind": "zen5"})
    kept = report.newest([new, old, quick, other_kind])
    assert kept[report.key(new)]["value"] == 420.0
    assert kept[report.key(other_kind)]["value"] == 400.0
    assert len(kept) == 2
    assert report.newest([new, same_day_later])[report.key(new)]["value"] == 430.0
    assert "999" not in report.markdown([old, new, quick])


def test_ratio_and_share_of_bound_say_how_much_faster():
    rate, peer_rate = _record(value=400.0), _record(impl="torch", value=200.0)
    assert report.ratio(rate, peer_rate) == pytest.approx(2.0)
    assert report.share_of_bound(rate) == pytest.approx(0.8)
    time = _record(routine="e2e", metric="tpot_ms", unit="ms", value=50.0, bound={"name": "bytes bound", "value": 40.0})
    peer_time = _record(routine="e2e", metric="tpot_ms", unit="ms", value=150.0, impl="transformers")
    assert report.ratio(time, peer_time) == pytest.approx(3.0)
    assert report.share_of_bound(time) == pytest.approx(0.8)
    assert report.ratio(time, None) is None
    assert report.ratio(_record(value=None), peer_rate) is None


def test_the_peer_is_the_routine_s_first_measured():
    ours = _record()
    compiled = _record(impl="torch.compile", value=100.0)
    onednn = _record(impl="torch", value=380.0)
    kept = report.newest([ours, compiled, onednn])
    assert report.peer_of(ours, kept)["impl"] == "torch"
    page = report.markdown([ours, compiled, onednn])
    assert "| bf16 M=1024 K=4096 N=4096 | kernforge | gflops | 400.0 GFLOP/s | torch: 380.0 GFLOP/s | 1.05x |" in page
    assert "bf16 peak: 500.0 GFLOP/s | 80 % |" in page


def test_problems_names_what_is_wrong():
    assert report.problems(_record()) == []
    broken = copy.deepcopy(_record(routine="nope", value="fast", date="28/11/2026", bound={"name": "x"}))
    del broken["machine"]["kind"]
    found = "\n".join(report.problems(broken))
    for what in ("routine", "value", "date", "bound.value", "machine.kind"):
        assert what in found


def test_plots_are_drawn_for_the_records_that_have_them(tmp_path):
    pytest.importorskip("matplotlib")
    decode = _record(
        routine="decode", case="bf16 B=16 L=4096 HND", metric="gbs", unit="GB/s", value=25.0,
        params={"context": 4096, "batch": 16, "layout": "HND", "kv_dtype": "bf16"},
        bound={"name": "streaming rate", "value": 30.0},
    )  # fmt: skip
    written = report.write_plots(report.newest([_record(), decode]), tmp_path)
    assert sorted(p.name for p in written) == ["zen4-decode.png", "zen4-gemm.png"]
    assert all(p.stat().st_size > 1000 for p in written)
