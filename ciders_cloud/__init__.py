"""CIDERS cloud side: prepare a run (split, bootstrap, bundles), TAKD, round aggregation, the
simulated study (``study/``) and the networked fleet (``fleet/``). A run folder's layout:
:mod:`ciders_cloud.run_folder`."""

from ciders_cloud.config import RunConfig, TakdConfig
from ciders_cloud.prepare import distill, prepare

__all__ = ["RunConfig", "TakdConfig", "prepare", "distill"]
