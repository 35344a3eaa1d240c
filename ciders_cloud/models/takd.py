"""Task-aware knowledge distillation of the learnable backbone (eq. 2).

The messenger (with the global LoRA v) is held fixed and runs on top of both the full backbone
(AdapFu, the teacher) and the learnable one (AdapEmu, the student). What trains is a list of
parameters: the backbone LoRA each round (eq. 13), or the weights of the layers after each gap
during prepare's bootstrap (:mod:`.bootstrap`).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from ciders_cloud.models.teacher import CloudModels
from ciders_cloud.run.config import RunConfig, TakdConfig
from ciders_cloud.run.server_state import optimizer_from_tensors, optimizer_to_tensors
from ciders_edge.data.records import IGNORE, Example, batch_stream, load_examples
from ciders_edge.model.forward import Recompute, backbone_hidden, messenger_logits
from ciders_edge.model.lora import BACKBONE_ADAPTER, lora_parameters, set_trainable
from ciders_edge.progress import progress_bar

__all__ = ["hidden_term", "task_term", "takd_loss", "takd_terms", "Distiller", "adamw", "public_split", "TERMS"]

TERMS = ("loss", "hidden", "kl", "ce")


def adamw(params: list[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW as the cloud trains with it: torch's fused kernel on the CPU and CUDA. The default (foreach)
    step builds temporaries as large as every parameter at once, 1.6 GiB over the bootstrap's 537M
    weights at SmolLM2-1.7B; the fused one steps each tensor in place, the same numbers to 2e-7, and
    runs several times faster on the CPU."""
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype == torch.float32 for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)


def hidden_term(h_student: Tensor, h_teacher: Tensor, form: str = "relative") -> Tensor:
    """Eq. (2)'s hidden-state term ``||h_L - h_F||^2`` at N tokens (N, H).

    ``relative`` (default): the mean over tokens of ``||h_L - h_F||^2 / ||h_F||^2``. Every token counts
    alike and the term has no scale (0: exact, 1: as far off as a zero vector), so it sits beside the
    KL in nats. SmolLM2's residual stream has a few massive dimensions (norm ~25,000 on the first
    token against ~300 elsewhere): in the raw form that one token is the whole term, 10^4 times the KL.
    ``mse``: the paper's raw squared error, averaged per element.
    """
    if form == "mse":
        return F.mse_loss(h_student, h_teacher)
    err = (h_student.float() - h_teacher.float()).pow(2).sum(-1)
    return (err / h_teacher.float().pow(2).sum(-1).clamp_min(1e-12)).mean()


def task_term(logits_student: Tensor, logits_teacher: Tensor, targets: Tensor, form: str = "excess") -> Tensor:
    """Eq. (2)'s task term CE(AdapEmu, y), the mean over the response tokens (``targets != IGNORE``).

    ``excess`` (default): ``max(0, CE_L - CE_F)``, the student's mean CE beyond the teacher's (AdapFu's)
    on the same batch. It pulls the emulator's NLL down to the full model's and no further: an emulator
    that beats the full model at a task (the public data may hold the edges' own tasks) hides from the
    messenger what the full backbone cannot do, and what the messenger learns on it then transfers
    poorly to AdapFu. ``ce``: the paper's plain CE.
    """
    resp = targets != IGNORE
    if not resp.any():
        return logits_student.new_zeros((), dtype=torch.float32)
    ce = F.cross_entropy(logits_student[resp].float(), targets[resp])
    if form == "excess":
        with torch.no_grad():
            ce_teacher = F.cross_entropy(logits_teacher[resp].float(), targets[resp])
        ce = (ce - ce_teacher).clamp_min(0)
    return ce


def takd_loss(
    h_student: Tensor,
    h_teacher: Tensor,
    logits_student: Tensor,
    logits_teacher: Tensor,
    targets: Tensor,
    *,
    lambda_out: float,
    lambda_task: float,
    lambda_hidden: float = 1.0,
    hidden_loss: str = "relative",
    task_loss: str = "excess",
) -> dict[str, Tensor]:
    """Eq. (2): lambda_hidden ||h_L - h_F||^2 + lambda_out KL(AdapFu || AdapEmu) + lambda_task CE(AdapEmu, y).

    Args:
        h_student, h_teacher: hidden states entering the messenger at the valid tokens (N, H).
        logits_student, logits_teacher: next-token logits at the same tokens (N, V).
        targets: next tokens (N,), ``IGNORE`` outside responses (no CE there).
    """
    hidden = hidden_term(h_student, h_teacher, hidden_loss)
    kl = F.kl_div(
        F.log_softmax(logits_student.float(), -1),
        F.log_softmax(logits_teacher.float(), -1),
        log_target=True,
        reduction="batchmean",
    )
    ce = task_term(logits_student, logits_teacher, targets, task_loss)
    loss = lambda_hidden * hidden + lambda_out * kl + lambda_task * ce
    return {"loss": loss, "hidden": hidden, "kl": kl, "ce": ce}


def takd_terms(
    models: CloudModels, batch: dict[str, Tensor], cfg: TakdConfig, checkpoint: Recompute = False
) -> dict[str, Tensor]:
    """Eq. (2) on one batch, differentiable in whatever requires grad (the teacher's messenger is the
    AdapEmu's, so the loss depends on the messenger LoRA through both sides). The caller picks the
    precision (:func:`ciders_cloud.models.device.autocast` or none); ``checkpoint``: the AdapEmu's
    activations are recomputed in backward, not kept (:attr:`CloudModels.checkpoint`)."""
    m, split = models, models.split
    batch = m.on_device(batch)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    valid = torch.nonzero(mask[:, :-1].bool(), as_tuple=True)  # tokens that predict a next one
    targets = batch["labels"][:, 1:][valid]
    with torch.no_grad():  # the frozen full backbone B_F
        h_full, ctx_full = backbone_hidden(m.teacher, ids, mask, split.n - split.a)
    logits_t = messenger_logits(m.emu, h_full, ctx_full, split.n_kept, valid, checkpoint)  # AdapFu
    h_emu, ctx = backbone_hidden(m.emu, ids, mask, split.n_kept, checkpoint)
    logits_s = messenger_logits(m.emu, h_emu, ctx, split.n_kept, valid, checkpoint)  # AdapEmu
    return takd_loss(
        h_emu[valid],
        h_full[valid],
        logits_s,
        logits_t,
        targets,
        lambda_out=cfg.lambda_out,
        lambda_task=cfg.lambda_task,
        lambda_hidden=cfg.lambda_hidden,
        hidden_loss=cfg.hidden_loss,
        task_loss=cfg.task_loss,
    )


def public_split(run: RunConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[list[Example], list[Example]]:
    """The public data as (TAKD's records, the held-out records fidelity is measured on).

    A seeded draw, the same in every command of a run, so no held-out record is ever distilled on.
    At most a fifth of the records are held out.
    """
    cfg = run.takd_config
    examples = load_examples(run.public_data, tokenizer, cfg.seq_len)
    held = set(random.Random(f"holdout:{run.seed}").sample(range(len(examples)), min(cfg.holdout, len(examples) // 5)))
    train = [e for i, e in enumerate(examples) if i not in held]
    return train, [e for i, e in enumerate(examples) if i in held]


class Distiller:
    """Warm-startable TAKD: the step counter drives the data order, so a resumed run continues it.

    ``params`` defaults to the backbone LoRA (the per-round TAKD); its AdamW moments are what
    :meth:`optimizer_state` returns for the server state.
    """

    def __init__(
        self,
        models: CloudModels,
        examples: list[Example],
        cfg: TakdConfig,
        optimizer_state: dict[str, Tensor] | None = None,
        step: int = 0,
        seed: int = 0,
        params: list[torch.nn.Parameter] | None = None,
        lr: float | None = None,
    ) -> None:
        self.models, self.cfg, self.step_count = models, cfg, step
        self.params = params if params is not None else list(lora_parameters(models.emu, BACKBONE_ADAPTER).values())
        self.optimizer = adamw(self.params, lr or cfg.lr, cfg.weight_decay)
        optimizer_from_tensors(self.optimizer, optimizer_state or {})
        pad = models.tokenizer.pad_token_id
        self.batches: Iterator[dict[str, Tensor]] = batch_stream(
            examples, cfg.batch_size, random.Random(f"{seed}:{step}"), pad
        )

    def step(self) -> dict[str, float]:
        set_trainable(self.models.emu, None)  # the messenger (and so the teacher's logits) has no graph
        for p in self.params:
            p.requires_grad_(True)
        with self.models.autocast():
            terms = takd_terms(self.models, next(self.batches), self.cfg, self.models.checkpoint)
        self.optimizer.zero_grad(set_to_none=True)
        terms["loss"].backward()
        if self.cfg.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.clip)
        self.optimizer.step()
        for p in self.params:
            p.requires_grad_(False)
            p.grad = None
        self.step_count += 1
        return {k: float(v.detach()) for k, v in terms.items()}

    def run(self, steps: int, round_: int = 0, label: str = "TAKD", kind: str = "takd") -> list[dict]:
        """Run ``steps`` steps with a progress bar; returns each step's loss terms (``type`` = ``kind``)."""
        records = []
        with progress_bar() as bar:
            task = bar.add_task(label, total=steps, metrics="")
            for _ in range(steps):
                rec = {"type": kind, "round": round_, "step": self.step_count + 1, **self.step()}
                records.append(rec)
                bar.update(
                    task, advance=1, metrics=f"loss {rec['loss']:.3f}  hidden {rec['hidden']:.4f}  kl {rec['kl']:.3f}"
                )
        return records

    def optimizer_state(self) -> dict[str, Tensor]:
        return optimizer_to_tensors(self.optimizer)
