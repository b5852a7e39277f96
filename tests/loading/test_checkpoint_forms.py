"""Checkpoints as people save them, loaded as ``from_pretrained`` and ``torch.load`` users expect:
the file transformers reads when a folder holds several (older ``.bin`` shards, a variant, an
adapter beside ``model.safetensors``), training checkpoints that wrap the state dict, tensors a
model declares it computes (Marian's sinusoidal positions), tied weights the checkpoint holds
apart, and what is said when a tensor has no value anywhere."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import automap
from automap.errors import CheckpointError
from automap.loading.checkpoint import open_checkpoint
from automap.profiling.inputs import default_example_inputs
from conftest import logits_of, tiny_gpt2, tiny_llama
from tiny_configs import part_on_disk

transformers = pytest.importorskip("transformers")


def _ids() -> torch.Tensor:
    return torch.randint(0, 200, (2, 7), generator=torch.Generator().manual_seed(3))


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------ which files of a folder


def test_a_folder_is_read_through_the_file_from_pretrained_reads(tmp_path):
    """model.safetensors wins over older .bin shards with their index, a half-precision variant,
    a consolidated copy and a PEFT adapter beside it, as from_pretrained chooses."""
    real = tiny_llama(layers=1)
    real.save_pretrained(tmp_path)
    stale = {k: torch.zeros_like(v) for k, v in real.state_dict().items()}
    torch.save(stale, tmp_path / "pytorch_model-00001-of-00001.bin")
    (tmp_path / "pytorch_model.bin.index.json").write_text(
        '{"metadata": {}, "weight_map": {%s}}'
        % ", ".join(f'"{k}": "pytorch_model-00001-of-00001.bin"' for k in stale)
    )
    save_file(
        {k: v.half() for k, v in load_file(tmp_path / "model.safetensors").items()},
        tmp_path / "model.fp16.safetensors",
    )
    save_file(load_file(tmp_path / "model.safetensors"), tmp_path / "consolidated.safetensors")
    save_file(
        {"base_model.model.lm_head.lora_A.weight": torch.ones(2, 2)}, tmp_path / "adapter_model.safetensors"
    )
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing skipped, nothing in two files
        model = automap.load(tmp_path, device_map="cpu", quiet=True)
    assert torch.equal(logits_of(model, _ids()), logits_of(plain, _ids()))
    assert torch.equal(logits_of(model, _ids()), logits_of(real, _ids()))


def test_a_folder_of_differently_named_shards_is_still_read_whole_and_adapters_are_left_out(tmp_path):
    real = tiny_llama(layers=1)
    state = _state(real)
    names = sorted(state)
    save_file({k: state[k] for k in names[: len(names) // 2]}, tmp_path / "part-a.safetensors")
    save_file({k: state[k] for k in names[len(names) // 2 :]}, tmp_path / "part-b.safetensors")
    save_file({"lora.weight": torch.ones(2)}, tmp_path / "adapter_model.safetensors")
    with open_checkpoint(tmp_path) as checkpoint:
        assert set(checkpoint.tensors) == set(state)


# ------------------------------------------------------------------ training checkpoints


def test_a_training_checkpoint_is_read_through_the_state_dict_it_wraps(tmp_path):
    real = tiny_gpt2()
    expected = logits_of(real, _ids())
    for wrapper in ("model", "model_state_dict", "module", "state_dict"):
        path = tmp_path / f"{wrapper}.pt"
        optimizer = torch.optim.AdamW(real.parameters())
        torch.save(
            {wrapper: real.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3, "loss": 0.5}, path
        )
        with automap.empty_model():
            skeleton = type(real)(real.config).eval()
        model = automap.load(skeleton, path, device_map="cpu", quiet=True)
        assert torch.equal(logits_of(model, _ids()), expected), wrapper


def test_a_pickle_wrapping_two_state_dicts_names_them_and_the_fix(tmp_path):
    real = tiny_gpt2()
    path = tmp_path / "ema.pt"
    torch.save({"model": real.state_dict(), "ema": real.state_dict(), "step": 10}, path)
    with automap.empty_model():
        skeleton = type(real)(real.config)
    with pytest.raises(CheckpointError, match=r"wraps several state dicts \('model', 'ema'\).*save_file"):
        automap.load(skeleton, path, device_map="cpu", quiet=True)
    torch.save({"epoch": 3, "lr": 0.1}, tmp_path / "none.pt")
    with pytest.raises(CheckpointError, match="holds no tensors: its top-level entries are 'epoch', 'lr'"):
        open_checkpoint(tmp_path / "none.pt")


# ------------------------------------------------------------------ tensors nobody saved


def _marian() -> transformers.PreTrainedModel:
    config = transformers.MarianConfig(
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=48,
        decoder_ffn_dim=48,
        vocab_size=96,
        max_position_embeddings=32,
        pad_token_id=1,
        decoder_start_token_id=1,
    )
    torch.manual_seed(0)
    return transformers.MarianMTModel(config).eval()


def test_tensors_a_model_declares_it_computes_are_computed_as_from_pretrained_computes_them(tmp_path):
    """Marian never saves its sinusoidal position tables; both forms compute them with the
    model's own initialiser, in the folder's dtype too."""
    real = _marian()
    real.save_pretrained(tmp_path)
    assert not any("embed_positions" in k for k in load_file(tmp_path / "model.safetensors"))
    ids = torch.randint(2, 96, (2, 6), generator=torch.Generator().manual_seed(0))

    def run(model):
        with torch.no_grad():
            return model(input_ids=ids, decoder_input_ids=ids).logits

    for dtype in (None, torch.bfloat16):
        plain = transformers.MarianMTModel.from_pretrained(tmp_path, dtype=dtype).eval()
        model = automap.load(
            tmp_path,
            device_map={"model.encoder": "disk", "": "cpu"},
            dtype=dtype,
            offload_dir=tmp_path / "off",
            quiet=True,
        )
        assert torch.equal(run(model), run(plain)), dtype
        automap.undispatch(model)
        state = model.state_dict()
        assert all(torch.equal(state[k], v) for k, v in plain.state_dict().items()), dtype
    with automap.empty_model():
        skeleton = type(real)(real.config).eval()
    model = automap.load(skeleton, tmp_path, device_map="cpu", quiet=True)
    assert torch.equal(run(model), run(real))


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_a_model_built_on_plain_meta_gets_the_buffers_no_checkpoint_holds_computed(tmp_path, family):
    """Built under ``torch.device("meta")`` (as transformers 5 builds), a model holds its
    non-persistent buffers on meta too: Llama's rotary inv_freq (float), BERT's position_ids
    (int64). No checkpoint holds them; the model's initialiser computes them, as from_pretrained
    does, and the outputs are the saved model's."""
    if family == "llama":
        real, ids = tiny_llama(layers=2), _ids()
    else:
        config = transformers.BertConfig(
            vocab_size=200,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
        )
        torch.manual_seed(0)
        real, ids = transformers.BertModel(config).eval(), _ids()
    real.save_pretrained(tmp_path)
    with torch.device("meta"):
        skeleton = type(real)(real.config).eval()
    assert any(b.is_meta for b in skeleton.buffers())
    model = automap.load(
        skeleton,
        tmp_path,
        max_memory={**part_on_disk(real), "disk": "1GB"},
        offload_dir=tmp_path / "off",
        quiet=True,
    )
    with torch.no_grad():
        got, want = model(ids), real(ids)
    key = "logits" if family == "llama" else "last_hidden_state"
    assert torch.equal(got[key], want[key])
    assert all(torch.equal(b, dict(real.named_buffers())[n]) for n, b in model.named_buffers())


def test_a_state_dict_saved_through_nested_wrappers_loads(tmp_path):
    """``torch.save(ddp_model.state_dict())`` of a compiled model: every key starts 'module._orig_mod.'."""
    real = tiny_llama(layers=1)
    torch.save({f"module._orig_mod.{k}": v for k, v in _state(real).items()}, tmp_path / "wrapped.pt")
    with automap.empty_model():
        skeleton = transformers.LlamaForCausalLM(real.config).eval()
    model = automap.load(skeleton, tmp_path / "wrapped.pt", device_map="cpu", quiet=True)
    assert torch.equal(logits_of(model, _ids()), logits_of(real, _ids()))


def test_a_parameter_without_a_value_is_refused_before_anything_loads_and_named(tmp_path):
    """A base model's checkpoint loaded into a model with a head, strict=False: the head's
    weight is on meta and in no file. One error naming it (not a warning first), saying it is
    a parameter."""
    real = tiny_llama(layers=1)
    real.model.save_pretrained(tmp_path)  # the base model: no lm_head
    with automap.empty_model():
        skeleton = transformers.LlamaForCausalLM(real.config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(
            CheckpointError,
            match=r"parameter 'lm_head.weight' is not in the checkpoint and the model "
            r"holds no value for it",
        ):
            automap.load(skeleton, tmp_path, device_map="cpu", strict=False, quiet=True)
    assert not [w for w in caught if "loading anyway" in str(w.message)]
    assert skeleton.lm_head.weight.is_meta and skeleton.model.embed_tokens.weight.is_meta


# ------------------------------------------------------------------ ties the checkpoint does not keep


def test_tied_weights_the_checkpoint_holds_apart_are_loaded_apart_as_from_pretrained_does(tmp_path):
    real = tiny_llama(layers=1, tie=True)
    real.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["lm_head.weight"] = torch.randn(
        state["model.embed_tokens.weight"].shape, generator=torch.Generator().manual_seed(1)
    )
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert plain.lm_head.weight is not plain.model.embed_tokens.weight
    with pytest.warns(UserWarning, match="lm_head.weight.*loaded untied") as caught:
        model = automap.load(tmp_path, device_map="cpu", quiet=True)
    assert caught[0].filename == __file__, "the warning points at the caller's line"
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"])
    assert torch.equal(logits_of(model, _ids()), logits_of(plain, _ids()))


def test_tied_weights_saved_under_both_names_with_one_value_stay_tied(tmp_path):
    real = tiny_gpt2()
    state = real.state_dict()  # GPT-2's wte and lm_head: one tensor, both keys
    assert "lm_head.weight" in state
    save_file({k: v.clone().contiguous() for k, v in state.items()}, tmp_path / "both.safetensors")
    with automap.empty_model():
        skeleton = type(real)(real.config).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = automap.load(skeleton, tmp_path / "both.safetensors", device_map="cpu", quiet=True)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(logits_of(model, _ids()), logits_of(real, _ids()))


# ------------------------------------------------------------------ example inputs for other modalities


@pytest.mark.parametrize("kind", ["resnet", "convnext", "wav2vec2", "whisper", "clip"])
def test_vision_speech_and_two_tower_models_are_traced_at_inputs_of_their_kind(kind, caplog):
    """No fallback to planning by weights alone: transformers 5's dummy_inputs (input_ids for
    every model) are not taken for a model whose input is another."""
    T = transformers
    small = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48)
    model, expected = {
        "resnet": lambda: (
            T.ResNetForImageClassification(
                T.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1])
            ),
            "pixel_values 1x3x224x224",
        ),
        "convnext": lambda: (
            T.ConvNextModel(T.ConvNextConfig(hidden_sizes=[8, 8, 8, 8], depths=[1, 1, 1, 1])),
            "pixel_values 1x3x224x224",
        ),
        "wav2vec2": lambda: (
            T.Wav2Vec2ForCTC(
                T.Wav2Vec2Config(
                    **small,
                    conv_dim=(8, 8),
                    conv_stride=(5, 2),
                    conv_kernel=(10, 3),
                    num_conv_pos_embeddings=16,
                    num_conv_pos_embedding_groups=2,
                    vocab_size=32,
                )
            ),
            "input_values 1x16000",
        ),
        "whisper": lambda: (
            T.WhisperForConditionalGeneration(
                T.WhisperConfig(
                    d_model=32,
                    encoder_layers=1,
                    decoder_layers=1,
                    encoder_attention_heads=2,
                    decoder_attention_heads=2,
                    encoder_ffn_dim=48,
                    decoder_ffn_dim=48,
                    vocab_size=96,
                    num_mel_bins=8,
                    max_source_positions=16,
                    max_target_positions=16,
                    pad_token_id=1,
                    bos_token_id=0,
                    eos_token_id=2,
                    decoder_start_token_id=0,
                )
            ),
            "input_features 1x8x32",
        ),
        "clip": lambda: (
            T.CLIPModel(
                T.CLIPConfig(
                    text_config={
                        **small,
                        "vocab_size": 99,
                        "bos_token_id": 0,
                        "eos_token_id": 2,
                        "pad_token_id": 1,
                    },
                    vision_config={**small, "image_size": 32, "patch_size": 8},
                )
            ),
            "pixel_values 1x3x32x32",
        ),
    }[kind]()
    model.eval()
    assert expected in default_example_inputs(model)[1]
    with caplog.at_level(logging.WARNING, logger="automap"):
        automap.plan(model, max_memory={"cpu": "1GB"})
    assert not [r for r in caplog.records if "without a trace" in r.getMessage()]


def test_one_shard_given_for_the_checkpoint_is_named_as_one_shard(tmp_path):
    real = tiny_llama(layers=2)
    real.save_pretrained(tmp_path, max_shard_size="100KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[0]
    with automap.empty_model():
        skeleton = type(real)(real.config)
    with pytest.raises(CheckpointError, match=r"is one shard of a sharded checkpoint: pass its folder"):
        automap.load(skeleton, shard, device_map="cpu", quiet=True)
