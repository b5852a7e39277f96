"""The profiler on real architectures (random weights, built from configs): units own every
tensor once, run in execution order, sum to FlopCounterMode's totals, see attention FLOPs,
and cut sizes include every tensor that crosses a cut; the caller's model is left as it was."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import automap
from automap.devices import DeviceSpec
from automap.errors import AutomapError, ProfileError
from automap.profiling import calibrated_device, default_example_inputs, find_units
from automap.profiling.metaops import MemoTable
from conftest import tiny_gpt2, tiny_llama, tiny_t5


# ---------------------------------------------------------------------------- helpers


def reference_flops(model: nn.Module, args: tuple = (), kwargs: dict | None = None) -> tuple[int, int]:
    """FlopCounterMode's forward and forward+backward totals for ``model`` on meta."""
    state = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        meta = torch.empty_like(t, device="meta")
        state[name] = meta.requires_grad_(True) if isinstance(t, nn.Parameter) else meta
    with FlopCounterMode(display=False) as counter:
        out = torch.func.functional_call(model, state, args, kwargs or {}, tie_weights=True)
        forward = counter.get_total_flops()
        roots = [
            t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
    return forward, counter.get_total_flops()


def assert_every_tensor_owned_once(model: nn.Module, prof: automap.Profile) -> None:
    owned = [name for u in prof.units for name in u.tensors]
    assert len(owned) == len(set(owned))
    by_tensor = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    ):
        by_tensor.setdefault(id(t), set()).add(name)
    # every distinct tensor is owned by exactly one unit, under exactly one of its names
    assert sorted(len(names & set(owned)) for names in by_tensor.values()) == [1] * len(by_tensor)
    assert prof.total_bytes == sum(
        t.numel() * t.element_size()
        for t in {id(t): t for t in list(model.parameters()) + list(model.buffers())}.values()
    )


def snapshot(model: nn.Module) -> dict:
    return {
        "tensors": {n: (t, t.device, t.requires_grad) for n, t in model.state_dict(keep_vars=True).items()},
        "hooks": [
            (len(m._forward_pre_hooks), len(m._forward_hooks), len(m._backward_hooks))
            for m in model.modules()
        ],
        "training": [m.training for m in model.modules()],
    }


def assert_cuts_add_up_over_edges(prof: automap.Profile) -> None:
    """Summing edge bytes over the edges a cut crosses (as a planner does) gives cut_bytes."""
    position = {u.name: i for i, u in enumerate(prof.units)}
    for cut in range(len(prof.units)):
        crossing = sum(
            data["bytes"]
            for a, b, data in prof.graph.edges(data=True)
            if position.get(a, -1) < cut <= position.get(b, -1)
        )
        assert crossing == prof.cut_bytes(cut), (cut, prof.units[cut].name)


def read_by(prof: automap.Profile, src: str) -> set[str]:
    """Units that read a tensor ``src`` produced (true producer, not relays)."""
    return {f.dst for f in prof.flows if f.src == src}


def flops_close(a: int, b: int) -> bool:
    return abs(a - b) <= 0.01 * b


# ----------------------------------------------------------------------------- ResNet


def test_resnet50_units_order_flops_and_shares(resnet50):
    x = torch.zeros(2, 3, 128, 128)
    prof = automap.profile(resnet50, (x,))
    names = [u.name for u in prof.units]
    assert names[:4] == ["conv1", "bn1", "layer1.0", "layer1.1"] and names[-1] == "fc"
    assert_every_tensor_owned_once(resnet50, prof)
    forward, train = reference_flops(resnet50, (x.to("meta"),))
    assert flops_close(prof.total_flops, forward) and flops_close(prof.total_train_flops, train)
    # Measured, not 3x: the image needs no gradient, so conv1's backward is its weight gradient only.
    assert prof.units[0].train_flops == 2 * prof.units[0].flops
    assert prof.units[2].train_flops == 3 * prof.units[2].flops
    # The planner's reason to exist: layer4 holds most weights but not most FLOPs.
    stage = {
        s: sum(u.train_flops for u in prof.units if u.name.startswith(s)) / prof.total_train_flops
        for s in ("layer2", "layer3", "layer4")
    }
    params4 = sum(u.param_bytes for u in prof.units if u.name.startswith("layer4")) / 4
    assert round(params4 / 1e6, 1) == 15.0
    assert stage["layer2"] == pytest.approx(0.25, abs=0.02)
    assert stage["layer3"] == pytest.approx(0.36, abs=0.02)
    assert stage["layer4"] == pytest.approx(0.20, abs=0.02)


def test_resnet50_cuts_carry_skip_tensors(resnet50):
    x = torch.zeros(2, 3, 128, 128)
    prof = automap.profile(resnet50, (x,))
    block_out = 2 * 256 * 32 * 32 * 4  # layer1.0's output: the only tensor crossing into layer1.1
    assert prof.cut_bytes(prof.index("layer1.1")) == block_out
    # With conv/bn leaves as units, the block input (the skip) is live across the inner cuts.
    leaves = [n for n, m in resnet50.named_modules() if not list(m.children()) and list(m.parameters())]
    fine = automap.profile(resnet50, (x,), units=leaves)
    main_path = 2 * 64 * 32 * 32 * 4  # relu(bn1(conv1(x))) of layer1.1
    assert fine.cut_bytes(fine.index("layer1.1.conv2")) == main_path + block_out
    assert fine.graph.has_edge("layer1.0.downsample.1", "layer1.1.conv1")
    assert_cuts_add_up_over_edges(prof)
    assert_cuts_add_up_over_edges(fine)


# -------------------------------------------------------------------------------- ViT


def test_vit_b16_loose_tensors_and_attention_flops():
    import torchvision

    with torch.device("meta"):
        vit = torchvision.models.vit_b_16()
    prof = automap.profile(vit)
    assert prof.example == "image 1x3x224x224 (first conv)"
    assert_every_tensor_owned_once(vit, prof)
    first = prof.units[1]
    assert first.name == "encoder.layers.encoder_layer_0"
    assert set(first.loose) == {"class_token", "encoder.pos_embedding"}  # used just before it runs
    forward, _ = reference_flops(vit, (torch.zeros(1, 3, 224, 224, device="meta"),))
    assert flops_close(prof.total_flops, forward)
    layer = prof.units[2]
    tokens, width = 197, 768
    linear = 2 * tokens * (4 * width * width + 2 * width * 3072)
    assert layer.flops == linear + 4 * tokens * tokens * width  # q@k and attn@v, all heads
    assert_cuts_add_up_over_edges(prof)


# ------------------------------------------------------------------------------ GPT-2


def test_gpt2_tied_head_counted_once_and_reported():
    model = tiny_gpt2()
    prof = automap.profile(model, {"input_ids": torch.zeros(2, 16, dtype=torch.long)})
    assert_every_tensor_owned_once(model, prof)
    assert ("transformer.wte.weight", "lm_head.weight") in [
        tuple(sorted(g, reverse=True)) for g in prof.tie_groups
    ]
    unit = {u.name: u for u in prof.units}
    assert "transformer.wte.weight" in unit["transformer.wte"].tensors
    assert unit["lm_head"].param_bytes == 0 and unit["lm_head"].flops == 2 * 2 * 16 * 64 * 256
    # token embeddings (batch 2) and position embeddings (batch 1, broadcast) meet in h.0
    assert prof.cut_bytes(prof.index("transformer.h.0")) == 2 * 16 * 64 * 4 + 16 * 64 * 4
    assert_cuts_add_up_over_edges(prof)
    forward, train = reference_flops(
        model, kwargs={"input_ids": torch.zeros(2, 16, dtype=torch.long, device="meta")}
    )
    assert flops_close(prof.total_flops, forward) and flops_close(prof.total_train_flops, train)


# ------------------------------------------------------------------------------ Llama


def test_llama_attention_flops_and_residual_cut():
    model = tiny_llama(layers=3)
    batch, seq, hidden, heads, head_dim = 2, 32, 64, 4, 16
    ids = torch.zeros(batch, seq, dtype=torch.long)
    prof = automap.profile(model, {"input_ids": ids}, dtype=torch.bfloat16)
    assert [u.name for u in prof.units] == [
        "model.embed_tokens",
        "model.rotary_emb",
        "model.layers.0",
        "model.layers.1",
        "model.layers.2",
        "model.norm",
        "lm_head",
    ]
    layer = prof.units[2]
    linear_params = sum(p.numel() for n, p in model.model.layers[0].named_parameters() if p.dim() == 2)
    attention = 4 * batch * heads * seq * seq * head_dim
    assert layer.flops == 2 * batch * seq * linear_params + attention  # SDPA counted on meta
    forward, train = reference_flops(model, kwargs={"input_ids": ids.to("meta")})
    assert flops_close(prof.total_flops, forward) and flops_close(prof.total_train_flops, train)
    stream = hidden * seq * batch * 2  # bf16 residual stream
    rotary = 2 * seq * head_dim * 2  # cos and sin (batch 1: positions broadcast), used by every layer
    assert prof.cut_bytes(prof.index("model.layers.1")) == stream + rotary
    assert {"model.layers.0", "model.layers.1", "model.layers.2"} <= read_by(prof, "model.rotary_emb")
    assert prof.graph.edges["model.layers.0", "model.layers.1"]["bytes"] == stream + rotary  # cos/sin relayed
    assert_cuts_add_up_over_edges(prof)
    assert layer.param_bytes == sum(p.numel() for p in model.model.layers[0].parameters()) * 2
    assert layer.dtype_bytes == {"float32": layer.param_bytes * 2}


def test_llama_with_attention_mask_profiles_on_meta():
    model = tiny_llama(layers=1)
    ids = torch.zeros(2, 16, dtype=torch.long)
    plain = automap.profile(model, {"input_ids": ids}, backward=False)
    masked = automap.profile(
        model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, backward=False
    )
    assert masked.total_flops == plain.total_flops > 0  # `if mask.all():` is answered yes on meta
    assert masked.total_train_flops == 0  # not measured without a backward, never guessed


def test_llama_residual_skips_sublayer_units():
    model = tiny_llama(layers=2)
    batch, seq, hidden = 1, 24, 64
    prof = automap.profile(
        model,
        {"input_ids": torch.zeros(batch, seq, dtype=torch.long)},
        no_split=["LlamaAttention", "LlamaMLP"],
    )
    stream = hidden * seq * batch * 4
    rotary = 2 * seq * 16 * 4
    # before layer 1's attention: its normalised input, the residual it skips, cos/sin
    assert prof.cut_bytes(prof.index("model.layers.1.self_attn")) == 2 * stream + rotary
    assert_cuts_add_up_over_edges(prof)


# --------------------------------------------------------------------------------- T5


def test_t5_encoder_states_reach_every_decoder_block():
    model = tiny_t5(layers=2)
    ids = torch.zeros(1, 20, dtype=torch.long)
    prof = automap.profile(model, {"input_ids": ids, "decoder_input_ids": ids[:, :10]})
    names = [u.name for u in prof.units]
    assert names.index("encoder.block.1") < names.index("decoder.block.0")
    # `shared` is never called itself, but its tensor is tied to encoder.embed_tokens, which ran:
    # it misses nothing, so it is not reported as uncalled (issue 22)
    assert "shared" in names and prof.uncalled == ()
    assert_every_tensor_owned_once(model, prof)
    encoded = 20 * 64 * 4
    assert {"decoder.block.0", "decoder.block.1"} <= read_by(prof, "encoder.final_layer_norm")
    assert prof.graph.edges["encoder.final_layer_norm", "decoder.block.0"]["produced_bytes"] == encoded
    assert_cuts_add_up_over_edges(prof)
    # between decoder blocks: decoder hidden, self-attention bias, cross bias... and encoder states
    assert prof.cut_bytes(names.index("decoder.block.1")) >= encoded + 10 * 64 * 4
    forward, train = reference_flops(
        model, kwargs={"input_ids": ids.to("meta"), "decoder_input_ids": ids[:, :10].to("meta")}
    )
    assert flops_close(prof.total_flops, forward) and flops_close(prof.total_train_flops, train)


def resnet18_on_meta() -> nn.Module:
    import torchvision

    with torch.device("meta"):
        return torchvision.models.resnet18()


@pytest.mark.parametrize("build", [tiny_llama, tiny_t5, tiny_gpt2, resnet18_on_meta])
def test_memoised_meta_ops_change_nothing(build, monkeypatch):
    model = build()
    if build is resnet18_on_meta:
        inputs: tuple | dict = (torch.zeros(2, 3, 64, 64),)
    else:
        inputs = {"input_ids": torch.zeros(2, 12, dtype=torch.long)}
        if build is tiny_t5:
            inputs["decoder_input_ids"] = inputs["input_ids"]
    fast = automap.profile(model, inputs)
    monkeypatch.setattr(MemoTable, "_pure", lambda self, func: False)  # run every op for real
    slow = automap.profile(model, inputs)
    assert fast.units == slow.units
    assert [fast.cut_bytes(i) for i in range(len(fast.units))] == [
        slow.cut_bytes(i) for i in range(len(slow.units))
    ]


# ------------------------------------------------------------------ calls and inputs


class Reused(nn.Module):
    """A block called twice and a head that never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))  # owned by the model itself
        self.block = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.block(x * self.scale))


def test_repeated_and_uncalled_units_are_reported(caplog):
    model = Reused()
    model.register_buffer("spare", torch.zeros(2))  # held by the root, never read
    with caplog.at_level(logging.WARNING, logger="automap.profiling"):
        prof = automap.profile(model, (torch.zeros(4, 8),))
    unit = {u.name: u for u in prof.units}
    assert unit["block"].calls == 2 and prof.repeated == ("block",)
    assert prof.uncalled == ("unused",) and [u.name for u in prof.units] == ["block", "unused"]
    assert unit["block"].flops == 2 * (2 * 4 * 8 * 8)
    assert set(unit["block"].loose) == {"scale", "spare"}  # read first by block's work / first unit
    assert_every_tensor_owned_once(model, prof)
    assert "unused" in caplog.text


def test_a_module_under_two_names_is_one_unit_with_an_alias():
    model = Reused()
    model.again = model.block  # the same object, registered twice
    prof = automap.profile(model, (torch.zeros(4, 8),))
    unit = {u.name: u for u in prof.units}
    assert "again" not in unit and unit["block"].aliases == ("again",) and unit["block"].calls == 2
    assert_every_tensor_owned_once(model, prof)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


@pytest.mark.parametrize("backward", [True, False])
def test_activation_peak_is_what_is_alive_at_once(backward):
    model = nn.Sequential(MLP(), MLP())
    prof = automap.profile(model, (torch.zeros(4, 64),), no_split=["MLP"], backward=backward)
    first = prof.units[0]
    assert (first.input_bytes, first.output_bytes) == (4 * 64 * 4, 4 * 64 * 4)
    # input + fc1's output and gelu's output alive together; saved-for-backward tensors do not count
    assert first.peak_activation_bytes == 4 * 64 * 4 + 2 * (4 * 256 * 4)


def test_no_derivable_inputs_profiles_bytes_and_warns():
    model = nn.Sequential(nn.LayerNorm(16), nn.LayerNorm(16))
    assert default_example_inputs(model) == (None, "")
    with pytest.warns(UserWarning, match="bytes only"):
        prof = automap.profile(model)
    assert not prof.has_compute and prof.example == "" and prof.total_bytes == 4 * 64


def test_derived_inputs_say_what_they_are():
    _, how = default_example_inputs(tiny_t5())
    assert how == "input_ids 1x128 (+ decoder_input_ids)"


# --------------------------------------------------------------- the model is unchanged


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_derived_inputs_of_a_half_model_are_at_its_dtype_and_trace(dtype):
    """A model built (or loaded) at a half dtype gets its guessed image at that dtype: float32
    pixels made its first convolution refuse, and the whole forward went untraced (no
    activations in the memory model)."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3)).to(dtype).eval()
    (image,), how = default_example_inputs(model)
    assert image.dtype == dtype and how == "image 1x3x224x224 (first conv)"
    prof = automap.profile(model)
    assert not prof.untraced and prof.run_peak_bytes > 0
    assert default_example_inputs(model.float())[0][0].dtype == torch.float32


def test_profiling_leaves_the_model_as_it_was():
    model = tiny_llama(layers=2).train()
    before = snapshot(model)
    automap.profile(model, measure=True, device="cpu", repeats=1)
    after = snapshot(model)
    assert after["hooks"] == before["hooks"] and after["training"] == before["training"]
    for name, (tensor, device, grad) in before["tensors"].items():
        now = after["tensors"][name]
        assert now[0] is tensor and now[1] == device and now[2] == grad and tensor.grad is None


# ------------------------------------------------------------------------------ timing


def test_measured_timing_and_calibration_on_cpu():
    with torch.device("meta"):
        model = tiny_llama(layers=2)  # weights on meta: each unit is materialised alone
    prof = automap.profile(
        model, {"input_ids": torch.zeros(1, 16, dtype=torch.long)}, measure=True, device="cpu", repeats=2
    )
    assert prof.measured_device == "cpu"
    assert all(u.seconds is not None and u.seconds > 0 for u in prof.units)
    rate = prof.achieved_flops_per_second
    assert rate is not None and math.isfinite(rate) and rate > 0
    spec = DeviceSpec("cpu", "cpu", 2**30, 1.0, 1.0)
    assert calibrated_device(spec, prof).flops_per_second == rate
    timed = prof.with_measured_time()
    assert timed.units[0].flops > 0 == prof.units[0].flops  # the embedding takes time, not FLOPs
    assert timed.total_flops == pytest.approx(prof.total_flops, rel=0.01)


@pytest.mark.cuda
def test_measured_timing_on_a_gpu():
    model = tiny_llama(layers=2)
    prof = automap.profile(
        model,
        {"input_ids": torch.zeros(4, 64, dtype=torch.long)},
        measure=True,
        device="cuda:0",
        repeats=3,
        dtype=torch.float16,
    )
    assert prof.measured_device == "cuda:0" and all(u.seconds and u.seconds > 0 for u in prof.units)
    assert prof.achieved_flops_per_second and prof.achieved_flops_per_second > 0
    assert all(p.device.type == "cpu" for p in model.parameters())  # only copies went to the GPU


def test_measure_without_device_is_refused():
    with pytest.raises(ProfileError, match="device="):
        automap.profile(tiny_llama(layers=1), measure=True)
    with pytest.raises(ProfileError, match="measure=True"):
        automap.profile(tiny_llama(layers=1)).with_measured_time()


# ------------------------------------------------------------------------ bad input


def test_rejected_inputs_name_the_unit_and_keep_the_cause(resnet50):
    with pytest.raises(ProfileError, match="inside unit 'conv1'") as info:
        automap.profile(resnet50, (torch.zeros(1, 1, 64, 64),))  # one channel for a 3-channel conv
    assert isinstance(info.value, AutomapError) and isinstance(info.value.__cause__, RuntimeError)


def test_unknown_no_split_class_is_refused():
    with pytest.raises(ProfileError, match="LlamaBlock"):
        find_units(tiny_llama(layers=1), no_split=["LlamaBlock"])
