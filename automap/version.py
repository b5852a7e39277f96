"""automap's version (``automap.__version__``, ``automap --version``): the installed
distribution's, read from its metadata when first asked; this checkout's pyproject version when
automap runs from a source tree that was never installed. Imports nothing heavy."""

from __future__ import annotations

from importlib import metadata

SOURCE_VERSION = "0.1.0"  # pyproject.toml's; tests/api/test_first_hour.py keeps them equal


def installed_version() -> str:
    """The version of the installed ``automap`` distribution, else :data:`SOURCE_VERSION`."""
    try:
        return metadata.version("automap")
    except metadata.PackageNotFoundError:
        return SOURCE_VERSION
