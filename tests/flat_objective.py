"""The tests' objectives over ``dict[str, Tensor]`` (quadratic losses written as the paper states them),
seen as the flat objective ``local_update`` runs on: points are handed over as views of the flat x."""

from contextlib import nullcontext

from ciders_edge.tensors import FlatLayout, Tensors


class AsFlat:
    """``objective`` has ``batch()`` and ``gradient(x: Tensors, batch) -> (loss, Tensors)``; ``like`` names
    the tensors (and their order, shapes, device) of the points."""

    def __init__(self, objective, like: Tensors) -> None:
        self.objective, self.layout = objective, FlatLayout.of(like)
        self.device = next(iter(like.values())).device

    def batch(self):
        return self.objective.batch()

    def flat_gradient(self, x, batch):
        loss, g = self.objective.gradient(self.layout.unflatten(x), batch)
        return loss, self.layout.flatten(g, dtype=x.dtype, device=x.device)

    def rng_scope(self):
        return nullcontext()
