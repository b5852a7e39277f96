"""Plans for generation: the cache each unit keeps, measured on meta, equals the cache a real
``generate`` holds at ``max_length`` (per device of a two-GPU plan), for every cache layout;
it is reserved where its units compute; bad requests fail clearly; a dispatched model keeps
each layer's cache where it was made, step after step."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn

import automap
from automap.errors import PlanError
from automap.planning.predict import summary
from automap.profiling.kvcache import held_tensors
from automap.report import plan_dict
from automap.runtime import send
from conftest import tiny_gpt2, tiny_llama, tiny_t5
from tiny_configs import beside_the_run

DOCS = Path(__file__).resolve().parents[2] / "docs"
BATCH, PROMPT, MAX_LENGTH = 2, 6, 40


def _mistral() -> nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    return MistralForCausalLM(
        MistralConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            sliding_window=8,
        )
    ).eval()


def _mamba() -> nn.Module:
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    return MambaForCausalLM(
        MambaConfig(hidden_size=64, num_hidden_layers=4, vocab_size=256, state_size=8)
    ).eval()


def _falcon() -> nn.Module:
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(0)
    return FalconForCausalLM(
        FalconConfig(
            hidden_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            multi_query=True,
            new_decoder_architecture=False,
            vocab_size=256,
        )
    ).eval()


def _bart() -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    config = BartConfig(
        d_model=64,
        encoder_layers=2,
        decoder_layers=3,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        vocab_size=256,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=2,
    )
    return BartForConditionalGeneration(config).eval()


def _whisper() -> nn.Module:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    config = WhisperConfig(
        d_model=64,
        encoder_layers=2,
        decoder_layers=3,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        vocab_size=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        num_mel_bins=16,
        max_source_positions=50,
        max_target_positions=64,
    )
    return WhisperForConditionalGeneration(config).eval()


@dataclass(frozen=True)
class Family:
    """A model and where its cache's layer ``i`` lives (the unit that computes it)."""

    build: Callable[[], nn.Module]
    layer_unit: str  # with {i}
    encoder_decoder: bool = False


FAMILIES = {
    "llama-gqa": Family(lambda: tiny_llama(layers=4), "model.layers.{i}"),
    "gpt2": Family(lambda: tiny_gpt2(layers=4), "transformer.h.{i}"),
    "mistral-sliding": Family(_mistral, "model.layers.{i}"),
    "t5-encoder-decoder": Family(lambda: tiny_t5(layers=3), "decoder.block.{i}", encoder_decoder=True),
    "bart-encoder-decoder": Family(_bart, "model.decoder.layers.{i}", encoder_decoder=True),
    "whisper-audio-encoder": Family(_whisper, "model.decoder.layers.{i}", encoder_decoder=True),
    "mamba-recurrent": Family(_mamba, "backbone.layers.{i}"),
    "falcon-mqa": Family(_falcon, "transformer.h.{i}"),
}


def _prompt(family: Family, model: nn.Module) -> dict[str, torch.Tensor]:
    """The generation's input under the model's own name: token ids, or Whisper's audio
    features (the encoder's input; its decoder starts from one token)."""
    generator = torch.Generator().manual_seed(1)
    if model.main_input_name == "input_features":
        features = torch.randn(
            BATCH, model.config.num_mel_bins, 2 * model.config.max_source_positions, generator=generator
        )
        return {"input_features": features, "decoder_input_ids": torch.ones(BATCH, 1, dtype=torch.long)}
    ids = torch.randint(3, 256, (BATCH, PROMPT), generator=generator)
    return (
        {"input_ids": ids, "decoder_input_ids": ids[:, :1]} if family.encoder_decoder else {"input_ids": ids}
    )


def _generate(model: nn.Module, ids: torch.Tensor, max_length: int, **kwargs):
    with torch.no_grad():
        return model.generate(
            ids,
            max_length=max_length,
            min_length=max_length,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            return_dict_in_generate=True,
            **kwargs,
        )


def _layers(cache) -> list[list]:
    """The cache's per-layer objects, self- and cross-attention of one layer together."""
    if hasattr(cache, "self_attention_cache"):
        return [[a, b] for a, b in zip(cache.self_attention_cache.layers, cache.cross_attention_cache.layers)]
    return [[layer] for layer in cache.layers]


def _cache_of(output):
    """The cache a model or ``generate`` returned: ``cache`` in recent transformers,
    ``past_key_values`` before (5.17, the GPU image's)."""
    return output.cache if hasattr(output, "cache") else output.past_key_values


def _storage_bytes(objects) -> int:
    seen: dict[int, int] = {}
    for t in held_tensors(objects):
        seen[id(t.untyped_storage())] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _two_gpu_plan(model: nn.Module, prompt: dict) -> automap.Plan:
    """A plan over two hypothetical GPUs that must split the layers (each holds ~60%)."""
    roomy = automap.plan(
        model, max_memory={0: "1GiB", 1: "1GiB"}, example_inputs=prompt, max_length=MAX_LENGTH
    )
    need = sum(u.weight_bytes + u.kv_bytes for u in roomy.units)
    peak = max(u.peak_activation_bytes for u in roomy.units)
    budget = int(0.6 * need) + 2 * peak
    return automap.plan(
        model, max_memory={0: budget, 1: budget}, example_inputs=prompt, max_length=MAX_LENGTH
    )


@pytest.mark.parametrize("name", list(FAMILIES))
def test_planned_kv_per_device_is_the_cache_generate_holds(name):
    family = FAMILIES[name]
    model = family.build()
    prompt = _prompt(family, model)
    plan = _two_gpu_plan(model, prompt)
    assert plan.generation is not None and plan.generation.batch == BATCH
    out = _generate(model, prompt[model.main_input_name], MAX_LENGTH)
    actual: dict[str, int] = {}
    for i, layer in enumerate(_layers(_cache_of(out))):
        device = plan.device_of(family.layer_unit.format(i=i))
        actual[device] = actual.get(device, 0) + _storage_bytes(layer)
    planned = {row.device.name: row.kv_bytes for row in summary(plan) if row.kv_bytes}
    assert set(planned) == set(actual)
    for device, nbytes in actual.items():
        assert abs(planned[device] - nbytes) <= 0.02 * nbytes, (device, planned[device], nbytes)
    if not family.encoder_decoder:  # the decoder layers are split over both GPUs
        assert len(planned) == 2


def test_sliding_window_and_recurrent_caches_do_not_grow_with_length():
    for build, grows in ((_mistral, False), (_mamba, False), (lambda: tiny_llama(layers=2), True)):
        model = build()
        prompt = {"input_ids": torch.zeros(1, 4, dtype=torch.long)}
        short, long = (
            automap.plan(model, max_memory={"cpu": "1GiB"}, example_inputs=prompt, max_length=n).units
            for n in (40, 80)
        )
        kv_short, kv_long = sum(u.kv_bytes for u in short), sum(u.kv_bytes for u in long)
        assert kv_short > 0
        assert (kv_long > 1.9 * kv_short) if grows else kv_long == kv_short


def test_kv_reserved_with_the_weights_changes_the_split():
    model = tiny_llama(layers=4)
    prompt = {"input_ids": torch.zeros(8, 8, dtype=torch.long)}
    # Weights fit the GPU, weights and cache do not; with no CPU budget the CPU cannot compute
    # the rest, so layers stream from disk to the GPU, and their cache stays on the GPU.
    budgets = {0: "1100KiB", "disk": "1GiB"}
    plain = automap.plan(model, max_memory=budgets, example_inputs=prompt)
    planned = automap.plan(model, max_memory=budgets, example_inputs=prompt, max_length=64)
    assert sum(u.kv_bytes for u in planned.units) > 0
    assert plain.offloaded_units == ()
    for row in summary(planned):
        assert row.used_bytes <= row.device.capacity_bytes
    # The cache of the layers that now stream from disk lives on the GPU that runs them.
    offloaded_kv = sum(u.kv_bytes for u, p in zip(planned.units, planned.placements) if p.offloaded)
    assert offloaded_kv > 0
    executor = next(r for r in summary(planned) if r.device.name == planned.execution_device)
    resident = sum(u.kv_bytes for u, d in zip(planned.units, planned.placement) if d == executor.device.name)
    assert executor.kv_bytes == resident + offloaded_kv


def test_llama_70b_shape_fits_two_80gib_gpus_with_its_cache_at_16_x_8192():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=8192,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    plan = automap.plan(
        model,
        max_memory={0: "80GiB", 1: "80GiB", "cpu": "200GiB"},
        dtype=torch.bfloat16,
        batch=16,
        max_length=8192,
    )
    # An oracle independent of the measurement: K and V, 8 KV heads of 128, bf16, 8,191 cached tokens.
    assert sum(u.kv_bytes for u in plan.units) == 80 * 2 * 8 * 128 * 2 * 16 * 8191
    for row in summary(plan):
        if row.device.is_accelerator:
            assert (
                row.weight_bytes + row.activation_bytes + row.kv_bytes + row.reserve_bytes
                <= row.device.capacity_bytes
            )
            assert row.kv_bytes > 0


def test_a_model_without_cache_plans_no_kv_and_says_so():
    from transformers import BertConfig, BertForMaskedLM

    bert = BertForMaskedLM(
        BertConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=256
        )
    ).eval()
    plan = automap.plan(bert, max_memory={"cpu": "1GiB"}, batch=2, max_length=64)
    assert plan.generation is not None and sum(u.kv_bytes for u in plan.units) == 0
    assert any("no cache" in n for n in plan.generation.notes)
    flat = " ".join(plan.report().split())
    assert "no cache reserved; no decode prediction" in flat and "returns no cache" in flat


def test_a_model_without_token_input_plans_no_kv_and_says_so(resnet50):
    plan = automap.plan(resnet50, max_memory={"cpu": "1GiB"}, batch=1, max_length=16)
    assert sum(u.kv_bytes for u in plan.units) == 0
    assert "no batch x tokens input" in " ".join(plan.report().split())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch": -1, "max_length": 64}, "batch=-1"),
        ({"batch": 0, "max_length": 64}, "batch=0"),
        ({"max_length": 1}, "at least 2 tokens"),
        (
            {"max_length": 5, "example_inputs": {"input_ids": torch.zeros(1, 8, dtype=torch.long)}},
            "not longer than the prompt (8 tokens)",
        ),
        (
            {
                "batch": 4,
                "max_length": 64,
                "example_inputs": {"input_ids": torch.zeros(2, 8, dtype=torch.long)},
            },
            "batch=4 but the example inputs hold 2",
        ),
    ],
)
def test_bad_generation_requests_raise_plan_error(kwargs, message):
    with pytest.raises(PlanError, match=re.escape(message)):
        automap.plan(tiny_llama(layers=2), max_memory={"cpu": "1GiB"}, **kwargs)


def test_generation_survives_json_and_is_documented():
    plan = automap.plan(tiny_t5(layers=2), max_memory={0: "4MiB", "cpu": "1GiB"}, batch=2, max_length=32)
    again = automap.Plan.from_json(plan.to_json())
    assert again == plan and again.generation == plan.generation
    data = plan_dict(plan)
    doc = (DOCS / "plan-schema.md").read_text().split("## generation\n", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `([a-z_]+)`", doc, re.M))
    assert documented == set(data["generation"])
    assert data["generation"]["kv_bytes"] == sum(d["kv_bytes"] for d in data["devices"]) > 0
    assert json.loads(plan.to_json())["totals"]["kv_bytes"] == data["generation"]["kv_bytes"]


def test_report_shows_kv_column_and_decode_speed():
    plan = automap.plan(tiny_llama(layers=4), max_memory={"cpu": "300KiB"}, batch=1, max_length=64)
    text = plan.report()
    assert re.search(r"^device +kind +capacity +used +kv ", text, re.M)
    flat = " ".join(text.split())
    assert re.search(
        r"decode limited by [\d.]+ (?:[KMG]i)?B streamed from disk per step: ~[\d,.]+ tokens/s at batch 1",
        flat,
    )
    assert "more memory on cpu (max_memory) would keep every weight resident" in flat
    assert max(len(line) for line in text.splitlines()) <= 80
    assert (
        " kv " not in automap.plan(tiny_llama(layers=2), max_memory={"cpu": "1GiB"}).report().splitlines()[3]
    )


def test_dispatched_generate_keeps_each_cache_where_it_was_made(tmp_path):
    model = tiny_llama(layers=4)
    ids = torch.randint(3, 256, (2, 6), generator=torch.Generator().manual_seed(2))
    expected = _generate(model, ids, 30).sequences
    automap.dispatch(
        model,
        max_memory={"cpu": "400KiB"},
        offload_dir=tmp_path,
        batch=2,
        max_length=30,
        example_inputs={"input_ids": ids},
    )
    assert automap.placement(model).offloaded_units  # some layers stream from disk
    pointers: list[list[tuple[int, torch.device]]] = []

    def watch(module, args, kwargs, output):
        pointers.append([(t.data_ptr(), t.device) for t in held_tensors(_cache_of(output)) if t.numel()])

    handle = model.register_forward_hook(watch, with_kwargs=True)
    try:
        got = _generate(model, ids, 30, cache_implementation="static")
    finally:
        handle.remove()
    assert torch.equal(got.sequences, expected)
    assert len(pointers) == 30 - 6  # the prefill and every decode step
    assert all(p == pointers[0] for p in pointers)  # the same tensors, written in place: nothing copied
    assert {device for _, device in pointers[0]} == {torch.device("cpu")}


def test_moving_a_units_inputs_leaves_the_cache_where_it_is():
    from transformers import DynamicCache

    model = tiny_llama(layers=2)
    cache = _cache_of(_generate(model, torch.zeros(1, 4, dtype=torch.long), 8))
    assert isinstance(cache, DynamicCache)
    before = [(t.data_ptr(), t.device) for t in held_tensors(cache)]
    moved = send({"hidden_states": torch.zeros(2), "cache": cache}, torch.device("meta"))
    assert moved["cache"] is cache and moved["hidden_states"].is_meta
    assert [(t.data_ptr(), t.device) for t in held_tensors(cache)] == before


def _static_cache_made_on_first_use() -> bool:
    """Recent transformers make a static cache's tensors at the first update, on the keys' device;
    older ones (5.17, the GPU image's) make them up front on ``model.device``, the device of the
    first parameter, which is CPU RAM when the embedding is streamed to the GPU."""
    import transformers

    return tuple(int(p) for p in transformers.__version__.split(".")[:2]) >= (5, 25)


@pytest.mark.cuda
@pytest.mark.xfail(
    not _static_cache_made_on_first_use(),
    strict=False,
    reason="this transformers makes a static cache on model.device (CPU for a streamed embedding); "
    "tokens are still identical",
)
def test_on_a_gpu_the_cache_stays_on_it_across_steps(tmp_path):
    model = tiny_llama(layers=4)
    ids = torch.randint(3, 256, (2, 6), generator=torch.Generator().manual_seed(3))
    plain = _generate(model.to("cuda:0"), ids.cuda(), 24, cache_implementation="static").sequences.cpu()
    model.to("cpu")
    automap.dispatch(
        model,
        max_memory={0: "200KiB", "cpu": "1GiB"},
        offload_dir=tmp_path,
        batch=2,
        max_length=24,
        example_inputs={"input_ids": ids},
    )
    pointers = []
    handle = model.register_forward_hook(
        lambda m, a, k, out: pointers.append(
            [(t.data_ptr(), t.device) for t in held_tensors(_cache_of(out)) if t.numel()]
        ),
        with_kwargs=True,
    )
    try:
        got = _generate(model, ids.cuda(), 24, cache_implementation="static").sequences.cpu()
    finally:
        handle.remove()
    assert torch.equal(got, plain)
    assert all(p == pointers[0] for p in pointers)
    assert {d for _, d in pointers[0]} == {torch.device("cuda:0")}


def test_load_plans_for_generation_and_generates_the_same_tokens(tmp_path):
    from safetensors.torch import save_model
    from transformers import LlamaForCausalLM

    real = tiny_llama(layers=4)
    ids = torch.randint(3, 256, (8, 6), generator=torch.Generator().manual_seed(4))
    expected = _generate(real, ids, 64).sequences
    save_model(real, str(tmp_path / "llama.safetensors"))
    prompt = {"input_ids": ids}
    # 1000 KiB for weights and cache beside the CPU's run (activations, overhead: planning/memory.py)
    budget = {"cpu": beside_the_run(real, 1000 * 1024, example_inputs=prompt)}
    with_kv = automap.plan(real, max_memory=budget, example_inputs=prompt, max_length=64)
    assert (
        with_kv.offloaded_units
        != automap.plan(real, max_memory=budget, example_inputs=prompt).offloaded_units
    )
    with automap.empty_model():
        skeleton = LlamaForCausalLM(real.config).eval()
    model = automap.load(
        skeleton,
        tmp_path / "llama.safetensors",
        max_memory=budget,
        offload_dir=tmp_path / "offload",
        max_length=64,
        example_inputs=prompt,
        quiet=True,
    )
    assert automap.placement(model).offloaded_units == with_kv.offloaded_units
    assert torch.equal(_generate(model, ids, 64).sequences, expected)


def test_a_split_layer_keeps_its_cache_on_the_piece_that_makes_it():
    from automap.profiling.kvcache import profile_generation
    from automap.profiling.refine import Splitter

    model = tiny_llama(layers=2)
    prompt = {"input_ids": torch.zeros(8, 8, dtype=torch.long)}
    prof = profile_generation(
        model, automap.profile(model, prompt, backward=False), prompt, batch=None, max_length=64
    )
    whole = {u.name: u.kv_bytes for u in prof.units}
    finer = Splitter(model, example_inputs=prompt, no_split=[])(prof, ["model.layers.0"]).profile
    kv = {u.name: u.kv_bytes for u in finer.units}
    assert finer.generation == prof.generation
    assert kv["model.layers.0.self_attn"] == whole["model.layers.0"] > 0
    assert kv["model.layers.0.mlp"] == 0
    assert sum(kv.values()) == sum(whole.values())


def test_an_encoder_decoder_plans_its_cache_from_its_own_guessed_inputs():
    """Whisper's encoder takes audio features, not token ids: its cache (self- and
    cross-attention) is planned from them, guessed or given, as for a text encoder."""
    model = _whisper()
    plan = automap.plan(model, max_memory={"cpu": "1GiB"}, max_length=16)
    assert plan.generation is not None and plan.generation.cache == "EncoderDecoderCache"
    layers = [u for u in plan.units if u.kv_bytes]
    assert [u.name for u in layers] == [f"model.decoder.layers.{i}" for i in range(3)]
    frames = 2 * model.config.max_source_positions
    cross = 2 * (frames // 2) * model.config.d_model * 4  # keys and values of the encoder's output, fp32
    self_attention = 2 * 15 * model.config.d_model * 4  # max_length - 1 tokens
    assert all(u.kv_bytes == cross + self_attention for u in layers), [u.kv_bytes for u in layers]


def test_a_decode_step_reads_the_rows_an_embedding_gathers_and_every_matrix_whole():
    """What one decode step reads of each unit's weights, as the decode-time prediction counts
    it: an embedding's rows for the batch's tokens (one position row for all), a layer's every matrix, a tied embedding
    whole (the head multiplies by it), an encoder nothing (it ran in the prefill), nor the
    cross-attention's key and value projections (their output is cached)."""
    llama = {
        u.name: u
        for u in automap.plan(tiny_llama(layers=2), max_memory={"cpu": "1GiB"}, batch=2, max_length=16).units
    }
    row = 64 * 4  # hidden 64, fp32
    assert llama["model.embed_tokens"].decode_weight_bytes == 2 * row
    assert llama["model.embed_tokens"].decode_weight_rows == 2
    layer = llama["model.layers.0"]
    assert layer.decode_weight_bytes == layer.param_bytes and layer.decode_ops > 0
    assert layer.decode_weight_rows == sum(  # q, k, v, o; gate, up, down; two norms
        (64, 32, 32, 64, 128, 128, 64, 1, 1)
    )
    gpt2 = {
        u.name: u
        for u in automap.plan(tiny_gpt2(layers=2), max_memory={"cpu": "1GiB"}, batch=2, max_length=16).units
    }
    assert gpt2["transformer.wte"].decode_weight_bytes == gpt2["transformer.wte"].param_bytes
    assert gpt2["transformer.wpe"].decode_weight_bytes == row  # one position, shared by the batch
    t5 = automap.plan(tiny_t5(layers=2), max_memory={"cpu": "1GiB"}, batch=2, max_length=16).units
    encoder = [u for u in t5 if u.name.startswith("encoder.block")]
    decoder = [u for u in t5 if u.name.startswith("decoder.block")]
    assert encoder and all(u.decode_weight_bytes == 0 for u in encoder)
    # The cross-attention's keys and values come from the cache: its k and v are not read.
    assert decoder[1].decode_weight_bytes == decoder[1].param_bytes - 2 * 64 * 64 * 4
