"""Differential fuzzing: seeded random cases for every op, checked against a float64 reference on
every runnable tier, and each tier against the generic C++ tier.

A :class:`Target` is one op (or one plan/run sequence of a wrapper). It draws a case from a
``random.Random`` (shapes around tile and page boundaries, dtypes, strides, lengths; plain values, so
that a failure prints what it was), builds the inputs from the case, runs kernforge on the tier in
use, and computes the reference. :func:`fuzz` draws cases until its time budget is spent; every case
has its own seed, so a failure reproduces alone::

    pytest tests/fuzz -k <target> --fuzz-case <seed>

and a fixed failure becomes a regression: a ``(target, seed)`` pair in ``regressions.py``.
"""

from __future__ import annotations

import random
import time
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import kernforge

Outputs = dict[str, torch.Tensor]

# (atol, rtol) against the float64 reference, by the dtype the kernel computed in.
TOLERANCES = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


@dataclass(frozen=True)
class Target:
    """One fuzzed op.

    ``draw(rng)``: a case, a dict of plain values (it is printed on failure); it may hold a
    ``"seed"`` for the tensors. ``inputs(case)``: the tensors (built once per case, never mutated
    by ``run``: in-place ops work on clones). ``run(case, inputs)``: kernforge's outputs on the tier
    in use. ``reference(case, inputs)``: the same outputs from PyTorch in float64 (or exact
    integers). ``tolerance(case)``: (atol, rtol) per output name, or one pair for all.
    ``tiers_agree``: False where tiers may legitimately differ beyond the tolerance (e.g. which of
    two equal maxima an argmax picks); the reference check still runs on each tier.
    """

    name: str
    draw: Callable[[random.Random], dict]
    inputs: Callable[[dict], Any]
    run: Callable[[dict, Any], Outputs]
    reference: Callable[[dict, Any], Outputs]
    tolerance: Callable[[dict], Any] = field(default=lambda case: TOLERANCES[case.get("dtype", torch.float32)])
    tiers_agree: bool = True


class FuzzFailure(AssertionError):
    pass


def case_seed(master: int, target: str, index: int) -> int:
    """The seed of a target's ``index``-th case in a run seeded ``master``: stable across processes."""
    return zlib.crc32(f"{master}:{target}:{index}".encode())


def draw_case(target: Target, seed: int) -> dict:
    return target.draw(random.Random(seed))


def tiers() -> list[str]:
    """Every runnable tier, best first; the generic tier is the arbiter between them."""
    return kernforge.jit.isa.runnable_tiers()


def _pairs(tolerance, names):
    return {name: tolerance[name] for name in names} if isinstance(tolerance, dict) else dict.fromkeys(names, tolerance)


def _compare(actual: Outputs, expected: Outputs, tolerance, what: str) -> None:
    if set(actual) != set(expected):
        raise FuzzFailure(f"{what}: outputs {sorted(actual)} != {sorted(expected)}")
    for name, (atol, rtol) in _pairs(tolerance, actual).items():
        got, want = actual[name], expected[name]
        if got.shape != want.shape:
            raise FuzzFailure(f"{what}: {name} has shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        if got.dtype.is_floating_point or want.dtype.is_floating_point:
            try:
                torch.testing.assert_close(
                    got.double(), want.double(), atol=atol, rtol=rtol, equal_nan=True, check_dtype=False
                )
            except AssertionError as error:
                raise FuzzFailure(f"{what}: {name}: {error}") from None
        elif not torch.equal(got.cpu(), want.cpu()):
            mismatched = int((got != want).sum())
            raise FuzzFailure(f"{what}: {name}: {mismatched} of {got.numel()} elements differ")


def check_case(target: Target, seed: int, tier_list: list[str] | None = None) -> dict:
    """Runs the case seeded ``seed`` on every tier; raises :class:`FuzzFailure` naming the seed."""
    case = draw_case(target, seed)
    try:
        inputs = target.inputs(case)
        expected = target.reference(case, inputs)
        tolerance = target.tolerance(case)
        by_tier: dict[str, Outputs] = {}
        for tier in tier_list or tiers():
            with kernforge.use_isa(tier):
                by_tier[tier] = target.run(case, inputs)
            _compare(by_tier[tier], expected, tolerance, f"tier {tier} vs the reference")
        if target.tiers_agree and "generic" in by_tier:
            for tier, outputs in by_tier.items():
                _compare(outputs, by_tier["generic"], tolerance, f"tier {tier} vs the generic tier")
    except Exception as error:
        detail = str(error) if isinstance(error, FuzzFailure) else traceback.format_exc(limit=-3)
        raise FuzzFailure(
            f"{target.name}: case seed {seed} failed\n  case: {case}\n  {detail}\n"
            f"  reproduce: pytest tests/fuzz -k 'fuzz and {target.name}' --fuzz-case {seed}"
        ) from None
    return case


@dataclass
class Tally:
    target: str
    cases: int = 0
    seconds: float = 0.0


def fuzz(target: Target, seconds: float, master: int, tier_list: list[str] | None = None) -> Tally:
    """Draws and checks cases of ``target`` for ``seconds`` (at least one case)."""
    tally = Tally(target.name)
    start = time.monotonic()
    while tally.cases == 0 or time.monotonic() - start < seconds:
        check_case(target, case_seed(master, target.name, tally.cases), tier_list)
        tally.cases += 1
    tally.seconds = time.monotonic() - start
    return tally


# Thread counts a case may run its kernels on; None: torch's count. The others move where the work splits.
THREADS = [None, None, None, 1, 3, 4]


def threaded_target(name, draw, inputs, run, reference, tolerance=None) -> Target:
    """A Target whose cases also draw the thread count the kernels split their work over."""

    def drawn(rng: random.Random) -> dict:
        case = draw(rng)
        case["threads"] = rng.choice(THREADS)
        return case

    def threaded(case, tensors):
        saved = kernforge.ops._common._threads_override
        kernforge.set_num_threads(case["threads"])
        try:
            return run(case, tensors)
        finally:
            kernforge.set_num_threads(saved)

    extra = {} if tolerance is None else {"tolerance": tolerance}
    return Target(name, drawn, inputs, threaded, reference, **extra)


# --------------------------------------------------------------------------- drawing helpers

# Sizes that break kernels: zero, one, primes, and both sides of the power-of-two tile edges.
EDGES = [1, 2, 3, 5, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257]
PRIMES = [2, 3, 5, 7, 11, 13, 31, 61, 127, 251, 509, 1021]
FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def size(rng: random.Random, high: int, *, zero: bool = True) -> int:
    """A size in [0 or 1, high], most often at an edge."""
    low = 0 if zero else 1
    pick = rng.random()
    if pick < 0.1 and zero:
        return 0
    if pick < 0.6:
        edges = [e for e in EDGES + PRIMES if low <= e <= high]
        return rng.choice(edges) if edges else rng.randint(low, high)
    return rng.randint(max(low, 1), high)


def generator(case: dict, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(case["seed"] * 7919 + salt)


def randn(shape, case: dict, *, dtype=torch.float32, scale: float = 1.0, salt: int = 0) -> torch.Tensor:
    return (torch.randn(shape, generator=generator(case, salt)) * scale).to(dtype)


def layout(rng: random.Random) -> str:
    """How a 2-D input is laid out: contiguous, with padded rows, or a transposed view."""
    return rng.choice(["contiguous", "contiguous", "padded", "transposed"])


def laid_out(x: torch.Tensor, how: str) -> torch.Tensor:
    """``x`` (2-D) with the same values, in ``how``'s memory layout."""
    if how == "padded":
        backing = torch.full((x.shape[0], x.shape[1] + 3), float("nan"), dtype=x.dtype)
        backing[:, : x.shape[1]] = x
        return backing[:, : x.shape[1]]
    if how == "transposed":
        return x.t().contiguous().t()
    return x.contiguous()
