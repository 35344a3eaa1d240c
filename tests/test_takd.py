import math

import torch
import torch.nn.functional as F

from ciders_cloud.models import build_cloud_models
from ciders_cloud.prepare import STATE_DIR, load_run
from ciders_cloud.state import ServerState
from ciders_cloud.takd import Distiller, takd_loss
from ciders_edge.data import IGNORE, load_examples


def test_takd_loss_matches_eq2_by_hand():
    torch.manual_seed(0)
    hs, ht = torch.randn(3, 4), torch.randn(3, 4)
    ls, lt = torch.randn(3, 5), torch.randn(3, 5)
    targets = torch.tensor([IGNORE, 2, 4])
    terms = takd_loss(hs, ht, ls, lt, targets, lambda_out=0.5, lambda_task=2.0)
    mse = ((hs - ht) ** 2).sum() / 12
    pt, ps = lt.softmax(-1), ls.softmax(-1)
    kl = (pt * (pt.log() - ps.log())).sum() / 3
    ce = -(ls.log_softmax(-1)[1, 2] + ls.log_softmax(-1)[2, 4]) / 2
    assert math.isclose(terms["hidden_mse"].item(), mse.item(), rel_tol=1e-5)
    assert math.isclose(terms["kl"].item(), kl.item(), rel_tol=1e-5)
    assert math.isclose(terms["ce"].item(), ce.item(), rel_tol=1e-5)
    assert math.isclose(terms["loss"].item(), (mse + 0.5 * kl + 2.0 * ce).item(), rel_tol=1e-5)


def test_takd_loss_is_zero_for_a_perfect_student():
    h, logits = torch.randn(4, 8), torch.randn(4, 11)
    terms = takd_loss(h, h, logits, logits, torch.full((4,), IGNORE), 0.5, 1.0)
    assert terms["loss"].item() == 0.0 and F.mse_loss(h, h) == 0


def test_distill_trains_only_the_backbone_lora(tiny_run):
    run_dir = tiny_run[0]
    run = load_run(run_dir)
    state = ServerState.load(run_dir / STATE_DIR)
    models = build_cloud_models(run, state)
    examples = load_examples(run.public_data, models.tokenizer, 128)
    before_v, before_b = models.messenger_state(), models.backbone_state()
    d = Distiller(models, examples, run.takd_config, state.optimizer, state.takd_step, run.seed)
    records = d.run(8)
    after_v, after_b = models.messenger_state(), models.backbone_state()
    assert all(torch.equal(before_v[k], after_v[k]) for k in before_v)  # messenger held fixed
    assert any(not torch.equal(before_b[k], after_b[k]) for k in before_b)
    assert d.step_count == state.takd_step + 8
    # the task term on a fixed family of prompts falls as the backbone adapts
    assert sum(r["ce"] for r in records[-3:]) < sum(r["ce"] for r in records[:3])
