"""One error hierarchy for the toolkit (after huggingface_hub's ``errors.py``).

Every user-facing failure is a :class:`CidersError`; the CLIs turn it into one line on stderr and
exit code 1. Subclasses also inherit the matching built-in so callers can catch either.
"""

from __future__ import annotations


class CidersError(Exception):
    """Root of every error the toolkit raises on purpose."""


class ConfigError(CidersError, ValueError):
    """A configuration value, flag or profile is invalid."""


class ModelError(CidersError, ValueError):
    """A model cannot be found, converted or split."""


class DataError(CidersError, ValueError):
    """A data file is missing, empty or malformed."""


class BundleError(CidersError, OSError):
    """A bundle is missing files, fails its checksums or does not match."""


class PacketError(CidersError, ValueError):
    """A packet is corrupt, for another round or bundle, or holds bad values."""


class StateError(CidersError, OSError):
    """Client or server state is missing, corrupt or made for something else."""


class ExportError(CidersError, OSError):
    """An exported model folder is missing files, fails its checksums or does not match."""
