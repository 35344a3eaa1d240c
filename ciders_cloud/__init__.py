"""CIDERS cloud side: model preparation, TAKD, bundles, and (later) round aggregation."""

from ciders_cloud.config import RunConfig, TakdConfig
from ciders_cloud.prepare import distill, prepare

__all__ = ["RunConfig", "TakdConfig", "prepare", "distill"]
