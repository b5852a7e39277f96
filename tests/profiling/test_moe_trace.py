"""Tracing mixture-of-experts layers (``automap/profiling/metarules.py``, ``experts.py``):
transformers' Mixtral and Qwen2-MoE layers trace on meta in every experts implementation and
dtype, with the FLOPs of the routed computation (``top_k`` of the experts per token, counted by
hand from the config), measured activations, and the user's experts implementation back
afterwards. The grouped matmul's meta rule matches the real CPU kernel in all four layouts."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import automap
from automap.profiling.metarules import grouped_mm_flops, grouped_mm_shape
from conftest import tiny_moe
from tiny_configs import beside_the_run

BATCH, SEQ = 2, 16
TOKENS = BATCH * SEQ
FLOAT = 4  # bytes of a float32


def tiny(kind: str, layers: int = 2):
    """A small MoE causal LM: hidden 64, 8 experts, 2 per token, vocab 128."""
    return tiny_moe(kind, layers=layers, hidden=64, experts=8, shared=48)


def ids() -> tuple[torch.Tensor]:
    torch.manual_seed(1)
    return (torch.randint(0, 128, (BATCH, SEQ)),)


def experts_width(config) -> int:
    """Intermediate width of one routed expert."""
    return getattr(config, "moe_intermediate_size", None) or config.intermediate_size


def hand_count(config, experts_per_token: int | None = None, batch: int = BATCH, seq: int = SEQ) -> int:
    """Forward FLOPs of one decoder layer on ``batch`` x ``seq`` tokens, 2 per multiply-add: q/k/v/o
    projections, the attention's two matmuls (the full score matrix, as torch counts it), the
    router, ``experts_per_token`` experts' gate, up and down projections per token (top_k by
    default), and Qwen2-MoE's shared expert and its gate."""
    h, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or h // heads
    k = experts_per_token or config.num_experts_per_tok
    n_experts = getattr(config, "num_local_experts", None) or config.num_experts
    tokens = batch * seq
    attention = 2 * tokens * h * (heads * d + 2 * kv * d) + 2 * tokens * heads * d * h
    attention += 2 * 2 * batch * heads * seq * seq * d
    router = 2 * tokens * h * n_experts
    routed = 2 * tokens * k * 3 * h * experts_width(config)
    shared = 0
    if getattr(config, "shared_expert_intermediate_size", 0):
        shared = 2 * tokens * 3 * h * config.shared_expert_intermediate_size + 2 * tokens * h
    return attention + router + routed + shared


def split_layer(kind: str) -> list[str]:
    """Units of a one-layer model whose MoE block is split: the experts are a unit of their own."""
    shared = ["model.layers.0.mlp.shared_expert"] if kind == "qwen2_moe" else []  # runs before the router
    return [
        "model.embed_tokens",
        "model.layers.0.self_attn",
        *shared,
        "model.layers.0.mlp.gate",
        "model.layers.0.mlp.experts",
        "model.norm",
        "lm_head",
    ]


def layer_unit(prof: automap.Profile, index: int = 0):
    return prof.units[prof.index(f"model.layers.{index}")]


# ------------------------------------------------------------------- FLOPs by hand


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm", "eager"])
@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_a_moe_layer_traces_with_the_flops_of_its_routed_tokens(kind, impl):
    model = tiny(kind)
    model.set_experts_implementation(impl)
    prof = automap.profile(model, ids())
    assert not prof.untraced
    want, all_experts = hand_count(model.config), hand_count(model.config, experts_per_token=8)
    assert all_experts > 1.3 * want  # counting every expert would fail the check below
    for index in range(2):
        unit = layer_unit(prof, index)
        assert not unit.untraced and not unit.flops_estimated
        assert abs(unit.flops - want) <= 0.05 * want, (unit.flops, want)
        # backward: two matmuls per forward matmul
        assert abs(unit.train_flops - 3 * want) <= 0.05 * 3 * want, (unit.train_flops, want)
    assert model.get_experts_implementation() == {"": impl}  # the trace put the user's choice back


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_moe_layers_trace_at_bfloat16_with_the_same_flops_and_half_the_activations(kind):
    model = tiny(kind)
    full = layer_unit(automap.profile(model, ids()))
    half = layer_unit(automap.profile(model, ids(), dtype=torch.bfloat16))
    assert not half.untraced and half.flops == full.flops
    assert half.output_bytes * 2 == full.output_bytes == TOKENS * model.config.hidden_size * FLOAT
    assert half.param_bytes * 2 == full.param_bytes


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_the_experts_as_their_own_unit_measure_the_routed_work_their_bytes_and_activations(kind):
    model = tiny(kind, layers=1)
    config = model.config
    prof = automap.profile(model, ids(), units=split_layer(kind))
    experts = prof.units[prof.index("model.layers.0.mlp.experts")]
    h, width, k = config.hidden_size, experts_width(config), config.num_experts_per_tok
    assert experts.flops == 2 * TOKENS * k * 3 * h * width  # top_k experts per token, not all 8
    assert experts.param_bytes == 8 * 3 * h * width * FLOAT  # gate_up_proj and down_proj, all 8 experts
    assert experts.output_bytes == TOKENS * h * FLOAT
    # The gate/up projection of every routed row is alive at once, and no weight copy is made.
    routed_rows = TOKENS * k * 2 * width * FLOAT
    assert routed_rows <= experts.peak_activation_bytes < routed_rows + 8 * TOKENS * k * h * FLOAT
    router = prof.units[prof.index("model.layers.0.mlp.gate")]
    assert router.flops == 2 * TOKENS * h * 8


def test_batched_experts_are_measured_with_the_weight_copy_they_gather_per_routed_row():
    model = tiny("mixtral", layers=1)
    grouped = layer_unit(automap.profile(model, ids()))
    model.set_experts_implementation("batched_mm")
    batched = layer_unit(automap.profile(model, ids()))
    gathered = TOKENS * 2 * 2 * 128 * 64 * FLOAT  # gate_up_proj[expert_ids]: one 256x64 matrix per routed row
    assert batched.flops == grouped.flops
    assert batched.peak_activation_bytes >= gathered > grouped.peak_activation_bytes


class RoutedRows(TorchDispatchMode):
    """Counts a real forward's grouped matmul FLOPs from the real offsets: rows per expert."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default:
            mat_b, offs = args[1], kwargs.get("offs", args[2] if len(args) > 2 else None)
            rows = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
            self.flops += sum(2 * r * mat_b.shape[1] * mat_b.shape[2] for r in rows)
        return func(*args, **kwargs)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_the_meta_count_is_what_a_real_cpu_forward_routes(kind):
    model = tiny(kind, layers=1)
    experts = automap.profile(model, ids(), units=split_layer(kind))
    counted = experts.units[experts.index("model.layers.0.mlp.experts")].flops
    with torch.no_grad(), RoutedRows() as real:
        model(*ids())
    assert real.flops == counted


# ------------------------------------------------------------------- plans and the CLI


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_a_moe_model_plans_from_a_trace(kind):
    model = tiny(kind)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    plan = automap.plan(model, max_memory={0: weights // 2, "cpu": weights}, example_inputs=ids())
    layers = [u for u in plan.units if u.name.startswith("model.layers.")]
    assert [u.flops for u in layers] == [hand_count(model.config)] * 2
    assert not [u.name for u in plan.units if u.untraced]
    assert "without a trace" not in plan.report()
    assert json.loads(plan.to_json())["totals"]["untraced_units"] == []


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_a_traced_moe_model_dispatches_with_part_on_disk_and_gives_the_plain_outputs(kind, tmp_path):
    model = tiny(kind, layers=4)
    with torch.no_grad():
        expected = model(*ids()).logits
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = {"cpu": beside_the_run(model, int(0.4 * weights))}
    plan = automap.plan(model, "auto", max_memory=budget, offload_dir=tmp_path)
    held = plan.placements.bytes_on
    assert held.get("disk", 0) > 0 and held.get("cpu", 0) > 0, plan.device_map
    assert not [u.name for u in plan.units if u.untraced]
    automap.dispatch(model, plan, offload_dir=tmp_path / "offload")
    with torch.no_grad():
        got = model(*ids()).logits
    assert (got - expected).abs().max().item() <= 1e-6
    automap.undispatch(model)


def test_the_cli_plans_a_moe_folder_with_a_trace(tmp_path, capsys):
    from automap.cli import main

    tiny("mixtral").save_pretrained(tmp_path / "mixtral")
    code = main(["plan", str(tmp_path / "mixtral"), "--max-memory", "cpu=1MB,disk=1GB"])
    out = capsys.readouterr().out
    assert code == 0 and "balanced by FLOPs" in " ".join(out.split()) and "without a trace" not in out, out


# ------------------------------------------------------------------- eager experts


def test_eager_experts_get_their_implementation_back_when_the_forward_fails():
    model = tiny("mixtral")
    model.set_experts_implementation("eager")
    with pytest.raises(automap.errors.ProfileError):
        automap.profile(model, (torch.zeros(1, 4, 7),))  # a float 3-D tensor for input_ids
    assert model.get_experts_implementation() == {"": "eager"}


# ------------------------------------------------------------------- the meta rule


def layouts() -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """The four layouts of grouped_mm, real float32 tensors (rows of 16-byte multiples, as the
    CPU kernel needs), 3 groups of uneven sizes, one of them empty."""
    torch.manual_seed(0)
    return [
        ("2d-3d", torch.randn(7, 8), torch.randn(3, 8, 4), torch.tensor([2, 2, 7], dtype=torch.int32)),
        ("3d-2d", torch.randn(3, 5, 8), torch.randn(8, 12), torch.tensor([4, 4, 12], dtype=torch.int32)),
        ("2d-2d", torch.randn(5, 12), torch.randn(12, 4), torch.tensor([8, 8, 12], dtype=torch.int32)),
        ("3d-3d", torch.randn(3, 5, 8), torch.randn(3, 8, 4), None),
    ]


def by_hand(layout: str, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> int:
    """FLOPs group by group, from the real group sizes."""
    sizes = torch.diff(offs, prepend=offs.new_zeros(1)).tolist() if offs is not None else [1] * a.shape[0]
    per_group = {
        "2d-3d": lambda s: s * a.shape[1] * b.shape[2],
        "3d-2d": lambda s: a.shape[1] * a.shape[2] * s,
        "2d-2d": lambda s: a.shape[0] * s * b.shape[1],
        "3d-3d": lambda s: a[0].numel() * b.shape[2],
    }
    return sum(2 * per_group[layout](s) for s in sizes)


@pytest.mark.parametrize("layout", ["2d-3d", "3d-2d", "2d-2d", "3d-3d"])
def test_the_grouped_mm_rule_matches_the_real_kernel(layout):
    _, a, b, offs = next(case for case in layouts() if case[0] == layout)
    real = torch._grouped_mm(a, b, offs=offs)
    meta_a, meta_b = a.to("meta"), b.to("meta")
    meta_offs = offs.to("meta") if offs is not None else None
    assert grouped_mm_shape(meta_a, meta_b, meta_offs) == tuple(real.shape)
    assert grouped_mm_flops(meta_a, meta_b, meta_offs) == by_hand(layout, a, b, offs)


def test_the_grouped_mm_rule_rejects_what_the_real_kernel_rejects():
    offs = torch.tensor([2, 7], dtype=torch.int32)
    for a, b in [(torch.randn(7, 8), torch.randn(2, 9, 4)), (torch.randn(7, 8), torch.randn(3, 8, 4))]:
        with pytest.raises(RuntimeError):
            torch._grouped_mm(a, b, offs=offs)
        with pytest.raises(RuntimeError):
            grouped_mm_shape(a.to("meta"), b.to("meta"), offs.to("meta"))
