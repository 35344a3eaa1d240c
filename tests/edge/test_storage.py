"""Bundle storage formats: fp32 and bf16 exact, int8 and int4 within half a quantization step."""

import pytest
import torch

from ciders_edge.errors import BundleError
from ciders_edge.formats import storage
from ciders_edge.formats.storage import SCALE_SUFFIX, decode, encode


@pytest.fixture(scope="module")
def weights(tiny_model):
    return {k: v.detach().clone() for k, v in tiny_model.state_dict().items() if k != "lm_head.weight"}


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_float_storage_is_exact(weights, fmt):
    stored, formats = encode(weights, fmt)
    out = decode(dict(stored), formats, torch.float32, "b")
    dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
    assert all(torch.equal(out[k], w.to(dtype).float()) for k, w in weights.items())


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_integer_storage_is_within_half_a_step(weights, fmt):
    stored, formats = encode(weights, fmt)
    out = decode(dict(stored), formats, torch.float32, "b")
    quantized = [k for k, f in formats.items() if f.startswith(fmt)]
    assert "model.embed_tokens.weight" in quantized and any("mlp.down_proj" in k for k in quantized)
    for k, w in weights.items():
        if k not in quantized:
            assert formats[k] == "fp32" and torch.equal(out[k], w)
            continue
        scale = stored[k + SCALE_SUFFIX].float()
        step = scale.repeat_interleave(w.shape[1] // scale.shape[1], dim=1)
        err = (out[k] - w).abs()
        assert (err <= step / 2 + 1e-7).all(), (k, float((err - step / 2).max()))
        assert stored[k].dtype == (torch.int8 if fmt == "int8" else torch.uint8)
    if fmt == "int8":
        assert formats["model.embed_tokens.weight"] == "int8-row"  # one scale per token row
        assert stored["model.embed_tokens.weight" + SCALE_SUFFIX].shape[1] == 1


def test_int4_packs_every_value_two_per_byte():
    q = torch.arange(-7, 8, dtype=torch.int8).repeat(2, 4)[:, :32]  # every value of the symmetric grid
    packed = storage._pack_int4(q)
    assert packed.shape == (2, 16) and torch.equal(storage._unpack_int4(packed), q)


def test_bytes_per_param_meets_the_targets():
    assert storage.bytes_per_param("int8-g32") <= 1.1 and storage.bytes_per_param("int4-g32") <= 0.6
    w = {"model.layers.0.mlp.up_proj.weight": torch.randn(128, 64)}
    stored, _ = encode(w, "int4")
    size = sum(t.numel() * t.element_size() for t in stored.values())
    assert size == 128 * 64 * storage.bytes_per_param("int4-g32")


def test_decode_refuses_what_the_record_does_not_fit():
    name = "model.layers.0.mlp.up_proj.weight"
    stored, formats = encode({name: torch.randn(64, 64)}, "int8")
    with pytest.raises(BundleError, match=f"b.safetensors: tensor {name}: .* are not int4-g32"):
        decode(dict(stored), {name: "int4-g32"}, torch.float32, "b.safetensors")
    with pytest.raises(BundleError, match="unknown storage format 'int3'"):
        decode(dict(stored), {name: "int3"}, torch.float32, "b.safetensors")
    with pytest.raises(BundleError, match="tensor extra is not in the manifest's storage record"):
        decode({**stored, "extra": torch.zeros(1)}, formats, torch.float32, "b.safetensors")
    with pytest.raises(BundleError, match="is missing"):
        decode({name: stored[name]}, formats, torch.float32, "b.safetensors")


def test_an_int8_bundle_ships_a_third_of_the_bytes_and_runs_close_to_fp32(tmp_path, demo_dir):
    from tiny_runs import prepare_tiny

    from ciders_edge.formats.manifest import FROZEN_FILES
    from ciders_edge.model.adapemu import load_edge_model
    from ciders_edge.model.adapfu import load_adapfu

    exact, small = (prepare_tiny(tmp_path, demo_dir, 2, 0.5, storage=s) for s in ("fp32", "int8"))
    size = {
        b.manifest["storage"]["format"]: sum((b.path / f).stat().st_size for f in FROZEN_FILES) for b in (exact, small)
    }
    assert size["int8"] < 0.3 * size["fp32"]
    assert small.manifest["format_version"] == 2 and small.manifest["profile"]["storage"] == "int8"
    ids = torch.randint(0, 5000, (2, 16))
    for load in (load_edge_model, load_adapfu):
        with torch.no_grad():
            a, b = (load(bundle).model(input_ids=ids).logits for bundle in (exact, small))
        assert b.dtype == torch.float32  # dequantized into the profile's compute dtype
        assert (a - b).abs().max() < 0.05 * a.abs().max() and not torch.equal(a, b)


def test_a_tampered_int8_tensor_is_refused(tmp_path, demo_dir):
    from tiny_runs import prepare_tiny

    from ciders_edge.formats.bundle import Bundle

    bundle = prepare_tiny(tmp_path, demo_dir, 2, 0.5, storage="int8")
    f = bundle.path / "backbone.safetensors"
    data = bytearray(f.read_bytes())
    data[-100] ^= 0x01  # one bit of an int8 weight
    f.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="backbone.safetensors"):
        Bundle.load(bundle.path)


def test_an_unknown_storage_is_refused_with_the_allowed_values(tmp_path):
    from ciders_edge.errors import ConfigError
    from ciders_edge.profiles import load_profile

    profile = tmp_path / "p.toml"
    profile.write_text('name = "p"\nstorage = "int3"\n')
    with pytest.raises(
        ConfigError, match=r"p\.toml: `storage` must be a string, one of 'fp32', 'bf16', 'int8', 'int4'; got"
    ):
        load_profile(str(profile))


def test_prepare_refuses_an_unknown_storage_before_writing(tmp_path, demo_dir):
    from typer.testing import CliRunner

    from ciders_cloud.cli import app as cloud

    args = ["prepare", "--model", "tiny", "--public-data", str(demo_dir / "public.jsonl"), "--out", str(tmp_path / "r")]
    r = CliRunner().invoke(cloud, [*args, "--storage", "int3"])
    assert r.exit_code == 1 and "storage" in r.output and "int8" in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "r").exists()


def test_a_later_round_of_an_int8_run_ships_no_frozen_weights_again(tmp_path, demo_dir):
    from tiny_runs import prepare_tiny

    from ciders_cloud.round.aggregate import aggregate_files
    from ciders_edge.formats.bundle import Bundle
    from ciders_edge.formats.manifest import FROZEN_FILES
    from ciders_edge.training.train import RoundOptions, train

    first = prepare_tiny(tmp_path, demo_dir, 2, 0.5, storage="int8")
    run = first.path.parents[2]
    train(
        first.path,
        demo_dir / "dates" / "train.jsonl",
        tmp_path / "s",
        tmp_path / "p.pkt",
        RoundOptions(client_id="e", overrides={"local_steps": 1}),
    )
    summary = aggregate_files(run, [tmp_path / "p.pkt"])
    second = Bundle.load(run / "bundles" / "cpu-laptop" / "round-0001")
    for rel in FROZEN_FILES:
        assert (first.path / rel).stat().st_ino == (second.path / rel).stat().st_ino  # hard-linked, not re-sent
    assert summary["bytes_down"]["cpu-laptop"] < 0.1 * sum((first.path / f).stat().st_size for f in FROZEN_FILES)
