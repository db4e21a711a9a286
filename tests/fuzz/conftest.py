"""The fuzzer's tally: cases tried per target, printed after the run and appended to --fuzz-report."""

from __future__ import annotations

import json


def pytest_terminal_summary(terminalreporter, config):
    from test_fuzz import TALLIES

    if not TALLIES:
        return
    terminalreporter.section(f"fuzz (master seed {config.option.fuzz_seed})")
    for tally in sorted(TALLIES, key=lambda t: t.target):
        terminalreporter.write_line(f"{tally.target:40s} {tally.cases:7d} cases  {tally.seconds:7.1f} s")
    if config.option.fuzz_report:
        with open(config.option.fuzz_report, "a") as report:
            for tally in TALLIES:
                record = {"target": tally.target, "cases": tally.cases, "seconds": round(tally.seconds, 1)}
                report.write(json.dumps({**record, "master_seed": config.option.fuzz_seed}) + "\n")
