"""The differential fuzzer (fuzzing.py) over every target in targets_*.py, and its regressions.

``make test`` gives the fuzzer a budget of ``--fuzz-seconds`` (shared by the targets) from a fixed
master seed; ``make fuzz`` runs it for an hour from a new seed. ``--fuzz-case SEED`` replays one case
(the seed a failure prints) on every tier.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from fuzzing import Tally, check_case, fuzz
from regressions import REGRESSIONS

HERE = Path(__file__).parent
TARGETS = {
    target.name: target
    for module in sorted(HERE.glob("targets_*.py"))
    for target in importlib.import_module(module.stem).TARGETS
}
TALLIES: list[Tally] = []


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_fuzz(name, request):
    options = request.config.option
    if options.fuzz_case is not None:
        check_case(TARGETS[name], options.fuzz_case)
        return
    share = options.fuzz_seconds / len(TARGETS)
    TALLIES.append(fuzz(TARGETS[name], share, options.fuzz_seed))


def test_fuzz_regressions():
    """Every case the fuzzer once failed on, on every tier."""
    for name, seed in REGRESSIONS:
        check_case(TARGETS[name], seed)


def test_every_regression_names_a_target():
    assert {name for name, _ in REGRESSIONS} <= set(TARGETS)
