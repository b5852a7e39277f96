"""automap.pipeline: micro-batched execution over a plan's stages is transparent (the plain
model's outputs and gradients), really overlaps stages, and refuses bad settings clearly.

Plans name hypothetical GPUs; ``devices=`` runs their stages on the CPU, as torchgpipe's tests
run "several devices" as ``['cpu', 'cpu']``."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import automap
from automap.errors import PipelineError
from automap.pipelining import (
    StageCost,
    best_chunks,
    chunk_sizes,
    chunks_for_split_size,
    pipeline_seconds,
    plan_stages,
    split_batch,
)
from automap.pipelining.cost import HANDOFF_SECONDS
from conftest import tiny_llama, weight_bytes
from tiny_configs import beside_the_run

ON_CPU = {"cuda:0": "cpu", "cuda:1": "cpu", "cuda:2": "cpu"}


class ToyModel(nn.Module):
    """The model-parallel tutorial's ToyModel, without its hard-coded devices."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def mlp_stack(blocks: int = 6, width: int = 32) -> nn.Sequential:
    """A BatchNorm-free stack: LayerNorm + Linear + GELU blocks, then a head."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [
        nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()) for _ in range(blocks)
    ]
    return nn.Sequential(*layers, nn.Linear(width, 3))


def _three_gpu_plan(model: nn.Module) -> automap.Plan:
    """A plan over three hypothetical GPUs, none of which holds half the model."""
    share = int(weight_bytes(model) * 0.45)
    return automap.plan(
        model, max_memory={0: share, 1: share, 2: share}, example_inputs=(torch.zeros(1, 32),)
    )


def _toy_plan(model: nn.Module) -> automap.Plan:
    return automap.plan(model, {"net1": 0, "net2": 1})


def _assert_transparent(
    model: nn.Module,
    plan: automap.Plan,
    x: torch.Tensor,
    chunks: int,
    devices: dict | None = None,
    **tolerance: float,
) -> None:
    """Outputs, parameter gradients and input gradients of pipe(x) equal model(x)'s (the plain
    model runs on CPU; ``devices`` maps the plan's devices to real ones, default all CPU)."""
    plain = copy.deepcopy(model)
    x_plain, x_pipe = x.clone().requires_grad_(), x.clone().requires_grad_()
    weights = torch.randn(plain(x).shape, generator=torch.Generator().manual_seed(3))
    expected = plain(x_plain)
    (expected * weights).sum().backward()
    pipe = automap.pipeline(model, plan, chunks=chunks, devices=devices or ON_CPU)
    try:
        got = pipe(x_pipe)
        (got * weights.to(got.device)).sum().backward()
    finally:
        pipe.close()
    torch.testing.assert_close(got.cpu(), expected, **tolerance)
    torch.testing.assert_close(x_pipe.grad, x_plain.grad, **tolerance)
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, **tolerance, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("batch", [8, 13])
@pytest.mark.parametrize("chunks", [1, 2, 4, 7])
def test_toy_model_is_transparent(chunks, batch):
    torch.manual_seed(0)
    model = ToyModel()
    plan = _toy_plan(model)
    assert [s.units for s in plan_stages(plan)] == [("net1",), ("net2",)]
    _assert_transparent(model, plan, torch.randn(batch, 10), chunks)


@pytest.mark.parametrize("batch", [8, 13])
@pytest.mark.parametrize("chunks", [1, 2, 4, 7])
def test_batchnorm_free_stack_is_transparent(chunks, batch):
    model = mlp_stack()
    x = torch.randn(batch, 32)
    plan = _three_gpu_plan(model)
    assert len(plan_stages(plan)) == 3, plan.report()
    _assert_transparent(model, plan, x, chunks)


def test_vision_transformer_is_transparent():
    from torchvision.models import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(
        image_size=32, patch_size=8, num_layers=4, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10
    )
    x = torch.randn(5, 3, 32, 32)
    plan = automap.plan(
        model,
        {
            "conv_proj": 0,
            "encoder.pos_embedding": 0,
            "class_token": 0,
            "encoder.layers.encoder_layer_0": 0,
            "encoder.layers.encoder_layer_1": 0,
            "encoder.layers.encoder_layer_2": 1,
            "encoder.layers.encoder_layer_3": 1,
            "encoder.ln": 1,
            "heads": 1,
        },
        example_inputs=(x,),
    )
    assert len(plan_stages(plan)) == 2
    _assert_transparent(model, plan, x, chunks=3)


def test_llama_keyword_inputs_and_model_output():
    model = tiny_llama(layers=4)
    ids = torch.randint(0, 256, (5, 9))
    first = ["model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1"]
    plan = automap.plan(
        model,
        {
            **dict.fromkeys(first, 0),
            **dict.fromkeys(["model.layers.2", "model.layers.3", "model.norm", "lm_head"], 1),
        },
    )
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
        pipe = automap.pipeline(model, plan, chunks=3, devices=ON_CPU)
        got = pipe(input_ids=ids, use_cache=False)
    pipe.close()
    assert len(pipe.stages) == 2
    torch.testing.assert_close(got.logits, expected)


def test_batchnorm_matches_in_eval_and_normalises_per_microbatch_in_training(caplog):
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(6, 3, 32, 32)
    plan = automap.plan(
        model,
        {"conv1": 0, "bn1": 0, "layer1": 0, "layer2": 0, "layer3": 1, "layer4": 1, "fc": 1},
        example_inputs=(x[:2],),
    )
    plain = copy.deepcopy(model)
    with caplog.at_level("WARNING", logger="automap.pipelining.runner"):
        pipe = automap.pipeline(model, plan, chunks=3, devices=ON_CPU)
    assert "BatchNorm" in caplog.text and "'bn1'" in caplog.text
    with torch.no_grad():
        torch.testing.assert_close(pipe.eval()(x), plain.eval()(x))
        trained, whole = pipe.train()(x), plain.train()(x)
    assert not torch.allclose(trained, whole, atol=1e-3), "training BatchNorm sees 2 samples, not 6"
    pipe.close()


def test_an_error_in_one_microbatch_reaches_the_caller_and_the_pipeline_recovers():
    class Picky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
            self.armed = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.a(x)
            if self.armed and threading.current_thread().name == "automap-microbatch-2":
                raise ValueError("micro-batch 2 failed between the stages")
            return self.b(y)

    model = Picky()
    pipe = automap.pipeline(model, automap.plan(model, {"a": 0, "b": 1}), chunks=4, devices=ON_CPU)
    model.armed = True
    with pytest.raises(ValueError, match="micro-batch 2 failed"):
        pipe(torch.zeros(8, 3))
    model.armed = False
    with torch.no_grad():
        torch.testing.assert_close(pipe(torch.ones(8, 3)), model(torch.ones(8, 3)))
    pipe.close()


def test_dispatched_model_pipelines_with_its_own_plan():
    model = mlp_stack()
    x = torch.randn(6, 32)
    with torch.no_grad():
        expected = model(x)
    everything = beside_the_run(model, weight_bytes(model), example_inputs=(x,))  # all in RAM
    automap.dispatch(model, max_memory={"cpu": everything}, example_inputs=(x,))
    pipe = automap.pipeline(model, chunks=3)
    with torch.no_grad():
        got = pipe(x)
    assert not got.requires_grad, "no_grad in the caller must hold in the workers"
    torch.testing.assert_close(got, expected)
    pipe.close()
    automap.undispatch(model)


# Kernels pick other algorithms for other batch sizes on GPUs: float32 rounding, no more.
GPU_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


@pytest.mark.cuda
@pytest.mark.parametrize("chunks", [1, 4, 7])
def test_one_gpu_and_cpu_stages_are_transparent(chunks):
    model = mlp_stack()
    plan = _three_gpu_plan(model)
    _assert_transparent(
        model,
        plan,
        torch.randn(13, 32),
        chunks,
        {"cuda:0": "cuda:0", "cuda:1": "cpu", "cuda:2": "cuda:0"},
        **GPU_TOLERANCE,
    )


@pytest.mark.multi_gpu
@pytest.mark.parametrize("chunks", [1, 2, 7])
def test_dispatched_on_two_gpus_is_transparent(chunks):
    model = mlp_stack()
    x = torch.randn(13, 32)
    plain = copy.deepcopy(model)
    expected = plain(x)
    expected.sum().backward()
    share = int(weight_bytes(model) * 0.6)
    automap.dispatch(model, max_memory={0: share, 1: share}, example_inputs=(torch.zeros(1, 32),))
    pipe = automap.pipeline(model, chunks=chunks)
    assert [str(d) for d in pipe.devices] == ["cuda:0", "cuda:1"]
    got = pipe(x)
    got.sum().backward()
    torch.testing.assert_close(got.cpu(), expected, **GPU_TOLERANCE)
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, **GPU_TOLERANCE, msg=lambda m: f"{name}: {m}")
    pipe.close()
    automap.undispatch(model)


class _Probe(nn.Module):
    """A Linear that records which micro-batch thread enters it and how many are inside at once."""

    def __init__(self, log: list, on_call=None) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.log, self.on_call, self.active, self.lock = log, on_call, 0, threading.Lock()
        self.armed = False  # off while automap.plan traces the model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.armed:
            return self.inner(x)
        with self.lock:
            self.active += 1
            self.log.append((self, threading.current_thread().name, self.active))
            calls = sum(1 for entry in self.log if entry[0] is self)
        if self.on_call is not None:
            self.on_call(calls)
        with self.lock:
            self.active -= 1
        return self.inner(x)


def test_stage_two_runs_microbatch_0_while_stage_one_runs_microbatch_1():
    log: list = []
    second_entered_stage_one = threading.Event()

    def stage_one(calls: int) -> None:
        if calls == 2:
            second_entered_stage_one.set()

    def stage_two(calls: int) -> None:
        # Without overlap micro-batch 1 cannot reach stage one until micro-batch 0 is done.
        if calls == 1 and not second_entered_stage_one.wait(timeout=60):
            raise AssertionError("stage 2 ran micro-batch 0 alone: the stages did not overlap")

    model = nn.Sequential(_Probe(log, stage_one), _Probe(log, stage_two))
    plan = automap.plan(model, {"0": 0, "1": 1})
    pipe = automap.pipeline(model, plan, chunks=4, devices=ON_CPU)
    for probe in model:
        probe.armed = True
    with torch.no_grad():
        pipe(torch.randn(8, 4))
    for probe in model:
        entries = [(name, active) for who, name, active in log if who is probe]
        assert [name for name, _ in entries] == [f"automap-microbatch-{i}" for i in range(4)], "in order"
        assert max(active for _, active in entries) == 1, "one micro-batch per stage at a time"


def test_close_removes_hooks_and_model_runs_plain():
    model = ToyModel()
    pipe = automap.pipeline(model, _toy_plan(model), chunks=2, devices=ON_CPU)
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == 2
    assert pipe.close() is model
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == 0
    with pytest.raises(PipelineError, match="closed"):
        pipe(torch.randn(2, 10))


# ------------------------------------------------------------------ chunks="auto"


def test_auto_chunks_is_the_argmin_of_the_cost_model():
    gpu = [StageCost(0.02, 0.002, "cuda:0", True), StageCost(0.02, 0.002, "cuda:1", True)]
    cpu = [StageCost(0.5, 0.01, "cpu:a"), StageCost(0.1, 0.01, "cpu:b")]
    for costs, batch in [(gpu, 120), (cpu, 32), (gpu[:1], 120)]:
        brute = min(range(1, batch + 1), key=lambda m: (pipeline_seconds(costs, m), m))
        assert best_chunks(costs, batch) == min(brute, 64)


def test_auto_chunks_follows_the_hardware():
    one_stage = [StageCost(1.0, 0.001, "cuda:0", True)]
    assert best_chunks(one_stage, 120) == 1, "one stage gains nothing from micro-batches"
    same_device = [StageCost(1.0, 0.001, "cpu"), StageCost(1.0, 0.001, "cpu")]
    assert best_chunks(same_device, 120) == 1, "stages on one device take turns: no overlap to win"
    tiny = [StageCost(1e-6, 1e-3, "cuda:0", True), StageCost(1e-6, 1e-3, "cuda:1", True)]
    assert best_chunks(tiny, 120) == 1, "fixed costs dominate tiny stages"
    assert best_chunks([StageCost(10.0, 0.0, "cuda:0", True), StageCost(10.0, 0.0, "cuda:1", True)], 5) == 5
    # Two equal GPU stages: micro-batches get smaller until they reach the launch-bound floor.
    t, fixed = 0.024, 0.0048
    gpus = [StageCost(t, fixed, "cuda:0", True), StageCost(t, fixed, "cuda:1", True)]
    assert best_chunks(gpus, 120) == round(t / fixed)
    assert pipeline_seconds(gpus, 5) == pytest.approx(6 * (fixed + HANDOFF_SECONDS))


def test_auto_chunks_pipeline_is_transparent():
    model = mlp_stack()
    x = torch.randn(12, 32)
    plan = _three_gpu_plan(model)
    with torch.no_grad():
        expected = model(x)
        pipe = automap.pipeline(model, plan, chunks="auto", devices=ON_CPU)
        got = pipe(x)
    assert 1 <= pipe.resolve_chunks((x,), {}) <= 12
    torch.testing.assert_close(got, expected)


def test_split_helpers():
    assert chunk_sizes(13, 4) == [4, 3, 3, 3]
    assert [a[0].shape[0] for a, _ in split_batch((torch.zeros(13, 2),), {}, 4)] == [4, 3, 3, 3]
    assert chunks_for_split_size(120, 12) == 10 and chunks_for_split_size(120, 50) == 3
    mask = torch.ones(1, 7)
    parts = split_batch((torch.zeros(6, 7),), {"mask": mask, "flag": True}, 3)
    assert all(k["mask"] is mask and k["flag"] is True for _, k in parts), "non-batch inputs go to every part"


# ------------------------------------------------------------------ bad input


def test_more_chunks_than_samples():
    model = ToyModel()
    pipe = automap.pipeline(model, _toy_plan(model), chunks=7, devices=ON_CPU)
    with pytest.raises(PipelineError, match=r"chunks=7 but the batch has only 5 sample\(s\).*chunks <= 5"):
        pipe(torch.randn(5, 10))
    pipe.close()


@pytest.mark.parametrize("chunks", [0, -2, 2.5, "many", True])
def test_bad_chunks(chunks):
    model = ToyModel()
    with pytest.raises(PipelineError, match="chunks must be a positive int or 'auto'"):
        automap.pipeline(model, _toy_plan(model), chunks=chunks, devices=ON_CPU)


def test_settings_that_cannot_work_are_refused(tmp_path):
    model = ToyModel()
    plan = _toy_plan(model)
    with pytest.raises(PipelineError, match=r"not dispatched.*automap.dispatch\(model, plan\).*devices="):
        automap.pipeline(model, plan)
    with pytest.raises(PipelineError, match=r"\['cuda:1'\]"):
        automap.pipeline(model, plan, devices={"cuda:0": "cpu"})
    pipe = automap.pipeline(model, plan, devices=ON_CPU)
    with pytest.raises(PipelineError, match="already pipelined"):
        automap.pipeline(model, plan, devices=ON_CPU)
    pipe.close()
    big = mlp_stack(width=64)
    offloaded = automap.plan(big, max_memory={"cpu": "40KB"}, example_inputs=(torch.zeros(1, 64),))
    automap.dispatch(big, offloaded, offload_dir=tmp_path)
    with pytest.raises(PipelineError, match="streams .* offloaded unit"):
        automap.pipeline(big)
    automap.undispatch(big)


def test_outputs_that_cannot_be_joined():
    class Scalar(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x)).mean()

    model = Scalar()
    pipe = automap.pipeline(model, automap.plan(model, {"a": 0, "b": 1}), chunks=2, devices=ON_CPU)
    with pytest.raises(PipelineError, match="scalar tensor"):
        pipe(torch.randn(4, 3))
    pipe.close()
