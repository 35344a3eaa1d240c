"""FedNest and LFedNest: the baselines that solve the messenger/backbone bilevel problem with a hypergradient.

Both need ``grad_x f - grad_xy g [grad_yy g]^-1 grad_y f`` (docs/design.md §2, eq. 3; the write-up: §6).
The inner problem g is the cloud's own (its public data and teacher, :mod:`.bilevel`), so the cloud
computes the indirect term with FedIHGP's Neumann series (:mod:`.hypergradient`); the edges contribute
only the client loss's gradients at the bundle's point (``ciders_edge.training.bilevel``). Their settings
are the run's ``fednest`` table (:mod:`.settings`); edges receive only ``probe_batches`` (and, from
LFedNest, ``grad_y_in_packet``).
"""

from ciders_cloud.strategies.fednest.settings import FedNestSettings
from ciders_cloud.strategies.fednest.strategies import FedNest, LFedNest

__all__ = ["FedNest", "LFedNest", "FedNestSettings"]
