"""The scripts users write around a model with part of it offloaded to disk behave as they do
around the plain model: generation in its forms, forward options, backward, and what scripts do
to a model after dispatch (state dicts, saving, loading weights in, in-place edits, resizing,
conversions, copies, wrapping layers, pipelines). Where automap refuses (gradients of offloaded
weights, dtype conversions of offloaded ones), the refusal is an AutomapError that leaves the
model as it was."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import automap
from automap.errors import ConversionError, DispatchError
from automap.offload import HostCopyOps, StagedTransfer
from automap.runtime import dispatch_plan, state_of
from conftest import streamed_files, tiny_gpt2, tiny_llama, tiny_t5, weight_bytes
from tiny_configs import beside_the_run, part_on_disk

IDS = torch.randint(1, 256, (2, 8), generator=torch.Generator().manual_seed(1))
# GPT-2's tied embedding (wte = lm_head) and Llama's embedding, last norm and head on disk.
GPT2_EMBED_ON_DISK = {
    "transformer.wte": "disk",
    "transformer.wpe": "cpu",
    "transformer.drop": "cpu",
    "transformer.h": "cpu",
    "transformer.ln_f": "cpu",
    "lm_head": "disk",
}
LLAMA_MAP = {
    "model.embed_tokens": "disk",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.layers.2": "cpu",
    "model.layers.3": "disk",
    "model.norm": "disk",
    "model.rotary_emb": "disk",
    "lm_head": "disk",
}


def dispatched(build, tmp_path, device_map=None, **options):
    """``build(**options)`` dispatched with part of it on disk (40 % of its bytes in RAM beside
    the run, or ``device_map``)."""
    model = build(**options)
    if device_map is None:
        automap.dispatch(model, max_memory=part_on_disk(model), offload_dir=tmp_path)
    else:
        automap.dispatch(model, device_map, offload_dir=tmp_path)
    assert streamed_files(model), "part of the model must be offloaded"
    return model


def staged(build, tmp_path, device_map):
    """Dispatched on the accelerator path (a copy swapped in per unit, the next read ahead),
    run on the CPU with real copies."""
    model = build()
    dispatch_plan(
        model,
        automap.plan(model, device_map),
        offload_dir=tmp_path,
        transfer=lambda source, *_: StagedTransfer(source, HostCopyOps()),
    )
    assert state_of(model).transfer.swaps
    return model


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def close(a, b, tol=1e-5):
    return a.shape == b.shape and (a.float() - b.float()).abs().max().item() <= tol


def offloaded_weights(model) -> list[str]:
    return [n for n in streamed_files(model) if n.endswith("weight")]


# ------------------------------------------------------------------ generation


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama])
def test_generate_in_its_forms_gives_the_plain_tokens_and_scores(build, tmp_path):
    plain, placed = build(), dispatched(build, tmp_path)
    padded = IDS.clone()
    padded[0, :3] = 0
    mask = torch.ones_like(padded)
    mask[0, :3] = 0
    forms = [
        dict(do_sample=False),
        dict(num_beams=3, do_sample=False),
        dict(do_sample=True, top_k=50),
        dict(use_cache=False),
        dict(input_ids=padded, attention_mask=mask),
        dict(output_scores=True, return_dict_in_generate=True),
    ]
    for form in forms:
        form = {"input_ids": IDS, "max_new_tokens": 4, "pad_token_id": 0, **form}
        torch.manual_seed(5)
        expected = plain.generate(**form)
        torch.manual_seed(5)
        got = placed.generate(**form)
        if isinstance(expected, torch.Tensor):
            assert torch.equal(got, expected), form
        else:
            assert torch.equal(got.sequences, expected.sequences)
            assert all(close(a, b) for a, b in zip(got.scores, expected.scores))


def test_a_decode_loop_passing_past_key_values_gives_the_plain_logits(tmp_path):
    plain, placed = tiny_llama(), dispatched(tiny_llama, tmp_path)
    steps = []
    for model in (plain, placed):
        ids, past, seen = IDS, None, []
        with torch.no_grad():
            for _ in range(4):
                out = model(ids if past is None else ids[:, -1:], past_key_values=past, use_cache=True)
                past = out.past_key_values
                ids = torch.cat([ids, out.logits[:, -1].argmax(-1, keepdim=True)], 1)
                seen.append(out.logits[:, -1])
        steps.append(seen)
    assert all(close(a, b) for a, b in zip(*steps))


def test_t5_with_its_shared_embedding_offloaded_generates_and_scores_like_the_plain_one(tmp_path):
    plain = tiny_t5()
    placed = tiny_t5()
    automap.dispatch(
        placed,
        max_memory={"cpu": beside_the_run(placed, int(weight_bytes(placed) * 0.3))},
        offload_dir=tmp_path,
    )
    for options in (dict(max_new_tokens=5), dict(max_new_tokens=5, num_beams=3)):
        assert torch.equal(placed.generate(IDS, **options), plain.generate(IDS, **options))
    with torch.no_grad():
        assert close(placed(input_ids=IDS, labels=IDS).loss, plain(input_ids=IDS, labels=IDS).loss)


# ------------------------------------------------------------------ forward options


def test_forward_options_and_grad_modes_give_the_plain_outputs(tmp_path):
    plain, placed = tiny_llama(), dispatched(tiny_llama, tmp_path)
    for model in (plain, placed):
        model.config._attn_implementation = "eager"  # attentions are returned by eager attention
    with torch.no_grad():
        a = plain(IDS, output_hidden_states=True, output_attentions=True)
        b = placed(IDS, output_hidden_states=True, output_attentions=True)
        as_tuple = placed(IDS, return_dict=False)
    assert all(close(x, y) for x, y in zip(a.hidden_states + a.attentions, b.hidden_states + b.attentions))
    assert isinstance(as_tuple, tuple) and close(as_tuple[0], a.logits)
    with torch.inference_mode():
        assert close(placed(IDS).logits, a.logits)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(placed(IDS).logits, plain(IDS).logits)
    placed.train()
    placed.eval()
    assert close(logits(placed), a.logits)


# ------------------------------------------------------------------ backward


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama])
def test_backward_reaching_offloaded_weights_is_refused_before_any_gradient(build, tmp_path):
    plain, placed = build(), dispatched(build, tmp_path)
    loss = placed(IDS, labels=IDS).loss
    with pytest.raises(
        DispatchError,
        match=r"backward stopped before a gradient reached offloaded parameter "
        r"'[^']+'.*accumulated none.*requires_grad_\(False\)",
    ):
        loss.backward()
    # Nothing accumulated (the head and final norm after the offloaded units included), so
    # freezing the offloaded weights and running backward again matches the plain model.
    assert [n for n, p in placed.named_parameters() if p.grad is not None] == []
    offloaded = set(streamed_files(placed))
    for model in (plain, placed):
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(name not in offloaded)
        model(IDS, labels=IDS).loss.backward()
    expected = dict(plain.named_parameters())
    for name, parameter in placed.named_parameters():
        assert (parameter.grad is None) == (expected[name].grad is None), name
        if parameter.grad is not None:
            assert close(parameter.grad, expected[name].grad, 1e-4), name


def test_gradients_for_the_inputs_alone_pass_through_offloaded_weights(tmp_path):
    plain, placed = tiny_llama(), dispatched(tiny_llama, tmp_path)  # every weight requires grad
    grads = []
    for model in (plain, placed):
        embeds = model.get_input_embeddings()(IDS).detach().requires_grad_()
        grads.append(torch.autograd.grad(model(inputs_embeds=embeds).logits.sum(), [embeds])[0])
    assert close(grads[1], grads[0], 1e-4)


class _Lora(nn.Module):
    def __init__(self, base: nn.Linear):
        super().__init__()
        generator = torch.Generator().manual_seed(2)
        self.base = base
        self.a = nn.Parameter(torch.randn(4, base.in_features, generator=generator) * 0.1)
        self.b = nn.Parameter(torch.randn(base.out_features, 4, generator=generator) * 0.1)

    def forward(self, x):
        return self.base(x) + x @ self.a.t() @ self.b.t()


@pytest.mark.parametrize("reentrant", [True, False])
def test_lora_around_an_offloaded_linear_with_checkpointing_trains_like_the_plain_model(reentrant, tmp_path):
    plain, placed = tiny_llama(), dispatched(tiny_llama, tmp_path)
    attention = [n for n in offloaded_weights(placed) if n.endswith("q_proj.weight")][0].rsplit(".", 2)[0]
    results = []
    for model in (plain, placed):
        model.requires_grad_(False)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.enable_input_require_grads()
        module = model.get_submodule(attention)
        module.q_proj = _Lora(module.q_proj)
        model.train()
        out = model(IDS, labels=IDS)
        out.loss.backward()
        results.append((out.loss.detach(), [p.grad for p in model.parameters() if p.requires_grad]))
    assert close(results[1][0], results[0][0]) and len(results[1][1]) == 2
    assert all(close(a, b, 1e-4) for a, b in zip(results[1][1], results[0][1]))


def test_an_optimizer_over_all_parameters_steps_the_resident_ones_like_the_plain_model(tmp_path):
    plain, placed = tiny_llama(), dispatched(tiny_llama, tmp_path)
    offloaded = set(streamed_files(placed))
    after = []
    for model in (plain, placed):
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(name not in offloaded)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            model(IDS, labels=IDS).loss.backward()
            optimizer.step()
            model.zero_grad()
        after.append(logits(model))
    assert close(after[1], after[0], 1e-4)


# ------------------------------------------------------------------ the model after dispatch


def test_state_dict_parameters_print_and_torch_save_show_the_real_weights(tmp_path):
    plain, placed = tiny_gpt2(), dispatched(tiny_gpt2, tmp_path / "off", GPT2_EMBED_ON_DISK)
    expected, got = plain.state_dict(), placed.state_dict()
    assert list(got) == list(expected)
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    assert [(n, p.shape) for n, p in placed.named_parameters()] == [
        (n, p.shape) for n, p in plain.named_parameters()
    ]
    assert str(placed) == str(plain) and "tensor(" in str(placed.transformer.wte.weight)
    torch.save(placed.state_dict(), tmp_path / "sd.pt")
    saved = torch.load(tmp_path / "sd.pt", weights_only=True)
    assert all(torch.equal(saved[k], v) for k, v in expected.items())


def test_save_pretrained_of_a_partly_offloaded_model_reloads_with_its_edits(tmp_path):
    from transformers import AutoModelForCausalLM

    for build, device_map in ((tiny_gpt2, GPT2_EMBED_ON_DISK), (tiny_llama, LLAMA_MAP)):
        plain, placed = build(), dispatched(build, tmp_path / build.__name__, device_map)
        name = offloaded_weights(placed)[0]
        for model in (plain, placed):
            with torch.no_grad():
                model.get_parameter(name).mul_(2)
        placed.save_pretrained(tmp_path / f"saved-{build.__name__}")
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / f"saved-{build.__name__}").eval()
        assert close(logits(reloaded), logits(plain)), build.__name__


def test_weights_loaded_or_edited_in_place_are_used_by_the_next_forward(tmp_path):
    from transformers import LlamaForCausalLM

    plain, placed = tiny_llama(), dispatched(tiny_llama, tmp_path)
    torch.manual_seed(9)
    other = LlamaForCausalLM(plain.config).eval()
    placed.load_state_dict(other.state_dict())
    assert close(logits(placed), logits(other))
    name = offloaded_weights(placed)[0]
    for model in (other, placed):
        with torch.no_grad():
            model.get_parameter(name).mul_(2)
    assert close(logits(placed), logits(other))


def _load_other(model):
    from transformers import LlamaForCausalLM

    torch.manual_seed(9)
    model.load_state_dict(LlamaForCausalLM(model.config).state_dict())


def _init_linear(model):
    torch.manual_seed(3)
    model.apply(
        lambda m: nn.init.normal_(m.weight, std=0.05) if isinstance(m, (nn.Linear, nn.Embedding)) else None
    )


def _scale_embedding(model):
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(2)


def _halve_rotary_frequencies(model):
    model.model.rotary_emb.inv_freq.mul_(0.5)


@pytest.mark.parametrize("edit", [_load_other, _init_linear, _scale_embedding, _halve_rotary_frequencies])
def test_accelerator_path_uses_a_write_made_between_forwards(edit, tmp_path):
    """The last streamed unit reads the first one ahead for the next forward (or token): a
    write made between the two forwards must not be run on the copy read before it."""
    plain, placed = tiny_llama(), staged(tiny_llama, tmp_path, LLAMA_MAP)
    assert close(logits(placed), logits(plain))  # reads the embedding's copy ahead for the next forward
    edit(plain)
    edit(placed)
    assert close(logits(placed), logits(plain))
    options = dict(max_new_tokens=3, pad_token_id=0)
    assert torch.equal(placed.generate(IDS, **options), plain.generate(IDS, **options))


def test_resizing_and_retying_embeddings_that_are_on_disk(tmp_path):
    plain, placed = tiny_gpt2(), dispatched(tiny_gpt2, tmp_path, GPT2_EMBED_ON_DISK)
    for model in (plain, placed):
        model.resize_token_embeddings(300)
    assert placed.lm_head.weight is placed.transformer.wte.weight
    with torch.no_grad():
        plain.transformer.wte.weight.copy_(placed.transformer.wte.weight)  # the new rows are random
    assert logits(placed).shape[-1] == 300 and close(logits(placed), logits(plain))
    for model in (plain, placed):
        model.lm_head.weight = nn.Parameter(model.transformer.wte.weight.detach() * 2)  # untied
    assert close(logits(placed), logits(plain))
    for model in (plain, placed):
        model.tie_weights()
    assert placed.lm_head.weight is placed.transformer.wte.weight and close(logits(placed), logits(plain))


def test_conversions_are_refused_with_the_model_intact_and_go_through_after_undispatch(tmp_path):
    plain, placed = tiny_llama(), dispatched(tiny_llama, tmp_path)
    for convert in (lambda m: m.half(), lambda m: m.to(torch.bfloat16)):
        with pytest.raises(ConversionError, match="load or dispatch it in that dtype"):
            convert(placed)
    placed.to("cpu")
    placed.float()  # changes nothing
    assert close(logits(placed), logits(plain))
    automap.undispatch(placed)
    placed.half()
    plain.half()
    assert torch.equal(logits(placed), logits(plain))


def test_copies_swapped_modules_apply_and_zero_grad(tmp_path):
    plain, placed = tiny_llama(), dispatched(tiny_llama, tmp_path, LLAMA_MAP)
    copied = copy.deepcopy(placed)
    assert state_of(copied) is None and close(logits(copied), logits(plain))
    torch.manual_seed(4)
    embedding = nn.Embedding(256, 64)
    for model in (plain, placed):
        model.set_input_embeddings(copy.deepcopy(embedding))
        model.apply(lambda m: m.weight.data.mul_(0.5) if isinstance(m, nn.Linear) else None)
        model.zero_grad()
    assert close(logits(placed), logits(plain))


def test_accelerate_remove_hook_leaves_it_working_and_undispatch_frees_it(tmp_path):
    from accelerate.hooks import remove_hook_from_module

    plain, placed = tiny_gpt2(), dispatched(tiny_gpt2, tmp_path, GPT2_EMBED_ON_DISK)
    remove_hook_from_module(placed, recurse=True)  # accelerate's hooks only: automap's stay, and work
    assert close(logits(placed), logits(plain))
    automap.undispatch(placed)
    assert state_of(placed) is None and placed.lm_head.weight is placed.transformer.wte.weight
    assert close(logits(placed), logits(plain))


def test_text_generation_pipeline_with_a_local_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast, pipeline

    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    words.train_from_iterator(
        ["hello world the cat sat on the mat", "a dog ran far away"],
        tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]"]),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="[UNK]", pad_token="[PAD]", eos_token="[UNK]"
    )
    plain, placed = tiny_gpt2(), dispatched(tiny_gpt2, tmp_path)
    prompts = ["hello world the cat", "a dog ran"]
    runs = [
        pipeline("text-generation", model=m, tokenizer=tokenizer)(prompts, max_new_tokens=5, do_sample=False)
        for m in (plain, placed)
    ]
    assert runs[1] == runs[0]


@pytest.mark.parametrize("path", ["cpu", "accelerator"])
def test_torch_func_grad_of_a_functional_call_gives_the_plain_gradients(path, tmp_path):
    """torch.func's transforms replace the parameters by stand-ins without storage of their own
    and turn saved-tensor hooks off; the model's weights stay as they were."""
    from torch.func import functional_call, grad

    plain = tiny_llama()
    placed = (
        dispatched(tiny_llama, tmp_path, LLAMA_MAP)
        if path == "cpu"
        else staged(tiny_llama, tmp_path, LLAMA_MAP)
    )
    grads = []
    for model in (plain, placed):
        params = {n: p.detach() * 1.5 for n, p in model.named_parameters()}
        grads.append(grad(lambda ps: functional_call(model, ps, (IDS,)).logits.sum())(params))
    assert grads[1].keys() == grads[0].keys()
    assert all(close(grads[1][n], grads[0][n], 1e-3) for n in grads[0])
    assert close(logits(placed), logits(plain))
