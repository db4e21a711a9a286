"""What differs between the transformers releases the integration supports, detected by feature,
never by version number, and the one warning for a release outside the tested range.

* The KV cache argument: transformers 5.24 renamed the decoder's ``past_key_values`` to ``cache``
  (the old name stays a deprecated alias until 5.40). :func:`cache_argument` reads which one a
  ``forward`` takes from its signature; :func:`take_cache` accepts either in a call's kwargs.
* The tested range is the ``transformers`` requirement of kernforge's ``transformers`` extra
  (:mod:`kernforge.integrations._versions`).
"""

from __future__ import annotations

import inspect

from packaging.requirements import Requirement

from kernforge.integrations import _versions

CACHE_ARGUMENTS = ("cache", "past_key_values")  # newest name first


def cache_argument(forward) -> str:
    """The keyword under which ``forward`` (a decoder's or a causal LM's) takes the KV cache."""
    parameters = inspect.signature(forward).parameters
    return next((name for name in CACHE_ARGUMENTS if name in parameters), "past_key_values")


def take_cache(kwargs: dict):
    """The cache a call passed under either name, both names removed from ``kwargs``; None if none.
    Both at once is the caller's error, as transformers' own alias makes it."""
    found = [cache for cache in (kwargs.pop(name, None) for name in CACHE_ARGUMENTS) if cache is not None]
    if len(found) > 1:
        raise TypeError("pass the KV cache as one of cache= or past_key_values=, not both")
    return found[0] if found else None


def tested_requirement() -> Requirement | None:
    """The ``transformers`` requirement of kernforge's ``transformers`` extra (None without metadata)."""
    return _versions.tested_requirement("transformers", "transformers")


def check_version(version: str, requirement: Requirement | None) -> str | None:
    """The warning for a transformers ``version`` outside the tested range, or None."""
    return _versions.check_version("transformers", version, requirement)


def warn_if_untested(version: str) -> None:
    _versions.warn_if_untested("transformers", "transformers", version, stacklevel=4)
