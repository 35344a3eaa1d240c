"""CIDERS cloud side, grouped by job: ``prepare`` (split, bootstrap, round-0 bundles) and ``distill``;
``round/`` (packet intake, eq. 11–13, the next bundles); ``strategies/`` (CIDERS and its baselines);
``models/`` (teacher, learnable backbones, TAKD, fidelity); ``run/`` (the run folder, its config and
server state); ``study/`` (simulate, report); ``fleet/`` (Flower). A run folder's layout:
:mod:`ciders_cloud.run.folder`."""

from ciders_cloud.prepare import distill, prepare
from ciders_cloud.run.config import RunConfig, TakdConfig

__all__ = ["RunConfig", "TakdConfig", "prepare", "distill"]
