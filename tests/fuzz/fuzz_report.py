"""The fuzzer's tally: cases tried per target, printed after the run and, with --fuzz-report, appended
to that file as the benchmarks' JSON lines (routine "fuzz": the performance page's fuzz table).
Called by tests/conftest.py's terminal summary (a conftest here would shadow tests/conftest.py's
module name for the tests that import from it)."""

from __future__ import annotations

import shlex
import sys

from fuzzing import tiers

from kernforge.bench import records


def summarize(terminalreporter, config, tallies) -> None:
    if not tallies:
        return
    seed = config.option.fuzz_seed
    terminalreporter.section(f"fuzz (master seed {seed}, tiers {', '.join(tiers())})")
    for tally in sorted(tallies, key=lambda t: t.target):
        terminalreporter.write_line(f"{tally.target:44s} {tally.cases:7d} cases  {tally.seconds:7.1f} s")
    if config.option.fuzz_report:
        params = {"master_seed": seed, "tiers": tiers()}
        found = [
            {
                **{"case": tally.target, "impl": "kernforge", "metric": "cases", "value": tally.cases},
                **{"unit": "cases", "bound": None, "params": {**params, "seconds": round(tally.seconds)}},
            }
            for tally in tallies
        ]
        command = shlex.join(["pytest", *sys.argv[1:]])
        records.write_jsonl(config.option.fuzz_report, found, routine="fuzz", command=command, quick=False)
