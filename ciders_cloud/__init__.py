"""CIDERS cloud side: model preparation, TAKD, bundles, and (later) round aggregation."""

from .config import RunConfig, TakdConfig
from .prepare import distill, prepare

__all__ = ["RunConfig", "TakdConfig", "prepare", "distill"]
