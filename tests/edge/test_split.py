import pytest
import torch
from transformers import GPT2Config

from ciders_edge.errors import ConfigError, ModelError
from ciders_edge.model.families import family_of
from ciders_edge.model.split import SplitSpec, build_adapemu, kept_indices


def test_kept_indices_paper_example():
    # n=30, a=6, beta=0.8: n' = floor(0.8*24) = 19 layers, floor(j*23/18), first and last kept.
    spec = SplitSpec(n=30, a=6, beta=0.8)
    assert spec.n_kept == 19
    assert spec.kept == [0, 1, 2, 3, 5, 6, 7, 8, 10, 11, 12, 14, 15, 16, 17, 19, 20, 21, 23]
    assert spec.emu_messenger == list(range(19, 25))
    assert spec.messenger_source == list(range(24, 30))


def test_kept_indices_full_and_uniform():
    assert kept_indices(24, 1.0) == list(range(24))
    assert kept_indices(6, 0.5) == [0, 2, 5]


@pytest.mark.parametrize(
    ("n", "a", "beta", "message"),
    [
        (30, 30, 0.8, "messenger depth must be in 1..29"),
        (30, 31, 0.8, "messenger depth"),
        (30, 6, 0.0, "beta must be in (0, 1]"),
        (30, 6, 1.2, "beta must be in (0, 1]"),
        (30, 6, 0.05, "at least 2 layers"),
        (3, 2, 1.0, "at least 2 layers"),
    ],
)
def test_split_errors(n, a, beta, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        SplitSpec(n=n, a=a, beta=beta)


def test_drop_ratio_one_is_refused():
    with pytest.raises(ConfigError, match="drop ratio must be in"):
        SplitSpec.from_drop_ratio(30, 6, 1.0)


def test_unsupported_architecture_is_named():
    with pytest.raises(ModelError, match="GPT2LMHeadModel"):
        family_of(GPT2Config(architectures=["GPT2LMHeadModel"]))


def test_beta_one_equals_original_exactly(tiny_model):
    spec = SplitSpec(n=8, a=2, beta=1.0)
    emu = build_adapemu(tiny_model, spec)
    ids = torch.randint(0, 1000, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    with torch.no_grad():
        assert torch.equal(
            tiny_model(input_ids=ids, attention_mask=mask).logits, emu(input_ids=ids, attention_mask=mask).logits
        )


def test_adapemu_copies_kept_layers(tiny_model):
    spec = SplitSpec(n=8, a=2, beta=0.5)
    emu = build_adapemu(tiny_model, spec)
    src = tiny_model.model.layers
    for dst, s in enumerate(spec.kept + spec.messenger_source):
        assert torch.equal(emu.model.layers[dst].mlp.up_proj.weight, src[s].mlp.up_proj.weight)
        assert emu.model.layers[dst].mlp.up_proj.weight.data_ptr() != src[s].mlp.up_proj.weight.data_ptr()
    assert emu.config.num_hidden_layers == 5
    assert tiny_model.config.num_hidden_layers == 8  # the original is untouched
