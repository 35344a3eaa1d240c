"""The cloud's side of a networked fleet on Flower: ``ciders-cloud serve`` and ``ciders-cloud certs``.

``coordinator`` is a fleet round without Flower (which edges, what to ship, which packets to
take, the one aggregation of ``ciders-cloud aggregate``); ``server_app`` is the Flower ServerApp
that drives it; ``serve`` runs the SuperLink and submits the app; ``certs`` makes TLS material.
"""
