"""Checkpoint keys through the model's own load path: what torch's ``load_state_dict`` (through
the modules' load-state-dict pre-hooks) or ``from_pretrained`` accepts, automap accepts. The
case in the wild: weight-norm keys ``weight_g``/``weight_v`` as ``torch.nn.utils.weight_norm``
saved them (many audio checkpoints), loaded into a model built with the parametrization."""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import automap
from automap.errors import CheckpointError


def convnet(legacy: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore", FutureWarning
        )  # torch.nn.utils.weight_norm is deprecated: that is the point
        norm = torch.nn.utils.weight_norm if legacy else torch.nn.utils.parametrizations.weight_norm
        return nn.Sequential(norm(nn.Conv1d(4, 8, 3)), nn.ReLU(), norm(nn.Conv1d(8, 4, 3), dim=1)).eval()


def saved(state: dict[str, torch.Tensor], path, prefix: str = "") -> str:
    save_file({prefix + k: v.detach().contiguous() for k, v in state.items()}, str(path))
    return str(path)


@pytest.mark.parametrize("prefix", ["", "module."], ids=["as-saved", "wrapper-prefix"])
@pytest.mark.parametrize("where", [{"": "cpu"}, {"0": "cpu", "1": "cpu", "2": "disk"}], ids=["ram", "disk"])
def test_legacy_weight_norm_keys_load_as_torchs_load_state_dict_takes_them(tmp_path, prefix, where):
    legacy = convnet(legacy=True)
    assert {"0.weight_g", "0.weight_v"} <= set(legacy.state_dict())
    plain = convnet()
    plain.load_state_dict(legacy.state_dict())  # torch's own path: the parametrization's hook renames
    with automap.empty_model():
        skeleton = convnet()
    model = automap.load(
        skeleton,
        saved(legacy.state_dict(), tmp_path / "w.safetensors", prefix),
        where,
        offload_dir=tmp_path / "off",
        quiet=True,
    )
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(x), plain(x))
        torch.testing.assert_close(model(x), legacy(x))
    automap.undispatch(model)


def test_a_checkpoint_torch_refuses_is_still_refused_naming_the_keys(tmp_path):
    state = convnet(legacy=True).state_dict()
    state.pop("2.weight_v")  # half a pair: the hook renames nothing, torch's load_state_dict refuses too
    with pytest.raises(RuntimeError):
        convnet().load_state_dict(state)
    with automap.empty_model():
        skeleton = convnet()
    with pytest.raises(CheckpointError, match="2.weight_g"):
        automap.load(skeleton, saved(state, tmp_path / "w.safetensors"), quiet=True)


def test_a_transformers_folder_with_legacy_weight_norm_keys_loads_as_from_pretrained_loads_it(tmp_path):
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    config = Wav2Vec2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
    )
    torch.manual_seed(0)
    Wav2Vec2Model(config).eval().save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    state = load_file(str(path))
    legacy = {
        k.replace("parametrizations.weight.original0", "weight_g").replace(
            "parametrizations.weight.original1", "weight_v"
        ): v
        for k, v in state.items()
    }
    assert legacy.keys() != state.keys()
    save_file(legacy, str(path), metadata={"format": "pt"})
    plain = Wav2Vec2Model.from_pretrained(tmp_path).eval()
    model = automap.load(tmp_path, quiet=True)
    audio = torch.randn(1, 800, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(audio).last_hidden_state, plain(audio).last_hidden_state)
    automap.undispatch(model)
