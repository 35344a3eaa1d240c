"""How faithful the AdapEmu is to the model it stands for, on held-out public records.

Both sides run the same messenger (the global LoRA v): AdapFu = messenger on the full backbone B_F
(before round 1 exactly the base model M*), AdapEmu = messenger on the learnable backbone B_L. Scored
at response tokens: each one's NLL and their ratio, how often the greedy next token agrees, and the
KL(AdapFu || AdapEmu) per token. ``prepare``, ``distill`` and ``aggregate`` record it in their summary,
the run's log and every bundle's manifest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ciders_cloud.models.teacher import CloudModels
from ciders_edge.config import ConfigMixin
from ciders_edge.data.records import Example, collate
from ciders_edge.model.forward import backbone_hidden, messenger_logits, response_positions

__all__ = ["Fidelity", "measure_fidelity", "fidelity_record"]


@dataclass
class Fidelity(ConfigMixin):
    nll_full: float  # AdapFu's response NLL per token
    nll_emu: float  # AdapEmu's
    nll_ratio: float  # nll_emu / nll_full: 1 is as good as the full model
    top1_agreement: float  # share of response tokens where both greedy next tokens are the same
    kl: float  # KL(AdapFu || AdapEmu) per response token, nats
    records: int
    tokens: int

    def describe(self) -> str:
        return (
            f"NLL {self.nll_emu:.3f} vs full {self.nll_full:.3f} ({self.nll_ratio:.3f}x), "
            f"top-1 agreement {self.top1_agreement:.1%}, KL {self.kl:.3f} on {self.records} held-out records"
        )


@torch.no_grad()
def measure_fidelity(models: CloudModels, examples: list[Example], batch_size: int = 8) -> Fidelity | None:
    """The AdapEmu against AdapFu on ``examples`` (``None`` when there are none)."""
    if not examples:
        return None
    m, split = models, models.split
    m.emu.eval()
    nll_full = nll_emu = kl = 0.0
    agree = tokens = 0
    for i in range(0, len(examples), batch_size):
        b = m.on_device(collate(examples[i : i + batch_size], m.tokenizer.pad_token_id))
        positions, targets = response_positions(b["labels"])
        with m.autocast():
            h_full, ctx_full = backbone_hidden(m.teacher, b["input_ids"], b["attention_mask"], split.n - split.a)
            h_emu, ctx = backbone_hidden(m.emu, b["input_ids"], b["attention_mask"], split.n_kept)
            full = messenger_logits(m.emu, h_full, ctx_full, split.n_kept, positions).float().log_softmax(-1)
            emu = messenger_logits(m.emu, h_emu, ctx, split.n_kept, positions).float().log_softmax(-1)
        nll_full += float(F.nll_loss(full, targets, reduction="sum"))
        nll_emu += float(F.nll_loss(emu, targets, reduction="sum"))
        kl += float(F.kl_div(emu, full, log_target=True, reduction="sum"))
        agree += int((full.argmax(-1) == emu.argmax(-1)).sum())
        tokens += targets.numel()
    n = max(tokens, 1)
    return Fidelity(
        nll_full / n,
        nll_emu / n,
        nll_emu / max(nll_full, 1e-12),
        agree / n,
        kl / n,
        len(examples),
        tokens,
    )


def fidelity_record(round_: int, takd_step: int, fidelity: Fidelity | None) -> dict:
    """The distill log's record of the emulator's fidelity as round ``round_`` starts (``run/logs.py``)."""
    return {"type": "fidelity", "round": round_, "takd_step": takd_step, **(fidelity.to_dict() if fidelity else {})}
