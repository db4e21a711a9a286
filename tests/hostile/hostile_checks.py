"""Checks for the table's :class:`~hostile_harness.Runs` cases: what NaN/Inf must do (FlashInfer's and
torch's behaviour), and what an aliased output must compute (with :func:`in_place_out`, the aliasing
cases of an op that may work in place)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from hostile_harness import CaseList, Runs, overlapping, same_bits

Get = Callable[[Any, dict], torch.Tensor]  # (result, args) -> the output tensor to look at


def result(index: int | None = None) -> Get:
    """The op's result (element ``index`` of a tuple result)."""
    return lambda res, args: res if index is None else res[index]


def arg(name: str, index: int | None = None) -> Get:
    """An argument the op wrote in place (element ``index`` of a pair)."""
    return lambda res, args: args[name] if index is None else args[name][index]


def nan_rows(get: Get, rows: Iterable[int], note: str, whole_row: bool = False, others: Iterable[Get] = ()) -> Runs:
    """``get``'s rows ``rows`` hold a NaN (every element NaN with ``whole_row``), its other rows and every
    tensor of ``others`` are bit-identical to the unchanged call's: NaN stays where it belongs."""
    rows = set(rows)

    def check(res, args, plain):
        got, want = get(res, args), get(*plain)
        for r in range(got.shape[0]):
            nan = torch.isnan(got[r].float())
            if r in rows:
                assert nan.all() if whole_row else nan.any(), f"row {r}: the NaN was lost: {got[r]}"
            else:
                assert same_bits(got[r], want[r]), f"row {r}: a NaN in another row changed it"
        for other in others:
            assert same_bits(other(res, args), other(*plain)), "a NaN leaked into another output"

    return Runs(check, note)


def matches(get: Get, reference: Callable[[dict], torch.Tensor], note: str, atol=1e-2, rtol=1e-2) -> Runs:
    """``get`` equals ``reference(args)`` (float32, NaN where the reference has NaN)."""

    def check(res, args, plain):
        got, want = get(res, args).float(), reference(args).float()
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol, equal_nan=True)

    return Runs(check, note)


def same_as_plain(get: Get, note: str) -> Runs:
    """``get`` is bit-identical to the unchanged call's (an aliased output computes what a separate one does)."""

    def check(res, args, plain):
        assert same_bits(get(res, args), get(*plain)), "the aliased call computed something else"

    return Runs(check, note)


def in_place_out(
    c: CaseList, x: str, shape: tuple[int, int], note: str = "allowed: in place, same result", what: str = ""
) -> CaseList:
    """The two aliasing cases of an op whose ``out`` may be its input ``x`` (its in-place form): ``out``
    is ``x`` (``what``; by default "out is <x> (in place)") computes what a separate out does; ``out``
    overlapping ``x`` a row later (``shape``: out's [rows, row length]) is refused naming ``out``,
    as every overlap other than the exact alias is."""
    c.add("alias", what or f"out is {x} (in place)", lambda a: {"out": a[x]}, same_as_plain(result(), note))
    return c.refuse(
        "alias", f"out overlaps {x}, a row later", lambda a: overlapping(a, x, "out", shape, shape[1]), "out"
    )


def all_finite(get: Get, note: str) -> Runs:
    """Masked-out NaN/Inf does not reach ``get``: it is bit-identical to the unchanged call's."""

    def check(res, args, plain):
        got = get(res, args)
        assert torch.isfinite(got.float()).all(), "NaN/Inf in memory the op must not read reached the output"
        assert same_bits(got, get(*plain)), "memory the op must not read changed its output"

    return Runs(check, note)


def check_all(*checks: Runs, note: str) -> Runs:
    return Runs(lambda res, args, plain: [c.check(res, args, plain) for c in checks] and None, note)
