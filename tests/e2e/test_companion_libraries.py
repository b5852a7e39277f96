"""Models of the libraries users combine with automap beside transformers: timm's image models
and diffusers' UNet and VAE, built from their own constructors with random weights, dispatched
with part on disk and loaded from the checkpoints their libraries save: outputs equal the plain
model's."""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors.torch import save_file

import automap
from tiny_configs import part_on_disk

timm = pytest.importorskip("timm")
diffusers = pytest.importorskip("diffusers")

TIMM_MODELS = {
    "vit_tiny_patch16_224": dict(img_size=32, patch_size=8),  # attention, a class token, layer scale off
    "convnext_atto": {},  # depthwise convolutions, layer norms over channels, layer scale
    "efficientnet_b0": {},  # squeeze-and-excitation, batch norms with running statistics
}


def _timm(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, num_classes=10, **TIMM_MODELS[name]).eval()


def _on_disk(model: torch.nn.Module) -> bool:
    return "disk" in automap.placement(model).device_map.values()


@pytest.mark.parametrize("name", sorted(TIMM_MODELS))
def test_a_timm_model_with_part_on_disk_and_loaded_from_its_checkpoint_gives_the_plain_outputs(
    name, tmp_path
):
    model, x = _timm(name), torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = model(x)
    budget = part_on_disk(model, example_inputs=(x,))
    automap.dispatch(model, "auto", max_memory=budget, offload_dir=tmp_path / "store", example_inputs=(x,))
    assert _on_disk(model)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    automap.undispatch(model)
    checkpoint = tmp_path / f"{name}.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, checkpoint)
    with automap.empty_model():
        empty = timm.create_model(name, pretrained=False, num_classes=10, **TIMM_MODELS[name]).eval()
    automap.load(
        empty, checkpoint, max_memory=budget, offload_dir=tmp_path / "store", quiet=True, example_inputs=(x,)
    )
    assert _on_disk(empty)
    with torch.no_grad():
        assert torch.equal(empty(x), expected)


def _unet() -> torch.nn.Module:
    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    ).eval()


def test_a_diffusers_unet_planned_from_keyword_inputs_and_loaded_from_its_folder_gives_the_plain_outputs(
    tmp_path,
):
    unet = _unet()
    inputs = {
        "sample": torch.randn(2, 4, 16, 16),
        "timestep": torch.tensor([10, 500]),
        "encoder_hidden_states": torch.randn(2, 7, 32),
    }
    with torch.no_grad():
        expected = unet(**inputs).sample
    budget = part_on_disk(unet)
    plan = automap.plan(unet, max_memory=budget, offload_dir=tmp_path / "store", example_inputs=inputs)
    automap.dispatch(unet, plan, offload_dir=tmp_path / "store")
    assert _on_disk(unet)
    with torch.no_grad():
        assert torch.equal(unet(**inputs).sample, expected)
    automap.undispatch(unet)
    folder = tmp_path / "unet"
    unet.save_pretrained(folder)  # config.json and diffusion_pytorch_model.safetensors
    with automap.empty_model(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        empty = diffusers.UNet2DConditionModel.from_config(
            diffusers.UNet2DConditionModel.load_config(folder)
        ).eval()
    automap.load(empty, folder, plan, offload_dir=tmp_path / "store", quiet=True)
    assert _on_disk(empty)
    with torch.no_grad():
        assert torch.equal(empty(**inputs).sample, expected)


def test_a_diffusers_vae_encodes_and_decodes_with_part_on_disk(tmp_path):
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        block_out_channels=(32, 64),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=32,
    ).eval()
    image = torch.randn(1, 3, 32, 32)

    def roundtrip(model):
        with torch.no_grad():
            return model.decode(model.encode(image).latent_dist.mode()).sample

    expected = roundtrip(vae)
    automap.dispatch(vae, "auto", max_memory=part_on_disk(vae), offload_dir=tmp_path)
    assert _on_disk(vae)
    assert torch.equal(roundtrip(vae), expected)
    automap.undispatch(vae)
    assert torch.equal(roundtrip(vae), expected)
