"""What differs between the transformers releases the integration supports, detected by feature,
never by version number, and the one warning for a release outside the tested range.

* The KV cache argument: transformers 5.24 renamed the decoder's ``past_key_values`` to ``cache``
  (the old name stays a deprecated alias until 5.40). :func:`cache_argument` reads which one a
  ``forward`` takes from its signature; :func:`take_cache` accepts either in a call's kwargs.
* The tested range is the ``transformers`` requirement of kernforge's ``transformers`` extra, read
  from the installed package's metadata (pyproject.toml is its one source).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import warnings

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

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
    """The ``transformers`` requirement of kernforge's ``transformers`` extra; None when kernforge
    runs from a source tree without installed metadata."""
    try:
        requirements = importlib.metadata.requires("kernforge") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for line in requirements:
        requirement = Requirement(line)
        if requirement.name == "transformers" and requirement.marker is not None:
            if requirement.marker.evaluate({"extra": "transformers"}):
                return requirement
    return None


def check_version(version: str, requirement: Requirement | None) -> str | None:
    """The warning for a transformers ``version`` outside the tested range, or None."""
    if requirement is None:
        return None
    try:
        inside = requirement.specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        inside = False
    if inside:
        return None
    return (
        f"kernforge.integrations.transformers was tested with transformers{requirement.specifier}; "
        f"transformers {version} is installed. It may work; if a forward fails, install a tested "
        f"release: pip install 'kernforge[transformers]'"
    )


def warn_if_untested(version: str) -> None:
    message = check_version(version, tested_requirement())
    if message is not None:
        warnings.warn(message, UserWarning, stacklevel=3)
