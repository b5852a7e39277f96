"""Any RAM budget that holds the run runs: every torchvision classification model and 24
transformers families (decoder-only, encoder-only, encoder-decoder, tied and untied, two mixtures
of experts), with 30 % and then 10 % of their weights' bytes beside the run (its activations and
the runtime's overhead) as the CPU budget and the rest on disk, plan without a refusal, keep the
budget (weights and the predicted peak), and give the plain model's outputs (max abs diff <= 1e-5) and
``generate`` tokens. Only the public API is used (``automap.plan``, ``dispatch``,
``undispatch``), so these hold whatever the runtime does inside.

Models use small inputs (64x64 images, or the smallest an architecture accepts; 12 tokens) and
small configs; one test per model, so chunks run on their own (``-k resnet``)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

import automap
from automap.planning.predict import memory
from conftest import weight_bytes
from tiny_configs import beside_the_run

SHARES = (0.3, 0.1)
MAX_ABS_DIFF = 1e-5


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: these inputs are small, and two OpenMP threads spin-wait behind any
    other job on a 2-core machine (benchmarks/notes/offload.md), which made the sweep 2x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _runs_within(
    model: nn.Module,
    inputs: tuple | dict,
    expected: torch.Tensor,
    folder: Path,
    generate: Callable[[nn.Module], torch.Tensor] | None = None,
    tokens: torch.Tensor | None = None,
) -> None:
    """At each share of the weights' bytes beside the run as CPU budget: a plan that keeps the
    budget, and a dispatched model with the plain model's outputs (and tokens)."""
    call = (lambda m: m(*inputs)) if isinstance(inputs, tuple) else (lambda m: m(**inputs))
    profile = automap.profile(model, inputs, backward=False)  # one trace for both budgets
    for share in SHARES:
        budget = beside_the_run(profile, int(share * weight_bytes(model)))
        where = folder / f"offload-{share}"
        plan = automap.plan(profile, max_memory={"cpu": budget}, offload_dir=where)
        assert plan.execution_device == "cpu"
        held = plan.placements.bytes_on
        assert held.get("cpu", 0) <= budget and held.get("disk", 0) > 0, f"{share:.0%}: {plan.report()}"
        assert all(m.fits for m in memory(plan)), f"{share:.0%}: {plan.report()}"
        automap.dispatch(model, plan, offload_dir=where)
        try:
            with torch.no_grad():
                got = _logits(call(model))
            new_tokens = generate(model) if generate is not None else None
        finally:
            automap.undispatch(model)
            shutil.rmtree(where, ignore_errors=True)  # pytest keeps tmp_path: do not keep GBs of stores
        diff = (got - expected).abs().max().item()
        assert diff <= MAX_ABS_DIFF, f"{share:.0%} budget: max abs diff {diff:.3g}"
        if generate is not None:
            assert torch.equal(new_tokens, tokens), f"{share:.0%} budget: generate() gave other tokens"


def _logits(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits


# ------------------------------------------------------------------------------ torchvision


def _torchvision_models() -> list[str]:
    import torchvision

    return torchvision.models.list_models(module=torchvision.models)


# Too slow for the suite on a 2-core machine: each is over 1 GB of float32 weights, whose random
# initialisation alone takes 10-25 s, and 70-90 % of which is written to the offload store twice.
# Smaller members of each family run (vit_b_16, vit_b_32, regnet_y_32gf).
TOO_SLOW = {
    "regnet_y_128gf": "2.6 GB of weights: ~3 min to build, write to the store twice and run",
    "vit_h_14": "2.5 GB of weights: ~1.5 min to build, write to the store twice and run",
    "vit_l_16": "1.2 GB of weights: ~1 min to build, write to the store twice and run",
    "vit_l_32": "1.2 GB of weights: ~1 min to build, write to the store twice and run",
}
# Constructor arguments for small inputs: ViTs take their image size.
KWARGS = {"vit_b_16": {"image_size": 64}, "vit_b_32": {"image_size": 64}}
# The smallest input an architecture accepts where 64x64 is too small.
SIDE = {"inception_v3": 75, "maxvit_t": 224}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.skip(reason=TOO_SLOW[n])) if n in TOO_SLOW else n
        for n in _torchvision_models()
    ],
)
def test_torchvision_model_runs_under_any_ram_budget(name, tmp_path):
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.get_model(name, **KWARGS.get(name, {})).eval()
    side = SIDE.get(name, 64)
    x = torch.randn(1, 3, side, side, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
    _runs_within(model, (x,), expected, tmp_path)


# ----------------------------------------------------------------------------- transformers

_SMALL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    vocab_size=256,
    max_position_embeddings=128,
)
_SEQ2SEQ = dict(
    d_model=64,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=128,
    decoder_ffn_dim=128,
    vocab_size=256,
    max_position_embeddings=128,
)
# The MoE layers' default (grouped_mm) cannot be traced on meta in float32; batched_mm computes
# the same experts without data-dependent shapes.
_MOE = dict(experts_implementation="batched_mm", num_experts_per_tok=2)

# family: (config class, model class, config, kind)
FAMILIES = {
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128, bos_token_id=0, eos_token_id=0),
        "decoder",
    ),  # tied
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_SMALL, num_key_value_heads=2), "decoder"),  # untied
    "llama_tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(_SMALL, num_key_value_heads=2, tie_word_embeddings=True),
        "decoder",
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_SMALL, num_key_value_heads=2), "decoder"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_SMALL, num_key_value_heads=2), "decoder"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(_SMALL, num_key_value_heads=2, head_dim=16), "decoder"),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(_SMALL), "decoder"),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=128,
            vocab_size=256,
            max_position_embeddings=128,
            word_embed_proj_dim=64,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=1,
        ),
        "decoder",
    ),
    "gpt_neo": (
        "GPTNeoConfig",
        "GPTNeoForCausalLM",
        dict(
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            vocab_size=256,
            max_position_embeddings=128,
            window_size=16,
            attention_types=[[["global", "local"], 1]],
            bos_token_id=0,
            eos_token_id=0,
        ),
        "decoder",
    ),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(_SMALL), "decoder"),
    "bloom": (
        "BloomConfig",
        "BloomForCausalLM",
        dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=256, bos_token_id=0, eos_token_id=0),
        "decoder",
    ),
    "falcon": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=256,
            bos_token_id=0,
            eos_token_id=0,
        ),
        "decoder",
    ),
    "gptj": (
        "GPTJConfig",
        "GPTJForCausalLM",
        dict(
            n_embd=64,
            n_layer=2,
            n_head=4,
            vocab_size=256,
            n_positions=128,
            rotary_dim=8,
            bos_token_id=0,
            eos_token_id=0,
        ),
        "decoder",
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(_SMALL, **_MOE, num_key_value_heads=2, num_local_experts=4),
        "decoder",
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            _SMALL,
            **_MOE,
            num_key_value_heads=2,
            num_experts=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
        ),
        "decoder",
    ),
    "bert": ("BertConfig", "BertForMaskedLM", dict(_SMALL), "encoder"),
    "roberta": (
        "RobertaConfig",
        "RobertaForMaskedLM",
        dict(_SMALL, max_position_embeddings=130, pad_token_id=1),
        "encoder",
    ),
    "distilbert": (
        "DistilBertConfig",
        "DistilBertForMaskedLM",
        dict(dim=64, n_layers=2, n_heads=4, hidden_dim=128, vocab_size=256, max_position_embeddings=128),
        "encoder",
    ),
    "albert": ("AlbertConfig", "AlbertForMaskedLM", dict(_SMALL, embedding_size=32), "encoder"),
    "electra": ("ElectraConfig", "ElectraForMaskedLM", dict(_SMALL, embedding_size=32), "encoder"),
    "deberta_v2": ("DebertaV2Config", "DebertaV2ForMaskedLM", dict(_SMALL), "encoder"),
    "t5": (
        "T5Config",
        "T5ForConditionalGeneration",
        dict(
            d_model=64, d_ff=128, d_kv=16, num_layers=2, num_heads=4, vocab_size=256, decoder_start_token_id=0
        ),
        "seq2seq",
    ),
    "bart": (
        "BartConfig",
        "BartForConditionalGeneration",
        dict(_SEQ2SEQ, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2),
        "seq2seq",
    ),
    "marian": (
        "MarianConfig",
        "MarianMTModel",
        dict(_SEQ2SEQ, pad_token_id=1, eos_token_id=2, decoder_start_token_id=1),
        "seq2seq",
    ),
}


def build_family(name: str) -> tuple[nn.Module, str]:
    """The family's model from its small config, with random weights (seeded), and its kind."""
    import transformers

    config_class, model_class, options, kind = FAMILIES[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**options))
    return model.eval(), kind


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_transformers_family_runs_under_any_ram_budget(name, tmp_path):
    model, kind = build_family(name)
    ids = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids} if kind != "seq2seq" else {"input_ids": ids, "decoder_input_ids": ids[:, :5]}
    with torch.no_grad():
        expected = model(**inputs).logits
    generate = None
    if kind != "encoder":
        options = dict(
            max_new_tokens=5,
            min_new_tokens=5,
            do_sample=False,
            pad_token_id=0,
            attention_mask=torch.ones_like(ids),
        )

        def generate(m: nn.Module) -> torch.Tensor:
            return m.generate(ids, **options)

    tokens = generate(model) if generate is not None else None
    _runs_within(model, inputs, expected, tmp_path, generate, tokens)


def test_the_sweep_covers_what_the_issue_names():
    kinds = [spec[3] for spec in FAMILIES.values()]
    assert len(FAMILIES) >= 15 and {"decoder", "encoder", "seq2seq"} <= set(kinds)
    tied = {name: _tied(build_family(name)[0]) for name in ("gpt2", "llama", "llama_tied", "mixtral")}
    assert tied == {"gpt2": True, "llama": False, "llama_tied": True, "mixtral": False}
    assert "Mixtral" in type(build_family("mixtral")[0].model.layers[0].mlp).__name__, "a mixture of experts"
    assert set(TOO_SLOW) <= set(_torchvision_models()) and len(TOO_SLOW) <= 4


def _tied(model: nn.Module) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight
