"""One plan, every engine: ``plan.export(engine)`` and ``automap plan --emit ENGINE`` give the
plan in the form each engine documents, checked against that form: accelerate's device_map,
torch pipelining's split_spec, torchtitan's module_fqns_per_model_part, vLLM's
VLLM_PP_LAYER_PARTITION, llama.cpp's -ngl/-ot flags over the GGUF tensor names of the same
architecture (applied as llama.cpp applies them: the first pattern found in a name wins)."""

from __future__ import annotations

import re
import shlex

import pytest
import torch

import automap
from automap.cli import EMIT_ENGINES, main
from automap.distributed import plan_for_ranks, split_spec
from automap.errors import PipelineError, PlanError
from automap.planning.model import EXPORTERS
from automap.spec_plan import plan_spec
from conftest import tiny_llama, tiny_moe
from tiny_configs import beside_the_run

IDS = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(layers=6)


@pytest.fixture(scope="module")
def ranks(llama):
    return plan_for_ranks(llama, 3, example_inputs=(IDS,))


def test_the_cli_offers_every_registered_engine():
    automap.plan(torch.nn.Linear(2, 2), {"": "cpu"}).report()  # the registry is filled
    assert set(EMIT_ENGINES) == set(EXPORTERS)


def test_an_unknown_engine_names_the_engines(ranks):
    with pytest.raises(PlanError, match="llama.cpp.*vllm|vllm"):
        ranks.export("tensorrt")


def test_accelerate_gets_the_device_map(ranks):
    assert ranks.export("accelerate") == ranks.device_map


def test_split_spec_is_torch_pipelinings(ranks):
    from torch.distributed.pipelining import SplitPoint

    spec = ranks.export("split_spec")
    assert spec == split_spec(ranks) and set(spec.values()) == {SplitPoint.BEGINNING} and len(spec) == 2


def test_torchtitan_gets_each_stages_modules_in_order(llama, ranks):
    parts = ranks.export("torchtitan")
    modules = dict(llama.named_modules())
    assert isinstance(parts, list) and len(parts) == 3 and all(isinstance(p, list) and p for p in parts)
    flat = [name for part in parts for name in part]
    assert all(name in modules for name in flat) and len(flat) == len(set(flat))
    assert flat == [u.name for u in ranks.units]  # contiguous stages, in execution order
    owned = {n for name in flat for n, _ in modules[name].named_parameters(prefix=name)}
    assert owned == {n for n, _ in llama.named_parameters()}


def test_vllm_gets_layers_per_stage_summing_to_the_models(llama, ranks):
    value = ranks.export("vllm")
    assert re.fullmatch(r"\d+(,\d+)*", value)  # vLLM: comma-separated layer counts, one per PP rank
    counts = [int(c) for c in value.split(",")]
    assert len(counts) == 3 and sum(counts) == llama.config.num_hidden_layers
    stages = ranks.export("torchtitan")
    assert counts == [sum(bool(re.fullmatch(r"model\.layers\.\d+", n)) for n in part) for part in stages]


def test_pipeline_engines_refuse_a_plan_that_offloads(llama):
    offloading = automap.plan(llama, {"": "cpu", "model.layers.5": "disk"}, offload_dir="unused")
    for engine in ("vllm", "torchtitan", "split_spec"):
        with pytest.raises(PipelineError, match="plan_for_ranks"):
            offloading.export(engine)


# ------------------------------------------------------------------ llama.cpp


def apply_overrides(args: list[str], names: list[str]) -> dict[str, str]:
    """Where llama.cpp puts each GGUF tensor given ``args``: -ngl 0 keeps all on the CPU;
    otherwise the first -ot pattern found in the name (std::regex_search) gives its buffer,
    else the first GPU. Each -ot value must be llama.cpp's documented ``pattern=BUFFER``."""
    ngl = int(args[args.index("-ngl") + 1])
    overrides = []
    for i, arg in enumerate(args):
        if arg == "-ot":
            pattern, _, buffer = args[i + 1].rpartition("=")
            assert pattern and re.fullmatch(r"CPU|CUDA\d+", buffer), args[i + 1]
            overrides.append((re.compile(pattern), buffer))
    placed = {}
    for name in names:
        found = next((b for p, b in overrides if p.search(name)), None)
        placed[name] = found or ("CUDA0" if ngl > 0 else "CPU")
    return placed


def expected(plan: automap.Plan, arch: str) -> dict[str, str]:
    from automap.report.export import gguf_placement

    return gguf_placement(plan, arch)


@pytest.fixture(scope="module")
def moe():
    return tiny_moe("qwen2_moe", layers=4, hidden=64, experts=8, shared=32)


def test_llama_cpp_routed_experts_apart_per_tensor(moe):
    experts = {f"model.layers.{i}.mlp.experts": "cpu" for i in (1, 2, 3)}
    plan = automap.plan(moe, {"": 0, **experts}, max_memory={0: "1GB", "cpu": "1GB"})
    args = plan.export("llama.cpp", arch=moe.config.model_type)
    assert args[:2] == ["-ngl", "999"]
    assert args[2:] == ["-ot", r"blk\.(1|2|3)\.ffn_.*_exps\.=CPU"]
    wanted = expected(plan, moe.config.model_type)
    assert (
        "blk.1.ffn_gate_exps.weight" in wanted and "blk.1.ffn_up_exps.weight" in wanted
    )  # fused gate_up: two
    placed = apply_overrides(args, list(wanted))
    assert {n: d for n, d in placed.items() if not n.startswith("token_embd")} == {
        n: d for n, d in wanted.items() if not n.startswith("token_embd")
    }


@pytest.mark.parametrize(
    "where",
    [
        {"": 0, "model.layers.2": "cpu", "model.layers.3": "disk", "lm_head": "cpu"},
        {"": 1, "model.layers.0": 0, "model.layers.1": 0, "model.norm": "cpu"},
        {"": "cpu"},
    ],
    ids=["layers-off", "two-gpus", "cpu-only"],
)
def test_llama_cpp_places_every_gguf_tensor_where_the_plan_does(llama, where):
    plan = automap.plan(
        llama, where, max_memory={0: "1GB", 1: "1GB", "cpu": "1GB", "disk": "1GB"}, offload_dir="unused"
    )
    args = plan.export("llama.cpp", arch="llama")
    wanted = expected(plan, "llama")
    assert {"blk.0.attn_q.weight", "blk.5.ffn_down.weight", "output_norm.weight", "output.weight"} <= set(
        wanted
    )
    placed = apply_overrides(args, list(wanted))
    if not any(d != "CPU" for d in wanted.values()):
        assert args == ["-ngl", "0"]
    assert {n: d for n, d in placed.items() if not n.startswith("token_embd")} == {
        n: d for n, d in wanted.items() if not n.startswith("token_embd")
    }


def test_llama_cpp_refuses_an_architecture_it_does_not_name(llama):
    plan = automap.plan(llama, {"": "cpu"})
    with pytest.raises(PlanError, match="no architecture 'no-such-arch'"):
        plan.export("llama.cpp", arch="no-such-arch")


# ------------------------------------------------------------------ the command

LLAMA_SET = dict(
    num_hidden_layers=4,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
)
LLAMA = ["plan", "hf:llama", "--set", ",".join(f"{k}={v}" for k, v in LLAMA_SET.items()), "--quiet"]


def test_the_command_emits_llama_cpp_flags_for_the_models_architecture(capsys):
    assert main([*LLAMA, "--max-memory", "0=1GB,1=1GB", "--emit", "llama.cpp"]) == 0
    args = shlex.split(capsys.readouterr().out.strip())
    assert args[:2] == ["-ngl", "999"] and all(a == "-ot" or "=" in a for a in args[2:])


def test_the_command_emits_json_and_env_forms(capsys):
    assert main([*LLAMA, "--max-memory", "0=1GB,cpu=1GB", "--emit", "accelerate"]) == 0
    assert '"model.embed_tokens": 0' in capsys.readouterr().out
    assert main([*LLAMA, "--max-memory", "cpu=1GB", "--emit", "vllm"]) == 0
    assert capsys.readouterr().out.strip() == "VLLM_PP_LAYER_PARTITION=4"  # one stage, every layer
    llama = plan_spec("hf:llama", LLAMA_SET, max_memory={"cpu": "1GB"}).built.model
    cpu = beside_the_run(llama, 100_000)  # part on disk
    assert main([*LLAMA, "--max-memory", f"cpu={cpu},disk=1GB", "--emit", "vllm"]) == 1
    assert "plan_for_ranks" in capsys.readouterr().err
