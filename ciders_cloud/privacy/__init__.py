"""Client-level differential privacy of the cloud's aggregate (DP-FedAvg, docs/privacy.md): the run's
settings (``run/dp_settings.py``, data of the run), the Gaussian mechanism on eq. (12)'s mean, and the
privacy accountant."""

from ciders_cloud.privacy.accountant import PrivacySpent, privacy_spent, solve_noise_multiplier
from ciders_cloud.privacy.mechanism import GaussianMechanism, study_generator
from ciders_cloud.privacy.release import BudgetError, PrivateRelease, with_noise
from ciders_cloud.run.dp_settings import CLIP_SITES, SAMPLINGS, PrivacySettings

__all__ = [
    "PrivacySettings",
    "SAMPLINGS",
    "CLIP_SITES",
    "PrivacySpent",
    "privacy_spent",
    "solve_noise_multiplier",
    "GaussianMechanism",
    "study_generator",
    "PrivateRelease",
    "BudgetError",
    "with_noise",
]
