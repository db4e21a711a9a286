"""Hostile input for every public op and wrapper, from one table (``hostile_table.TABLE``).

Each case is one op with one hostile input (see ``hostile_harness`` for what a case checks): a
refusal raises the expected exception, names the argument and leaves every tensor the call could
reach bit-identical; NaN/Inf behave as FlashInfer / torch; inputs ending at a PROT_NONE page give
exactly the ordinary result. A hang is caught by faulthandler (the process exits with the
tracebacks). ``docs/safety.md`` is the table rendered (``hostile_table.safety_page()``).
"""

from __future__ import annotations

import difflib
import faulthandler

import pytest
from hostile_harness import Refuses, Runs, SameAsPlain, names_argument, same_bits, snapshot, tensors_of
from hostile_table import PAGE, REGENERATE, TABLE, safety_page

from kernforge.ops._registry import PUBLIC

HANG_SECONDS = 600  # a first run compiles the kernels it uses


@pytest.fixture
def no_hang():
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def test_every_public_op_is_in_the_table():
    covered = {case.op for case in TABLE}
    assert not set(PUBLIC) - covered, f"public ops without hostile cases: {sorted(set(PUBLIC) - covered)}"
    assert not covered - set(PUBLIC), f"cases of unknown ops: {sorted(covered - set(PUBLIC))}"
    ids = [case.id for case in TABLE]
    assert len(ids) == len(set(ids)), f"duplicate case ids: {sorted({i for i in ids if ids.count(i) > 1})}"


def test_safety_page_is_generated_from_the_table():
    expected, current = safety_page(), PAGE.read_text() if PAGE.exists() else ""
    if current != expected:
        diff = difflib.unified_diff(
            current.splitlines(), expected.splitlines(), "docs/safety.md", "safety_page()", n=1, lineterm=""
        )
        raise AssertionError(
            f"docs/safety.md is not what the hostile table renders; regenerate it with\n    {REGENERATE}\n"
            "First differences:\n" + "\n".join(list(diff)[:40])
        )


@pytest.mark.parametrize("case", TABLE, ids=[case.id for case in TABLE])
def test_hostile(case, no_hang):
    setup = case.setup()
    args = dict(setup.args)
    if case.change is not None:
        args.update(case.change(setup.args))
    expect = case.expect
    if isinstance(expect, Refuses):
        watched = tensors_of(args) + tensors_of(setup.watch)
        before = snapshot(watched)
        with pytest.raises(expect.exc) as info:
            setup.fn(**args)
        assert names_argument(info.value, expect.arg), f"the message does not name {expect.arg!r}: {info.value}"
        changed = [i for i, (b, a) in enumerate(zip(before, snapshot(watched))) if not same_bits(b, a)]
        assert not changed, f"a refused call wrote to {len(changed)} of the {len(watched)} tensors it could reach"
        return
    plain_setup = case.setup()
    plain = plain_setup.fn(**plain_setup.args)
    got = setup.fn(**args)
    if isinstance(expect, Runs):
        expect.check(got, args, (plain, plain_setup.args))
        return
    assert isinstance(expect, SameAsPlain)
    assert same_bits(got, plain), "the result differs from the one on ordinary memory"
    for name, value in args.items():
        assert same_bits(tensors_of(value), tensors_of(plain_setup.args[name])), f"{name} differs after the call"
