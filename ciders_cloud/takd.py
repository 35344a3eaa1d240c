"""Task-aware knowledge distillation of the learnable backbone (eq. 2).

Only the backbone LoRA trains; the messenger (with the global LoRA v) is held fixed and is used
both on top of the full backbone (AdapFu, the teacher) and of the learnable one (AdapEmu).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from ciders_edge.assembly import backbone_hidden, messenger_logits
from ciders_edge.data import IGNORE, Example, batch_stream
from ciders_edge.lora import BACKBONE, lora_parameters, set_trainable
from ciders_edge.progress import progress_bar

from .config import TakdConfig
from .models import CloudModels
from .state import optimizer_from_tensors, optimizer_to_tensors

__all__ = ["takd_loss", "takd_terms", "Distiller"]


def takd_loss(
    h_student: Tensor,
    h_teacher: Tensor,
    logits_student: Tensor,
    logits_teacher: Tensor,
    targets: Tensor,
    lambda_out: float,
    lambda_task: float,
) -> dict[str, Tensor]:
    """Eq. (2): ||h_L - h_F||^2 + lambda_out * KL(AdapFu || AdapEmu) + lambda_task * CE(AdapEmu, y).

    Args:
        h_student, h_teacher: hidden states entering the messenger at the valid tokens (N, H);
            the squared norm is averaged per element so the term does not scale with H.
        logits_student, logits_teacher: next-token logits at the same tokens (N, V).
        targets: next tokens (N,), ``IGNORE`` outside responses (no CE there).
    """
    hidden_mse = F.mse_loss(h_student, h_teacher)
    kl = F.kl_div(
        F.log_softmax(logits_student.float(), -1),
        F.log_softmax(logits_teacher.float(), -1),
        log_target=True,
        reduction="batchmean",
    )
    resp = targets != IGNORE
    ce = F.cross_entropy(logits_student[resp].float(), targets[resp]) if resp.any() else kl.new_zeros(())
    loss = hidden_mse + lambda_out * kl + lambda_task * ce
    return {"loss": loss, "hidden_mse": hidden_mse, "kl": kl, "ce": ce}


def takd_terms(models: CloudModels, batch: dict[str, Tensor], cfg: TakdConfig) -> dict[str, Tensor]:
    """Eq. (2) on one batch, differentiable in whichever LoRA requires grad (the teacher's
    messenger is the AdapEmu's, so the loss depends on the messenger LoRA through both sides)."""
    m, split = models, models.split
    ids, mask = batch["input_ids"], batch["attention_mask"]
    valid = torch.nonzero(mask[:, :-1].bool(), as_tuple=True)  # tokens that predict a next one
    targets = batch["labels"][:, 1:][valid]
    with torch.no_grad():  # the frozen full backbone B_F
        h_full, ctx_full = backbone_hidden(m.teacher, ids, mask, split.n - split.a)
    logits_t = messenger_logits(m.emu, h_full, ctx_full, split.n_kept, valid)  # AdapFu
    h_emu, ctx = backbone_hidden(m.emu, ids, mask, split.n_kept)
    logits_s = messenger_logits(m.emu, h_emu, ctx, split.n_kept, valid)  # AdapEmu
    return takd_loss(h_emu[valid], h_full[valid], logits_s, logits_t, targets, cfg.lambda_out, cfg.lambda_task)


class Distiller:
    """Warm-startable TAKD: the step counter drives the data order, so a resumed run continues it."""

    def __init__(
        self,
        models: CloudModels,
        examples: list[Example],
        cfg: TakdConfig,
        optimizer_state: dict[str, Tensor] | None = None,
        step: int = 0,
        seed: int = 0,
    ) -> None:
        self.models, self.cfg, self.step_count = models, cfg, step
        self.params = list(lora_parameters(models.emu, BACKBONE).values())
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        optimizer_from_tensors(self.optimizer, optimizer_state or {})
        pad = models.tokenizer.pad_token_id
        self.batches: Iterator[dict[str, Tensor]] = batch_stream(
            examples, cfg.batch_size, random.Random(f"{seed}:{step}"), pad
        )

    def step(self) -> dict[str, float]:
        m = self.models
        set_trainable(m.emu, BACKBONE)  # the messenger (and so the teacher's logits) has no graph
        terms = takd_terms(m, next(self.batches), self.cfg)
        self.optimizer.zero_grad(set_to_none=True)
        terms["loss"].backward()
        if self.cfg.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.clip)
        self.optimizer.step()
        set_trainable(m.emu, None)
        self.step_count += 1
        return {k: float(v.detach()) for k, v in terms.items()}

    def run(self, steps: int, round_: int = 0, label: str = "TAKD") -> list[dict]:
        """Run ``steps`` steps with a progress bar; returns each step's loss terms."""
        records = []
        with progress_bar() as bar:
            task = bar.add_task(label, total=steps, metrics="")
            for _ in range(steps):
                rec = {"round": round_, "step": self.step_count + 1, **self.step()}
                records.append(rec)
                bar.update(
                    task, advance=1, metrics=f"loss {rec['loss']:.3f}  mse {rec['hidden_mse']:.4f}  kl {rec['kl']:.3f}"
                )
        return records

    def optimizer_state(self) -> dict[str, Tensor]:
        return optimizer_to_tensors(self.optimizer)
