"""The timer: one sampler behind the benchmarks' ``measure`` / ``compare`` and the tuners' ``time_call``.

``measure`` runs warm-up calls, then takes samples until a time budget is spent (and at least
``min_samples``). A sample is the mean of ``inner`` back-to-back calls, with ``inner`` chosen so a
sample lasts >= ``sample_ns`` (20 us by default: perf_counter_ns costs ~50 ns, so a 1 us call timed
alone would be mostly clock). Every figure reported is the median of the samples.
``compare`` measures several implementations of one case in round-robin rounds, so a burst of noise
on a shared machine hits all of them alike. ``time_call`` is ``measure`` with one call per sample,
in seconds: what the tuners rank candidates by.

Only the standard library is imported: ``kernforge.jit.tuning`` imports this module.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# The clock every sample reads (a module attribute so a test can substitute a fake one).
now_ns: Callable[[], int] = time.perf_counter_ns

# Warm-up never takes more calls than this, whatever warmup_s asks (a 10 ns call would take forever).
_MAX_WARMUP_CALLS = 100_000


@dataclass
class Timing:
    """Summary of one function's samples, in ns per call."""

    median_ns: float
    p25_ns: float
    p75_ns: float
    samples: int
    inner: int
    values_ns: list[float] = field(default_factory=list, repr=False)

    @property
    def us(self) -> float:
        return self.median_ns / 1e3

    def spread(self) -> float:
        """Interquartile range relative to the median."""
        return (self.p75_ns - self.p25_ns) / self.median_ns if self.median_ns else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "median_ns": self.median_ns,
            "p25_ns": self.p25_ns,
            "p75_ns": self.p75_ns,
            "samples": self.samples,
            "inner": self.inner,
        }


def summarize(values: list[float], inner: int) -> Timing:
    """Median and quartiles of per-call sample values (ns)."""
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=4) if len(ordered) >= 2 else [ordered[0]] * 3
    return Timing(statistics.median(ordered), q[0], q[2], len(ordered), inner, ordered)


def _warm_up(fn: Callable[[], object], warmup: int, warmup_s: float) -> float:
    """Call ``fn`` at least ``warmup`` times and for ``warmup_s``; the last call's ns (>= 1)."""
    n, start = 0, now_ns()
    while True:
        t0 = now_ns()
        fn()
        last = now_ns() - t0
        n += 1
        if (n >= warmup and now_ns() - start >= warmup_s * 1e9) or n >= _MAX_WARMUP_CALLS:
            return max(float(last), 1.0)


def _calls_per_sample(fn: Callable[[], object], estimate_ns: float, sample_ns: float) -> int:
    """Calls per sample so one lasts >= ``sample_ns``. Re-estimated over a short batch first: the
    single last warm-up call can be an outlier. ``sample_ns`` <= 0: one call per sample, no batch
    (calls long enough that the clock is noise, or the tuners' candidates, each a costly call)."""
    if sample_ns <= 0:
        return 1
    k = max(1, min(1000, int(sample_ns / estimate_ns)))
    t0 = now_ns()
    for _ in range(k):
        fn()
    per_call = max((now_ns() - t0) / k, 1.0)
    return max(1, int(sample_ns / per_call))


class Sampler:
    """Collects samples of one function, over one or several rounds."""

    def __init__(self, fn: Callable[[], object], warmup: int, warmup_s: float, sample_ns: float) -> None:
        self.fn = fn
        self.values: list[float] = []
        self.inner = _calls_per_sample(fn, _warm_up(fn, warmup, warmup_s), sample_ns)

    def run(self, budget_s: float, min_samples: int, max_samples: int) -> None:
        """Samples until ``budget_s`` is spent and ``min_samples`` taken, at most ``max_samples``.
        The collector is off meanwhile: a collection inside a sample would be charged to ``fn``."""
        deadline = now_ns() + budget_s * 1e9
        taken = 0
        gc_was = gc.isenabled()
        gc.disable()
        try:
            while taken < max_samples and (taken < min_samples or now_ns() < deadline):
                self.values.append(self._sample())
                taken += 1
        finally:
            if gc_was:
                gc.enable()

    def _sample(self) -> float:
        fn, inner = self.fn, self.inner
        t0 = now_ns()
        for _ in range(inner):
            fn()
        return (now_ns() - t0) / inner

    def timing(self) -> Timing:
        return summarize(self.values, self.inner)


def measure(
    fn: Callable[[], object],
    *,
    budget_s: float = 0.5,
    min_samples: int = 7,
    max_samples: int = 20_000,
    warmup: int = 3,
    warmup_s: float = 0.02,
    sample_ns: float = 20_000,
) -> Timing:
    """Median time of ``fn()`` after warm-up, over many samples within ``budget_s``."""
    s = Sampler(fn, warmup, warmup_s, sample_ns)
    s.run(budget_s, min_samples, max_samples)
    return s.timing()


def compare(
    fns: dict[str, Callable[[], object]],
    *,
    budget_s: float = 0.5,
    rounds: int = 3,
    min_samples: int = 7,
    warmup: int = 3,
    warmup_s: float = 0.02,
    sample_ns: float = 20_000,
) -> dict[str, Timing]:
    """Median times of several implementations, sampled round-robin.

    ``budget_s`` is per implementation, split over ``rounds``."""
    samplers = {name: Sampler(fn, warmup, warmup_s, sample_ns) for name, fn in fns.items()}
    per_round_min = max(1, -(-min_samples // rounds))
    for _ in range(rounds):
        for s in samplers.values():
            s.run(budget_s / rounds, per_round_min, 20_000)
    return {name: s.timing() for name, s in samplers.items()}


def time_call(run: Callable[[], object], min_seconds: float = 0.2, max_calls: int = 50) -> float:
    """Median seconds of one ``run()`` after a warm-up call (which also compiles): at least 3 calls,
    more until ``min_seconds`` have passed, at most ``max_calls``. What the tuners time candidates
    with by default (``kernforge.jit.tuning.time_call``)."""
    t = measure(run, budget_s=min_seconds, min_samples=3, max_samples=max_calls, warmup=1, warmup_s=0.0, sample_ns=0.0)
    return t.median_ns / 1e9
