"""The torchft version elastic replicas are built for, checked when a strategy with ``elastic=`` is built.

The elastic layer calls torchft's Lighthouse client and its reconfigurable ``ProcessGroupGloo``, whose
calls change between releases (``ProcessGroupGloo.configure`` is gone in 0.3). An installed version other
than the one the ``elastic`` extra pins is refused here, naming both and the fix, rather than failing
later, membership by membership, while the run trains on.
"""

from __future__ import annotations

import re
from importlib import metadata
from typing import Any, Optional

TORCHFT_VERSION = "0.2.0"  # the version the extra pins and the tests run
DISTRIBUTIONS = ("torchft", "torchft-nightly")  # the names torchft is published under


def installed_torchft_version() -> Optional[str]:
    """The installed torchft's version, from its package metadata (None: no metadata names one)."""
    for name in DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def release_of(version: str) -> str:
    """The release part of a version string: ``0.2.0`` of ``0.2.0+cpu`` or ``0.2.0.post1``."""
    found = re.match(r"\d+(?:\.\d+)*", version.strip())
    return found.group(0) if found is not None else ""


def check_torchft_version(module: Any, version: Optional[str] = None) -> Any:
    """Returns ``module`` (torchft) if ``version`` (default: the installed one) is the supported release;
    raises ``ImportError`` naming the installed version, the supported one and how to install it otherwise."""
    version = installed_torchft_version() if version is None else version
    if version is not None and release_of(version) == TORCHFT_VERSION:
        return module
    found = f"torchft {version} is installed" if version is not None else "the installed torchft has no version"
    raise ImportError(
        f"Elastic replicas (elastic=ElasticConfig(...)) support torchft {TORCHFT_VERSION} only, and {found}: the "
        "process-group and Lighthouse calls they make differ between torchft releases, and a replica that cannot "
        f"set up its group would train alone. Install the supported version with `pip install torchft=="
        f"{TORCHFT_VERSION}` (or `pip install 'lightning-loco[elastic]'`), or leave elastic=None for the static "
        "launch."
    )
