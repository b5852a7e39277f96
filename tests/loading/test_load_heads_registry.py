"""``automap.load(folder)`` on folders ``save_pretrained`` writes for models other than causal
LMs: classifiers of sequences, tokens and images, question answering, masked LMs, seq2seq and
speech models, CTC, and CLIP-like dual encoders. Each family (taken from transformers' own auto
mappings, built tiny with random weights) loads with about half its weights on disk to exactly
what ``from_pretrained`` of the same folder computes, in float32 and in bfloat16, from a
``pytorch_model.bin``, from small shards, and through accelerate's script on automap's drop-ins.

Then the folders automap must refuse or read with care: a ``quantization_config`` (quantized
weights cast to float would be silently wrong), TensorFlow or Flax weights alone, and a config
that names no architecture (the head whose tensors the checkpoint holds is built)."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import automap
from test_hf_conversions_registry import CHANGES, shrink
from tiny_configs import part_on_disk, run_dispatched

transformers = pytest.importorskip("transformers")
modeling_auto = pytest.importorskip("transformers.models.auto.modeling_auto")

# (auto mapping, family): a few of each kind, the families people run most.
FAMILIES = [
    *[
        ("SEQUENCE_CLASSIFICATION", f)
        for f in ("bert", "roberta", "deberta-v2", "electra", "xlm-roberta", "mpnet", "llama")
    ],
    *[("TOKEN_CLASSIFICATION", f) for f in ("bert", "deberta-v2", "xlm-roberta")],
    *[("QUESTION_ANSWERING", f) for f in ("bert", "roberta", "bart")],
    *[("MASKED_LM", f) for f in ("bert", "deberta-v2", "electra", "xlm-roberta", "mpnet")],
    *[("SEQ_TO_SEQ_CAUSAL_LM", f) for f in ("t5", "bart", "marian")],
    *[("IMAGE_CLASSIFICATION", f) for f in ("vit", "convnext", "resnet", "beit")],
    ("CTC", "wav2vec2"),
    ("SPEECH_SEQ_2_SEQ", "whisper"),
    ("AUDIO_CLASSIFICATION", "wav2vec2"),
    *[("ZERO_SHOT_IMAGE_CLASSIFICATION", f) for f in ("clip", "chinese_clip")],
]
# Sizes kept in lists (one per stage) and audio feature sizes, which the generic shrinking leaves.
STAGES = {
    "hidden_sizes": lambda n: [16 * (i + 1) for i in range(n)],
    "depths": lambda n: [1] * n,
    "conv_dim": lambda n: [32] * n,
    "num_heads": lambda n: [2] * n,
}
SCALARS = {
    "num_conv_pos_embeddings": 16,
    "output_hidden_size": 32,
    "classifier_proj_size": 32,
    "num_labels": 2,
    "pad_token_id": 0,
    "projection_dim": 32,
    "pooler_hidden_size": 32,
}


def _small(fields: dict) -> dict:
    for key, value in list(fields.items()):
        if isinstance(value, dict):
            fields[key] = _small(value)
        elif key in STAGES and isinstance(value, (list, tuple)):
            fields[key] = STAGES[key](len(value))
        elif key in SCALARS and value is not None:
            fields[key] = SCALARS[key]
    return fields


def _tiny(kind: str, family: str) -> torch.nn.Module:
    name = getattr(modeling_auto, f"MODEL_FOR_{kind}_MAPPING_NAMES").get(family)
    cls = getattr(transformers, name) if isinstance(name, str) else None
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {kind.lower()} model for {family}")
    fields = _small(shrink(cls.config_class().to_dict(), CHANGES.get(family, {})))
    fields.update(num_labels=2, pad_token_id=0)
    for key in ("model_type", "transformers_version"):
        fields.pop(key, None)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(cls.config_class(**fields)).eval()


def _inputs(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """What the family's forward takes, from its main input's name and its config's sizes."""
    config, g = model.config, torch.Generator().manual_seed(0)
    vision = getattr(config, "vision_config", config)
    ids = torch.randint(3, 100, (2, 8), generator=g)
    ids[:, -1] = getattr(config, "eos_token_id", None) or 2  # BART's classifier reads the last <eos>
    main = model.main_input_name
    if main == "input_values":
        return {"input_values": torch.randn(2, 4000, generator=g, dtype=dtype)}
    if main == "input_features":
        frames = 2 * config.max_source_positions
        return {
            "input_features": torch.randn(2, config.num_mel_bins, frames, generator=g).to(dtype),
            "decoder_input_ids": ids[:, :5],
        }
    inputs = {"input_ids": ids}
    if main == "pixel_values" or hasattr(config, "vision_config"):
        size = getattr(
            vision, "image_size", 64
        )  # a convolutional network takes any size: 64 keeps 2x2 at its end
        size = (
            max(64, size if isinstance(size, int) else size[0]) if "convnext" in config.model_type else size
        )
        pixels = torch.randn(2, vision.num_channels, size, size, generator=g).to(dtype)
        inputs = {"pixel_values": pixels, **(inputs if main != "pixel_values" else {})}
    if config.is_encoder_decoder:
        inputs["decoder_input_ids"] = ids[:, :5]
    return inputs


def _outputs(model: torch.nn.Module, inputs: dict) -> list[torch.Tensor]:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model(**inputs)
    return [t for t in out.to_tuple() if isinstance(t, torch.Tensor)]


def _saved(kind: str, family: str, folder, fmt: str = "single"):
    model = _tiny(kind, family)
    model.save_pretrained(folder, max_shard_size="200KB" if fmt == "sharded" else "50GB")
    if fmt == "bin":  # transformers 5 ignores safe_serialization=False: write what it wrote
        torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
        (folder / "model.safetensors").unlink()
    return model


def _assert_same(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("kind,family", FAMILIES, ids=[f"{k.lower()}-{f}" for k, f in FAMILIES])
def test_each_head_loads_from_its_folder_as_from_pretrained_does(kind, family, tmp_path):
    model = _saved(kind, family, tmp_path / "m")
    reference = type(model).from_pretrained(tmp_path / "m").eval()
    inputs = _inputs(model)
    loaded = automap.load(
        tmp_path / "m",
        max_memory={**part_on_disk(model), "disk": "1GB"},
        offload_dir=tmp_path / "off",
        quiet=True,
    )
    assert type(loaded) is type(model)
    _assert_same(run_dispatched(loaded, lambda m: _outputs(m, inputs)), _outputs(reference, inputs))


# One family of each kind for the other forms of the same folder.
FORMS = [
    ("SEQUENCE_CLASSIFICATION", "deberta-v2"),
    ("TOKEN_CLASSIFICATION", "bert"),
    ("MASKED_LM", "xlm-roberta"),
    ("SEQ_TO_SEQ_CAUSAL_LM", "t5"),
    ("IMAGE_CLASSIFICATION", "vit"),
    ("CTC", "wav2vec2"),
    ("SPEECH_SEQ_2_SEQ", "whisper"),
    ("ZERO_SHOT_IMAGE_CLASSIFICATION", "clip"),
]


@pytest.mark.parametrize("form", ["bfloat16", "bin", "sharded", "accelerate"])
@pytest.mark.parametrize("kind,family", FORMS, ids=[f"{k.lower()}-{f}" for k, f in FORMS])
def test_each_kind_loads_in_bfloat16_from_bin_shards_and_accelerates_script(kind, family, form, tmp_path):
    from automap.accelerate_compat import init_empty_weights, load_checkpoint_and_dispatch

    folder = tmp_path / "m"
    model = _saved(kind, family, folder, form if form in ("bin", "sharded") else "single")
    dtype = torch.bfloat16 if form == "bfloat16" else torch.float32
    inputs = _inputs(model, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = _outputs(type(model).from_pretrained(folder, dtype=dtype).eval(), inputs)
    budget = {**part_on_disk(model, dtype), "disk": "1GB"}
    if form == "accelerate":
        with init_empty_weights():
            empty = type(model)(transformers.AutoConfig.from_pretrained(folder))
        loaded = load_checkpoint_and_dispatch(
            empty, str(folder), device_map="auto", max_memory=budget, offload_folder=str(tmp_path / "off")
        ).eval()
    else:
        loaded = automap.load(
            folder, dtype=dtype, max_memory=budget, offload_dir=tmp_path / "off", quiet=True
        )
    _assert_same(run_dispatched(loaded, lambda m: _outputs(m, inputs)), expected)


# ------------------------------------------------------------------ folders to refuse or read with care


def _bert(folder):
    return _saved("SEQUENCE_CLASSIFICATION", "bert", folder)


def _edit_config(folder, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


QUANTIZATIONS = {
    "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
}


@pytest.mark.parametrize("method", sorted(QUANTIZATIONS))
def test_a_folder_declaring_a_quantization_is_refused_naming_it(method, tmp_path):
    """from_pretrained builds quantized layers for such a folder (even of plain weights):
    automap's plain layers would not compute the same, and a quantized tensor cast to float is
    silently wrong. It was loaded as if plain."""
    _bert(tmp_path / "m")
    _edit_config(tmp_path / "m", quantization_config=QUANTIZATIONS[method])
    with pytest.raises(automap.CheckpointError, match=rf"quantization_config: '{method}'.*from_pretrained"):
        automap.load(tmp_path / "m", max_memory={"cpu": "1GB"}, quiet=True)
    assert not (tmp_path / "off").exists()


def _quantized_like(folder, dtype: torch.dtype, scale_suffix: str, quantization: dict | None) -> None:
    """Rewrite ``folder``'s linear weights as a quantizer saves them: ``dtype``, with a scale
    beside each (bitsandbytes' int8 ``SCB``, FP8's ``weight_scale_inv``)."""
    tensors = load_file(folder / "model.safetensors")
    for key in [
        k for k in tensors if k.endswith(".weight") and tensors[k].dim() == 2 and "embeddings" not in k
    ]:
        tensors[key] = tensors[key].clamp(-1, 1).mul(127).to(dtype)
        tensors[key.removesuffix("weight") + scale_suffix] = torch.ones(tensors[key].shape[0])
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    if quantization is not None:
        _edit_config(folder, quantization_config=quantization)


@pytest.mark.parametrize(
    "stored,scale,quantization",
    [
        (torch.int8, "SCB", {"quant_method": "bitsandbytes", "load_in_8bit": True}),
        (torch.int8, "SCB", None),
        (torch.float8_e4m3fn, "weight_scale_inv", QUANTIZATIONS["fp8"]),
    ],
    ids=["bnb-int8", "int8-without-config", "fp8"],
)
def test_quantized_weights_are_not_cast_into_a_plain_model(stored, scale, quantization, tmp_path):
    """accelerate's script (strict=False) skipped the scales and cast the integers or float8
    values to float32: wrong weights, loaded without an error."""
    from automap.accelerate_compat import init_empty_weights, load_checkpoint_and_dispatch

    folder = tmp_path / "m"
    _bert(folder)
    _quantized_like(folder, stored, scale, quantization)
    with init_empty_weights():
        empty = transformers.BertForSequenceClassification(transformers.AutoConfig.from_pretrained(folder))
    with pytest.raises(
        automap.CheckpointError, match=rf"as {str(stored).removeprefix('torch.')}.*wrong weights"
    ):
        load_checkpoint_and_dispatch(empty, str(folder), device_map="auto", max_memory={"cpu": "1GB"})
    assert all(p.is_meta for p in empty.parameters()), "nothing was loaded"


def test_a_quantized_checkpoints_key_mismatch_names_its_quantization(tmp_path):
    folder = tmp_path / "m"
    _bert(folder)
    tensors = load_file(folder / "model.safetensors")
    packed = {
        k.removesuffix("weight") + "qweight": torch.zeros(4, 4, dtype=torch.int32)
        for k in tensors
        if k.endswith("dense.weight")
    }
    save_file(
        {k: v for k, v in tensors.items() if not k.endswith("dense.weight")} | packed,
        folder / "model.safetensors",
    )
    _edit_config(folder, quantization_config=QUANTIZATIONS["gptq"])
    with automap.empty_model():
        empty = transformers.BertForSequenceClassification(transformers.AutoConfig.from_pretrained(folder))
    with pytest.raises(automap.CheckpointError, match=r"qweight.*quantization_config: 'gptq' \(bits=4\)"):
        automap.load(empty, folder, max_memory={"cpu": "1GB"})


@pytest.mark.parametrize("name,framework", [("tf_model.h5", "TensorFlow"), ("flax_model.msgpack", "Flax")])
def test_a_folder_of_tensorflow_or_flax_weights_says_what_it_holds(name, framework, tmp_path):
    _bert(tmp_path / "full")
    (tmp_path / "m").mkdir()
    shutil.copy(tmp_path / "full" / "config.json", tmp_path / "m")
    (tmp_path / "m" / name).write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(64))
    with pytest.raises(automap.CheckpointError, match=rf"{framework} weights \({name}\).*save_pretrained"):
        automap.load(tmp_path / "m", quiet=True)


@pytest.mark.parametrize("architectures", [None, []], ids=["missing", "empty"])
def test_a_config_without_architectures_builds_the_head_its_checkpoint_holds(architectures, tmp_path):
    """It was built as the family's causal LM (BertLMHeadModel), which the classifier's
    checkpoint does not fit: a key mismatch."""
    folder = tmp_path / "m"
    model = _bert(folder)
    _edit_config(folder, architectures=architectures)
    reference = transformers.BertForSequenceClassification.from_pretrained(folder).eval()
    inputs = _inputs(model)
    loaded = automap.load(
        folder, max_memory={**part_on_disk(model), "disk": "1GB"}, offload_dir=tmp_path / "off", quiet=True
    )
    assert type(loaded) is transformers.BertForSequenceClassification
    _assert_same(run_dispatched(loaded, lambda m: _outputs(m, inputs)), _outputs(reference, inputs))
