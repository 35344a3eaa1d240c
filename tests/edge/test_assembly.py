import torch

from ciders_edge.model.forward import backbone_hidden, messenger_logits, response_positions
from ciders_edge.model.lora import LoraSettings, attach_lora, lora_state
from ciders_edge.model.split import SplitSpec, build_adapemu


def _emu(tiny_model, a=2, beta=0.5):
    spec = SplitSpec(n=8, a=a, beta=beta)
    torch.manual_seed(0)
    model = attach_lora(build_adapemu(tiny_model, spec), spec, LoraSettings(), LoraSettings()).eval()
    for name, p in model.named_parameters():  # non-zero LoRA B so the adapters matter
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return spec, model


def test_two_halves_equal_the_full_forward(tiny_model):
    spec, model = _emu(tiny_model)
    ids = torch.randint(0, 1000, (2, 10))
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
        h, ctx = backbone_hidden(model, ids, mask, spec.n_kept)
        out = messenger_logits(model, h, ctx, spec.n_kept)
        pos = (torch.tensor([0, 1]), torch.tensor([3, 9]))
        at = messenger_logits(model, h, ctx, spec.n_kept, pos)
    assert torch.allclose(ref, out, atol=1e-6)
    assert torch.allclose(at, ref[pos], atol=1e-6)


def test_messenger_lora_has_two_tensors_per_module_and_layer(tiny_model):
    spec = SplitSpec(n=8, a=6, beta=1.0)
    model = attach_lora(build_adapemu(tiny_model, spec), spec, LoraSettings())
    # 7 target modules x (A, B) x 6 layers = 84, as for a 6-layer SmolLM2 messenger.
    state = lora_state(model, "messenger")
    assert len(state) == 84
    layers = {int(k.split(".layers.")[1].split(".")[0]) for k in state}
    assert layers == set(spec.emu_messenger)


def test_response_positions_shift_by_one():
    labels = torch.tensor([[-100, -100, 5, 6], [-100, 7, -100, -100]])
    (b, t), targets = response_positions(labels)
    assert b.tolist() == [0, 0, 1] and t.tolist() == [1, 2, 0]
    assert targets.tolist() == [5, 6, 7]
