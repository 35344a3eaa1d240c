"""Prepare's bootstrap: align the learnable backbone with the full one before round 0.

Dropping layers leaves gaps, and the AdapEmu layer after each gap must stand for the original layers
it replaces. Stage 1 fits each such layer on its own: fed the full backbone's residual stream where
the gap opens, it learns to output the stream where the gap closes (one layer forward and backward
per gap, so it is cheap). Stage 2 is end-to-end TAKD (eq. 2) over the same weights, so that what the
messenger receives and what it says match the teacher. Both train the layers' full weights, once;
the rounds then distil the backbone LoRA on top (eq. 13). With ``align_params = "lora"`` stage 2
trains the backbone LoRA instead and stage 1 is skipped (the recipe before the fidelity work).
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import Tensor

from ciders_cloud.models.layers import gap_layers
from ciders_cloud.models.takd import Distiller, adamw, hidden_term
from ciders_cloud.models.teacher import CloudModels
from ciders_cloud.run.config import RunConfig, TakdConfig
from ciders_edge.data.records import Example, batch_stream
from ciders_edge.errors import StateError
from ciders_edge.formats.atomic import write_safetensors
from ciders_edge.formats.checksums import sha256_file
from ciders_edge.model.forward import decoder_of, layer_outputs, run_layers
from ciders_edge.model.sources import ciders_home
from ciders_edge.progress import console, progress_bar
from ciders_edge.schedule import warmup_cosine

__all__ = ["gap_layers", "gap_parameters", "LayerAligner", "bootstrap"]


def gap_parameters(models: CloudModels) -> dict[str, torch.nn.Parameter]:
    """The base weights (no LoRA) of the gap layers, by their AdapEmu state-dict names."""
    layers = decoder_of(models.emu).layers
    out = {}
    for j in gap_layers(models.split):
        for name, p in layers[j].named_parameters():
            if "lora_" not in name:
                out[f"model.layers.{j}.{name.replace('base_layer.', '')}"] = p
    return out


class LayerAligner:
    """Stage 1: every gap layer regresses the full backbone's stream across its gap (hidden term only)."""

    def __init__(self, models: CloudModels, examples: list[Example], cfg: TakdConfig, steps: int, seed: int) -> None:
        self.models, self.cfg, self.steps = models, cfg, steps
        self.layers = gap_layers(models.split)
        self.params = list(gap_parameters(models).values())
        self.optimizer = adamw(self.params, cfg.layer_lr, 0.0)
        warmup = min(10, max(steps // 10, 0))
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda k: warmup_cosine(k, steps, warmup))
        pad = models.tokenizer.pad_token_id
        self.batches = batch_stream(examples, cfg.batch_size, random.Random(f"layers:{seed}"), pad)

    def step(self) -> dict[str, float]:
        m, kept = self.models, self.models.split.kept
        batch = m.on_device(next(self.batches))
        with m.autocast():
            with torch.no_grad():  # out[i]: the full backbone's stream after its first i layers
                stream, ctx = layer_outputs(
                    m.teacher, batch["input_ids"], batch["attention_mask"], m.split.n - m.split.a
                )
            valid = batch["attention_mask"].bool()
            for p in self.params:
                p.requires_grad_(True)
            losses = [
                self._layer_loss(j, stream[kept[j - 1] + 1], stream[kept[j] + 1], ctx, valid) for j in self.layers
            ]
            loss = torch.stack(losses).mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.cfg.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.clip)
        self.optimizer.step()
        self.schedule.step()
        for p in self.params:
            p.requires_grad_(False)
            p.grad = None
        return {"hidden": float(loss.detach()), "worst_layer": max(float(x.detach()) for x in losses)}

    def _layer_loss(self, j: int, opens: Tensor, closes: Tensor, ctx, valid: Tensor) -> Tensor:
        out = run_layers(self.models.emu, opens, ctx, j, j + 1)
        return hidden_term(out[valid], closes[valid], self.cfg.hidden_loss)

    def run(self) -> list[dict]:
        records = []
        with progress_bar() as bar:
            task = bar.add_task("bootstrap 1/2: layer fits", total=self.steps, metrics="")
            for k in range(self.steps):
                rec = {"type": "layer", "round": 0, "step": k + 1, **self.step()}
                records.append(rec)
                bar.update(task, advance=1, metrics=f"hidden {rec['hidden']:.4f}")
        return records


RECIPE_VERSION = 2  # bump when the bootstrap's code changes what it trains (the cache key's other half is the config)


def bootstrap(models: CloudModels, examples: list[Example], run: RunConfig) -> tuple[list[dict], Distiller | None]:
    """Stage 1 and stage 2 on ``examples``; returns their step records, and the stage-2 distiller when it
    trained the backbone LoRA (its optimizer then carries into the rounds).

    The trained layers are cached under ``$CIDERS_HOME/bootstrap`` by a hash of everything they depend
    on (source model, split, public data, recipe, seed, torch version): preparing the same model again
    (a study's second algorithm, a re-run) reuses them instead of spending minutes on the same result.
    """
    cfg = run.takd_config
    if not gap_layers(models.split):  # beta = 1: the AdapEmu is the full model already
        return [], None
    if cfg.align_params == "lora":
        distiller = Distiller(models, examples, cfg, seed=run.seed)
        return distiller.run(run.align_steps, label="bootstrap TAKD (LoRA)", kind="align"), distiller
    cache = _cache_path(run, models)
    if cache.is_file():
        _load_layers(models, load_file(cache))
        console.print(f"[green]✓[/] bootstrap reused from {cache}")
        with safe_open(cache, "pt") as f:
            return [{**r, "cached": True} for r in json.loads(f.metadata()["records"])], None
    records = _train_layers(models, examples, run)
    write_safetensors(cache, models.changed_layers(), {"records": json.dumps(records)})
    return records, None


def _train_layers(models: CloudModels, examples: list[Example], run: RunConfig) -> list[dict]:
    cfg, records = run.takd_config, []
    if run.layer_steps:
        records += LayerAligner(models, examples, cfg, run.layer_steps, run.seed).run()
    if run.align_steps:
        params = list(gap_parameters(models).values())
        distiller = Distiller(models, examples, cfg, seed=run.seed, params=params, lr=cfg.align_lr)
        records += distiller.run(run.align_steps, label="bootstrap 2/2: TAKD", kind="align")
    return records


def _cache_path(run: RunConfig, models: CloudModels) -> Path:
    """Where the layers this exact bootstrap produces are kept."""
    key = {
        "recipe": RECIPE_VERSION,
        "model": run.model_revision,
        "split": models.split.to_dict(),
        "public_data": sha256_file(Path(run.public_data)),
        "takd": run.takd_config.to_dict(),
        "steps": [run.layer_steps, run.align_steps],
        "seed": run.seed,
        "torch": torch.__version__,
        # not the device: a CUDA fit (bf16 autocast) differs from the CPU's only in rounding, the same
        # layers in meaning, like two CPUs whose kernels differ; a machine keeps reusing the one it has,
        # so its runs stay alike to the bit, and a different device's run of the same recipe need not
        # spend minutes again. A run's id and its bundles never depend on this cache's key.
    }
    if models.teacher.dtype != torch.float32:  # a bf16 teacher fits other layers (an fp32 one's key is as it was)
        key["teacher_dtype"] = str(models.teacher.dtype).removeprefix("torch.")
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return ciders_home() / "bootstrap" / f"{digest}.safetensors"


@torch.no_grad()
def _load_layers(models: CloudModels, layers: dict[str, Tensor]) -> None:
    params = gap_parameters(models)
    if set(layers) != set(params):
        raise StateError("a cached bootstrap does not match this AdapEmu's gap layers; delete $CIDERS_HOME/bootstrap")
    for name, value in layers.items():
        params[name].copy_(value)
