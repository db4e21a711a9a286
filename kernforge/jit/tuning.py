"""Tile candidates as data, and a store of measured winners.

A kernel lists its :class:`Candidate` configurations (module parameters such as
a tile shape, the tiers they are built for, a static rank and a predicate on
the problem shape) plus a reference fallback that applies everywhere.
:meth:`Candidates.choose` returns the remembered winner for the problem's
shape bucket on this tier and CPU model if there is one, else the best-ranked
applicable candidate. :meth:`Candidates.tune` times the applicable candidates
and remembers the fastest.

Records live in ``<cache>/tuning/<kernel>.json``, keyed by (shape bucket, tier,
CPU model) and stamped with the kernforge version. A corrupt file, a record
from another version, or a winner that is no longer a candidate is ignored
with a warning, never trusted.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import filelock

from kernforge._version import __version__

# The tuners time candidates with this (the benchmarks' timer); re-exported: tune.py calls
# tuning.time_call at call time, so a test can substitute it here.
from kernforge.bench.timing import time_call as time_call
from kernforge.cache import disk
from kernforge.jit import isa
from kernforge.jit.module import Module

log = logging.getLogger("kernforge")


def _always(shape: Mapping[str, int]) -> bool:
    return True


@dataclass(frozen=True)
class Candidate:
    """One configuration of a kernel: module parameters (beyond the problem's own,
    such as dtype), the built tiers it exists for, a static rank (lower first) and
    a predicate saying which problem shapes it serves."""

    params: Mapping[str, Any]
    tiers: tuple[str, ...]
    rank: int = 0
    when: Callable[[Mapping[str, int]], bool] = field(default=_always, compare=False)

    def label(self) -> str:
        return ",".join(f"{k}={_jsonable(v)}" for k, v in sorted(self.params.items()))


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


class Candidates:
    """A kernel's candidate configurations, its fallback, and how shapes are bucketed."""

    def __init__(
        self,
        kernel: str,
        module: Module,
        candidates: list[Candidate],
        reference: Candidate,
        bucket: Callable[[Mapping[str, int]], str],
    ):
        self.kernel, self.module, self.reference, self.bucket = kernel, module, reference, bucket
        self.candidates = sorted(candidates, key=lambda c: c.rank)

    def applicable(self, shape: Mapping[str, int], tier: str) -> list[Candidate]:
        """Candidates for ``shape`` on the built ``tier``, best-ranked first, the reference last."""
        found = [c for c in self.candidates if tier in c.tiers and c.when(shape)]
        return found + [self.reference]

    def default(self, shape: Mapping[str, int], tier: str) -> Candidate:
        return self.applicable(shape, tier)[0]

    def choose(self, shape: Mapping[str, int], tier: str | None = None, store: TuningStore | None = None) -> Candidate:
        """The remembered winner for this shape bucket, tier and CPU, else the default."""
        tier = self._built(tier)
        options = self.applicable(shape, tier)
        recorded = (store or TuningStore()).lookup(self.kernel, self.bucket(shape), tier)
        if recorded is not None:
            for candidate in options:
                if _jsonable_params(candidate.params) == recorded:
                    return candidate
            log.warning(
                "tuning record for %s %s names %s, which is not a candidate here; using the default",
                self.kernel,
                self.bucket(shape),
                recorded,
            )
        return options[0]

    def tune(
        self,
        shape: Mapping[str, int],
        measure: Callable[[Candidate], float],
        tier: str | None = None,
        store: TuningStore | None = None,
        min_gain: float = 0.0,
    ) -> Candidate:
        """Time every applicable candidate with ``measure`` (seconds, lower is better) and
        remember the fastest for this shape bucket, tier and CPU model. The default is always
        among them, and another candidate displaces it only when faster by more than the fraction
        ``min_gain`` (so a measurement's noise alone never trades the default for an equal)."""
        tier = self._built(tier)
        timings = [(measure(c), c) for c in self.applicable(shape, tier)]
        default_seconds, winner = timings[0]
        seconds, fastest = min(timings, key=lambda t: t[0])
        if seconds < default_seconds * (1 - min_gain):
            winner = fastest
        (store or TuningStore()).record(
            self.kernel, self.bucket(shape), tier, _jsonable_params(winner.params), {c.label(): s for s, c in timings}
        )
        return winner

    def _built(self, tier: str | None) -> str:
        return self.module.built_tier(tier or isa.selected_tier())


def _jsonable_params(params: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _jsonable(v) for k, v in sorted(params.items())}


class TuningStore:
    """Measured winners, one JSON file per kernel under ``<root>/tuning``."""

    def __init__(self, root: Path | None = None):
        self.root = (root or disk.cache_root()) / "tuning"

    def lookup(self, kernel: str, bucket: str, tier: str) -> dict[str, Any] | None:
        record = self._load(kernel).get(self._key(bucket, tier))
        if record is None:
            return None
        if record.get("kernforge_version") != __version__ or not isinstance(record.get("winner"), dict):
            log.warning(
                "ignoring a stale tuning record for %s %s (kernforge %s; this is %s)",
                kernel,
                bucket,
                record.get("kernforge_version"),
                __version__,
            )
            return None
        return record["winner"]

    def record(self, kernel: str, bucket: str, tier: str, winner: dict[str, Any], seconds: dict[str, Any]) -> None:
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        with filelock.FileLock(str(self._path(kernel)) + ".lock"):
            records = self._load(kernel)
            records[self._key(bucket, tier)] = {
                "winner": winner,
                "seconds": seconds,
                "kernforge_version": __version__,
                "cpu_model": isa.cpu_model(),
                "tier": tier,
                "bucket": bucket,
            }
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f"{kernel}.json.tmp-")
            with os.fdopen(fd, "w") as f:
                json.dump(records, f, indent=1, sort_keys=True)
            os.replace(tmp, self._path(kernel))

    def _key(self, bucket: str, tier: str) -> str:
        return f"{bucket}|{tier}|{isa.cpu_model()}"

    def _path(self, kernel: str) -> Path:
        return self.root / f"{kernel}.json"

    def _load(self, kernel: str) -> dict[str, Any]:
        path = self._path(kernel)
        try:
            records = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("ignoring the corrupt tuning file %s (%s)", path, exc)
            return {}
        if not isinstance(records, dict):
            log.warning("ignoring the corrupt tuning file %s (not a JSON object)", path)
            return {}
        return records
