"""Breadth beyond the registry sweeps: what a folder carries besides its weights, and families
and forms the other sweeps do not reach, each against what transformers (``from_pretrained``)
or the plain model computes. Small random models, saved under ``tmp_path``."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import automap
from tiny_configs import accelerates_part_on_disk, part_on_disk, run_dispatched, tiny

transformers = pytest.importorskip("transformers")

IDS = torch.randint(3, 60, (1, 6), generator=torch.Generator().manual_seed(0))


def _reference(folder, auto: str) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, auto).from_pretrained(folder).eval()


def _generation_json(folder) -> None:
    """A ``generation_config.json`` whose settings change the greedy tokens."""
    (folder / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": 1,
                "eos_token_id": 2,
                "max_new_tokens": 5,
                "repetition_penalty": 3.0,
                "no_repeat_ngram_size": 1,
            }
        )
    )


def _generation_in_config(folder) -> None:
    """An older folder: no ``generation_config.json``, generation settings in ``config.json``."""
    (folder / "generation_config.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    config.update(num_beams=3, no_repeat_ngram_size=2, max_length=9)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "family,auto,edit",
    [
        ("llama", "AutoModelForCausalLM", _generation_json),
        ("bart", "AutoModelForSeq2SeqLM", _generation_in_config),
    ],
    ids=["generation_config.json", "settings-in-config.json"],
)
def test_a_folder_generates_with_its_generation_settings(family, auto, edit, tmp_path):
    """from_pretrained reads the folder's generation settings; automap.load(folder) kept the
    ones the model derives from its config at init, so generate() ran past the folder's
    max_new_tokens, without its repetition penalty or beams, and gave other tokens."""
    model = tiny(family, auto)
    model.save_pretrained(tmp_path / "m")
    edit(tmp_path / "m")
    reference = _reference(tmp_path / "m", auto)
    with torch.no_grad():
        expected = reference.generate(IDS)
    loaded = automap.load(
        tmp_path / "m", max_memory=part_on_disk(model), offload_dir=tmp_path / "off", quiet=True
    )
    assert loaded.generation_config == reference.generation_config
    assert torch.equal(run_dispatched(loaded, lambda m: m.generate(IDS)), expected)


def _hidden_states(model: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return model(IDS, output_hidden_states=True).hidden_states


def test_planning_with_example_inputs_leaves_no_hooks_of_the_probe_behind():
    """transformers installs its output-capturing hooks on a model's first call that records
    outputs, and marks the model. The planner's probe put the mark back but kept the hooks, so
    the next call installed them again and returned each hidden state twice (5 for 2 layers)."""
    model, fresh = tiny("llama"), tiny("llama")
    expected = _hidden_states(fresh)
    automap.plan(
        model, max_memory={"cpu": "1GB"}, example_inputs={"input_ids": IDS, "output_hidden_states": True}
    )
    got = _hidden_states(model)
    assert len(got) == len(expected) == model.config.num_hidden_layers + 1
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def _llava() -> torch.nn.Module:
    from tiny_configs import shrink

    config = transformers.AutoConfig.for_model("llava")
    shrink(config)
    vision = config.vision_config
    vision.image_size, vision.patch_size, vision.hidden_size = 32, 8, 32
    vision.intermediate_size, vision.num_hidden_layers, vision.num_attention_heads = 64, 2, 4
    config.image_token_index = 5
    torch.manual_seed(0)
    return transformers.LlavaForConditionalGeneration(config).eval()


def test_a_vision_language_model_dispatched_with_example_inputs_gives_the_plain_outputs(tmp_path):
    """LLaVA reads its vision tower's hidden states through those hooks: dispatched with
    example inputs, its forward failed ('NoneType' object is not subscriptable)."""
    model, twin = _llava(), _llava()  # the twin runs plainly: a first call installs the hooks
    ids = torch.cat([torch.full((1, 16), 5), IDS], 1)  # 16 image tokens: a 32-pixel image in 8-pixel patches
    inputs = dict(
        input_ids=ids,
        pixel_values=torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1)),
        attention_mask=torch.ones_like(ids),
    )
    with torch.no_grad():
        expected = twin(**inputs).logits
        tokens = twin.generate(**inputs, max_new_tokens=3, do_sample=False, pad_token_id=0)
    automap.dispatch(
        model, device_map="auto", max_memory=part_on_disk(model), example_inputs=inputs, offload_dir=tmp_path
    )
    got, again = run_dispatched(
        model,
        lambda m: (
            m(**inputs).logits,
            m.generate(**inputs, max_new_tokens=3, do_sample=False, pad_token_id=0),
        ),
    )
    assert torch.equal(got, expected)
    assert torch.equal(again, tokens)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers renames past_key_values to cache
@pytest.mark.parametrize("family", ["gemma2", "jamba"])
def test_planning_with_a_cache_in_the_example_inputs_leaves_the_users_cache_as_it_was(family, tmp_path):
    """A cache from an earlier call, given as an example input, went to the planner's meta
    probe as it was: Gemma 2's and Jamba's grew by a step there, so the user's next real step
    failed (Gemma 2: 'The size of tensor a (7) must match ...') or computed other logits."""
    import copy

    model = tiny(family)
    with torch.no_grad():
        past = model(IDS, use_cache=True).past_key_values
    untouched = copy.deepcopy(past)
    step = {"input_ids": IDS[:, :1], "past_key_values": past, "use_cache": True}
    budget = part_on_disk(model, example_inputs=step)
    automap.plan(model, max_memory=budget, example_inputs=step)
    automap.dispatch(model, device_map="auto", max_memory=budget, example_inputs=step, offload_dir=tmp_path)
    assert int(past.get_seq_length()) == int(untouched.get_seq_length()) == IDS.shape[1]
    got = run_dispatched(model, lambda m: m(**step).logits)
    with torch.no_grad():
        expected = tiny(family)(**{**step, "past_key_values": untouched}).logits
    assert torch.equal(got, expected)


def _ssdlite() -> tuple[torch.nn.Module, tuple]:
    from torchvision.models import detection

    model = detection.ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=5)
    return model, ([torch.rand(3, 128, 128, generator=torch.Generator().manual_seed(1))],)


def _raft() -> tuple[torch.nn.Module, tuple]:
    from torchvision.models import optical_flow

    g = torch.Generator().manual_seed(1)
    return optical_flow.raft_small(weights=None), (
        torch.rand(1, 3, 128, 128, generator=g),  # its smallest
        torch.rand(1, 3, 128, 128, generator=g),
    )


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for key in sorted(value) for t in _tensors(value[key])]
    return [t for item in value for t in _tensors(item)] if isinstance(value, (list, tuple)) else []


@pytest.mark.parametrize("build", [_ssdlite, _raft], ids=["ssdlite", "raft_small"])
def test_a_forward_that_makes_a_grid_on_a_real_device_is_traced_up_to_it(build, tmp_path):
    """SSD's anchors and RAFT's coordinate grid are made on a real device inside the forward;
    meshgrid of them with the probe's meta tensors said only 'expects all tensors to have the
    same device', which the probe took for a mistake in the example inputs (ProfileError)
    instead of a limit of meta tensors."""
    pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model, inputs = build()
    model.eval()
    with torch.no_grad():
        expected = _tensors(model(*inputs))
    automap.dispatch(
        model, device_map="auto", max_memory=part_on_disk(model), example_inputs=inputs, offload_dir=tmp_path
    )
    got = _tensors(run_dispatched(model, lambda m: m(*inputs)))
    assert len(got) == len(expected) > 0
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


# ------------------------------------------------------------------ representative passes


def _bert2gpt2() -> tuple[torch.nn.Module, dict]:
    """A composite EncoderDecoderModel (config model_type "encoder-decoder", two sub-configs)."""
    encoder = transformers.BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, vocab_size=128
    )
    decoder = transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=128, add_cross_attention=True, is_decoder=True
    )
    torch.manual_seed(0)
    model = transformers.EncoderDecoderModel(
        transformers.EncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    ).eval()
    model.config.decoder_start_token_id = model.generation_config.decoder_start_token_id = 1
    model.config.pad_token_id = 0
    return model, {"input_ids": IDS}


def _zamba2() -> tuple[torch.nn.Module, dict]:
    """Zamba 2: two shared transformer blocks, each called at several depths between Mamba layers."""
    config = transformers.Zamba2Config(
        hidden_size=64,
        num_hidden_layers=6,
        layer_types=["mamba", "hybrid"] * 3,
        hybrid_layer_ids=[1, 3, 5],
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=96,
        vocab_size=128,
        mamba_d_state=16,
        mamba_headdim=16,
        mamba_ngroups=1,
        n_mamba_heads=8,
        max_position_embeddings=64,
        num_mem_blocks=2,
        use_shared_attention_adapter=True,
        adapter_rank=8,
    )
    torch.manual_seed(0)
    return transformers.Zamba2ForCausalLM(config).eval(), {"input_ids": IDS}


@pytest.mark.parametrize("build", [_bert2gpt2, _zamba2], ids=["bert2gpt2", "zamba2-shared-blocks"])
def test_composite_and_shared_block_models_dispatch_and_load_as_transformers_does(build, tmp_path):
    model, inputs = build()
    generate = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        tokens = model.generate(**inputs, **generate)
    model.save_pretrained(tmp_path / "m", max_shard_size="100KB")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(
            type(model).from_pretrained(tmp_path / "m").eval().generate(**inputs, **generate), tokens
        )
    automap.dispatch(model, device_map="auto", max_memory=part_on_disk(model), offload_dir=tmp_path / "d")
    assert torch.equal(run_dispatched(model, lambda m: m.generate(**inputs, **generate)), tokens)
    loaded = automap.load(
        tmp_path / "m", max_memory=part_on_disk(model), offload_dir=tmp_path / "l", quiet=True
    )
    assert type(loaded) is type(model)
    assert torch.equal(run_dispatched(loaded, lambda m: m.generate(**inputs, **generate)), tokens)


def _clip() -> tuple[torch.nn.Module, dict]:
    from tiny_configs import shrink

    config = transformers.AutoConfig.for_model("clip")
    shrink(config)
    config.vision_config.image_size, config.vision_config.patch_size = 32, 8
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return transformers.CLIPModel(config).eval(), {
        "input_ids": torch.randint(3, 60, (2, 6), generator=g),
        "pixel_values": torch.randn(2, 3, 32, 32, generator=g),
    }


def test_a_model_that_does_not_generate_plans_no_cache_for_max_length(tmp_path):
    """max_length (as a script planning every model for generation passes it) on CLIP: the
    cache probe ran its forward on tokens alone, which fails without the images, and raised a
    ProfileError blaming the example inputs; it now plans no cache, saying why."""
    model, inputs = _clip()
    with torch.no_grad():
        expected = model(**inputs).logits_per_image
    chosen = automap.plan(model, max_memory=part_on_disk(model), example_inputs=inputs, max_length=32)
    assert "does not generate" in " ".join(chosen.generation.notes)
    automap.dispatch(
        model,
        device_map="auto",
        max_memory=part_on_disk(model),
        example_inputs=inputs,
        max_length=32,
        offload_dir=tmp_path,
    )
    assert torch.equal(run_dispatched(model, lambda m: m(**inputs).logits_per_image), expected)


def test_an_encoder_decoder_that_generated_after_the_drop_in_dispatch_can_be_dispatched_again(tmp_path):
    """accelerate's script: dispatch_model, generate, dispatch_model again (a new map). generate
    adds an io-only accelerate hook to the encoder of any model with hf_device_map, which the
    drop-ins set: the second dispatch refused the model as 'dispatched by accelerate'."""
    from automap.accelerate_compat import dispatch_model, infer_auto_device_map

    model, twin = tiny("bart", "AutoModelForSeq2SeqLM"), tiny("bart", "AutoModelForSeq2SeqLM")
    generate = dict(max_new_tokens=3, do_sample=False)
    with torch.no_grad():
        expected = twin.generate(IDS, **generate)
    device_map = infer_auto_device_map(model, max_memory=part_on_disk(model))
    for folder in ("first", "second"):
        dispatch_model(model, device_map, offload_dir=tmp_path / folder)
        with torch.no_grad():
            assert torch.equal(model.generate(IDS, **generate), expected)
    automap.undispatch(model)


def test_a_map_from_accelerates_infer_auto_device_map_with_a_whole_layer_list_on_disk_dispatches(tmp_path):
    """accelerate's infer_auto_device_map keeps a ModuleList together when it fits, e.g.
    {'model.encoder.layers': 'disk'} for a small Whisper; automap's dispatch_model refused it
    ('is a ModuleList, which is never called'): the blocks in it are now the units."""
    import accelerate

    from automap.accelerate_compat import dispatch_model

    model, twin = tiny("whisper", "AutoModelForSpeechSeq2Seq"), tiny("whisper", "AutoModelForSpeechSeq2Seq")
    features = torch.randn(
        1,
        model.config.num_mel_bins,
        2 * model.config.max_source_positions,
        generator=torch.Generator().manual_seed(1),
    )
    inputs = {"input_features": features, "decoder_input_ids": torch.tensor([[1, 5, 6]])}
    with torch.no_grad():
        expected = twin(**inputs).logits
    device_map = accelerate.infer_auto_device_map(
        model, max_memory=accelerates_part_on_disk(model), no_split_module_classes=model._no_split_modules
    )
    lists = [
        k
        for k, v in device_map.items()
        if v == "disk" and isinstance(model.get_submodule(k), torch.nn.ModuleList)
    ]
    assert lists, f"accelerate mapped no layer list whole to disk: {device_map}"
    dispatch_model(model, device_map, offload_dir=tmp_path)
    assert torch.equal(run_dispatched(model, lambda m: m(**inputs).logits), expected)
