"""automap.distributed: a plan's stages handed to torch.distributed.pipelining, run for real in
two processes (gloo on CPU, loopback only) and compared with the same model in one process."""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.pipelining import SplitPoint

import automap
from automap.distributed import build_stage, make_schedule, plan_for_ranks, rank_stages, split_spec
from automap.errors import PipelineError
from conftest import tiny_llama

ROOT = Path(__file__).resolve().parents[2]
BATCH, SEQ, CHUNKS, LAYERS = 4, 12, 2, 2
# Gradients of a 1F1B step are the mean of per-micro-batch gradients, summed in another order
# than the whole batch's: float32 rounding only, far below this.
GRAD_ATOL, GRAD_RTOL = 1e-5, 1e-4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (BATCH, SEQ), generator=gen), torch.randint(
        0, 256, (BATCH, SEQ), generator=gen
    )


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _reference(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple:
    """The whole model in one process: logits, loss and gradients."""
    ref = copy.deepcopy(model)
    logits = ref(ids, use_cache=False).logits
    loss = _loss(logits, labels)
    loss.backward()
    return logits.detach(), loss.item(), {n: p.grad for n, p in ref.named_parameters()}


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = tiny_llama(layers=LAYERS)  # seeded: the same weights on every rank
        ids, labels = _inputs()
        plan = plan_for_ranks(model, world)
        ref_logits, ref_loss, ref_grads = _reference(model, ids, labels)
        model.config.use_cache = False  # a KV cache has no place in a traced training graph
        mine = build_stage(
            model, plan, (ids,), rank=rank, world_size=world, device="cpu", chunks=CHUNKS, schedule="gpipe"
        )
        result: dict = {"rank": rank, "units": list(rank_stages(plan)[rank].units)}
        with torch.no_grad():
            out = mine.schedule.step(ids) if mine.is_first else mine.schedule.step()
        if mine.is_last:
            result["forward_max_abs"] = (out - ref_logits).abs().max().item()
        train = make_schedule(mine.stage, "1f1b", CHUNKS, loss_fn=_loss)
        losses: list[torch.Tensor] = []
        train.step(ids) if mine.is_first else train.step(target=labels, losses=losses)
        if mine.is_last:
            result["loss"], result["ref_loss"] = torch.stack(losses).mean().item(), ref_loss
        result["grads"] = {
            n: [(p.grad - ref_grads[n]).abs().max().item(), ref_grads[n].abs().max().item()]
            for n, p in mine.module.named_parameters()
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ranks")
    mp.spawn(_rank_main, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_two_processes_gpipe_outputs_equal_one_process(two_ranks):
    first, last = two_ranks
    assert first["units"][0] == "model.embed_tokens" and last["units"][-1] == "lm_head"
    assert last["forward_max_abs"] <= 1e-5


def test_two_processes_1f1b_step_matches_gradients(two_ranks):
    model = tiny_llama(layers=LAYERS)
    names = {n for n, _ in model.named_parameters()}
    held = [set(r["grads"]) for r in two_ranks]
    assert held[0] and held[1] and not held[0] & held[1], "each rank holds its own parameters"
    assert held[0] | held[1] == names, "together the ranks hold the whole model"
    for rank in two_ranks:
        for name, (diff, scale) in rank["grads"].items():
            assert diff <= GRAD_ATOL + GRAD_RTOL * scale, f"rank {rank['rank']} {name}: |grad diff| {diff}"
    assert two_ranks[1]["loss"] == pytest.approx(two_ranks[1]["ref_loss"], rel=1e-5)


def test_split_spec_marks_each_later_stage_first_unit():
    model = tiny_llama(layers=6)
    plan = plan_for_ranks(model, 3)
    stages = rank_stages(plan, 3)
    assert split_spec(plan) == {
        stages[1].units[0]: SplitPoint.BEGINNING,
        stages[2].units[0]: SplitPoint.BEGINNING,
    }
    assert [s.device for s in stages] == ["cuda:0", "cuda:1", "cuda:2"]
    assert sum(len(s.units) for s in stages) == len(plan.units)


def test_stage_count_must_match_ranks():
    model = tiny_llama(layers=4)
    plan = plan_for_ranks(model, 2)
    ids, _ = _inputs()
    with pytest.raises(
        PipelineError, match=r"2 stage\(s\).*3 rank\(s\).*plan_for_ranks\(model, world_size=3\)"
    ):
        build_stage(model, plan, (ids,), rank=0, world_size=3, device="cpu", chunks=2)
    with pytest.raises(PipelineError, match="unknown schedule 'zigzag'"):
        build_stage(model, plan, (ids,), rank=0, world_size=2, device="cpu", chunks=2, schedule="zigzag")


def test_more_ranks_than_units_is_an_error():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with pytest.raises(PipelineError, match="2 placement unit"):
        plan_for_ranks(model, 3, example_inputs=(torch.zeros(1, 4),))


def test_offloaded_plan_is_refused():
    model = tiny_llama(layers=2)
    plan = automap.plan(model, {"model": 0, "lm_head": "cpu"})  # lm_head streamed to cuda:0
    assert plan.offloaded_units == ("lm_head",)
    with pytest.raises(PipelineError, match="offloads .* unit"):
        split_spec(plan)


@pytest.mark.slow
def test_example_runs_under_torchrun(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [
        str(torchrun),
        "--nproc-per-node",
        "2",
        "--master-port",
        str(_free_port()),
        str(ROOT / "examples" / "pipeline_torchrun.py"),
        "--steps",
        "2",
        "--check",
    ]
    done = subprocess.run(
        cmd,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "matches one process" in done.stderr
