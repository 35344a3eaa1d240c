"""The edge's side of a networked fleet (``ciders-edge join``; docs/fleet.md), on Flower.

``edge`` holds what a round does on the device, without Flower; ``client_app`` is the Flower
ClientApp around it; ``join`` runs this device's SuperNode. The cloud's side imports
``protocol`` and ``bundle_sync`` from here, so both ends speak one format.
"""
