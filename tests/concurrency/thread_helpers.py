"""Running callables on threads of their own with a deadline (tests/concurrency)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

TIMEOUT = 180.0  # seconds for a whole concurrent phase on two busy cores


def run_in_threads(jobs: list[Callable[[], object]], timeout: float = TIMEOUT) -> list:
    """Run each job on a thread of its own, all released at once; their results, in order. A job's
    exception is raised here; a job still running after ``timeout`` seconds fails the test."""
    barrier = threading.Barrier(len(jobs))
    results: list = [None] * len(jobs)
    errors: list[BaseException] = []

    def body(i: int, job: Callable[[], object]) -> None:
        try:
            barrier.wait(timeout)
            results[i] = job()
        except BaseException as exc:  # re-raised on the test's thread
            errors.append(exc)

    threads = [
        threading.Thread(target=body, args=(i, job), name=f"concurrency-{i}", daemon=True) for i, job in enumerate(jobs)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    hung = [thread.name for thread in threads if thread.is_alive()]
    assert not hung, f"{hung} still running after {timeout:.0f} s: a deadlock"
    if errors:
        raise errors[0]
    return results
