"""torch.compile on dispatched models, graph breaks counted with ``torch._dynamo.explain``:
resident units with hooks compile into one graph; units streamed from disk on CPU execution too
(their weights are the views the parameters hold; the files are still checked before each
forward); where weights are swapped in for a unit (the accelerator path, run on the CPU through
``HostCopyOps``) the graph breaks only at the streamed units' hooks — never inside a unit, at
most once per hooked unit boundary. Compiled outputs equal the eager model's.

Compiling is slow on a 2-core CPU: tiny models, few tests."""

from __future__ import annotations

import os

import pytest
import torch

import automap
from automap.errors import OffloadError
from automap.offload import HostCopyOps, StagedTransfer
from automap.runtime import dispatch_plan, state_of
from conftest import assert_offloaded_in_files, file_backing, logits_of, tiny_gpt2, tiny_llama, weight_bytes
from tiny_configs import beside_the_run

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(7))


def hooked_units(model: torch.nn.Module) -> int:
    """Modules automap hooked before their forward: the unit boundaries a graph may break at."""
    return sum(1 for module in model.modules() if module._forward_pre_hooks)


def explain(model: torch.nn.Module, ids: torch.Tensor):
    with torch.no_grad():
        return torch._dynamo.explain(model)(ids)


def test_resident_units_with_hooks_compile_without_a_graph_break():
    model = tiny_llama(layers=2)
    expected = logits_of(model, _ids())
    plan = automap.plan(model, max_memory={"cpu": "1GB"})
    dispatch_plan(model, plan, always_hook=True)  # an input-moving hook on every unit, as across devices
    assert (
        hooked_units(model) == len(plan.units) + 1
    )  # and the model itself (forwards in flight, for undispatch)
    explained = explain(model, _ids())
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    assert torch.equal(logits_of(torch.compile(model, backend="aot_eager"), _ids()), expected)


def test_units_streamed_on_cpu_compile_whole_and_their_files_are_still_checked(tmp_path):
    model = tiny_llama(layers=2)
    ids = _ids()
    expected = logits_of(model, ids)
    half = beside_the_run(model, weight_bytes(model) // 2)
    automap.dispatch(model, max_memory={"cpu": half}, offload_dir=tmp_path)
    assert len(state_of(model).groups) >= 2
    explained = explain(model, ids)
    assert explained.graph_break_count <= hooked_units(model)
    assert explained.graph_count == 1, explained.break_reasons  # nothing moves: the forward compiles whole
    compiled = torch.compile(model)  # inductor
    for _ in range(2):
        torch.testing.assert_close(logits_of(compiled, ids), expected, rtol=1e-5, atol=1e-5)
    assert_offloaded_in_files(model, under=tmp_path)  # still views of the store, not copies
    os.truncate(file_backing(model.model.layers[-1].mlp.up_proj.weight), 100)
    for fn in (compiled, torch.compile(model.forward, backend="eager")):  # however it was compiled
        with pytest.raises(OffloadError, match="truncated"):
            logits_of(fn, ids)


def test_swapped_in_weights_compile_and_go_back_home(tmp_path):
    model = tiny_gpt2(layers=2)
    ids = _ids()
    expected = logits_of(model, ids)
    device_map = {
        "transformer.wte": "cpu",
        "transformer.wpe": "cpu",
        "transformer.drop": "cpu",
        "transformer.h.0": "disk",
        "transformer.h.1": "cpu",
        "transformer.ln_f": "cpu",
        "lm_head": "disk",
    }
    plan = automap.plan(model, device_map)
    dispatch_plan(
        model, plan, offload_dir=tmp_path, transfer=lambda source, *_: StagedTransfer(source, HostCopyOps())
    )
    explained = explain(model, ids)
    assert 0 < explained.graph_break_count <= hooked_units(model)
    for reason in explained.break_reasons:  # every break is at the call of a streamed unit's hook body
        innermost = reason.user_stack[-1]
        assert innermost.filename.endswith(os.path.join("automap", "runtime", "streaming.py")), reason.reason
        assert innermost.name in ("pre", "post"), reason.reason
    compiled = torch.compile(model, backend="aot_eager")
    for _ in range(2):
        assert torch.equal(logits_of(compiled, ids), expected)
    assert_offloaded_in_files(model, under=tmp_path)  # every swapped-in copy went back to its home
    assert all(item.users == 0 for group in state_of(model).groups for item in group.items)
