"""Resident paths without overhead, shown on a CPU: a fake accelerator kind whose memory is CPU
memory and whose :class:`~automap.offload.DeviceOps` are :class:`fake_streams.FakeOps` (CUDA's
stream rules, every host synchronisation counted). A model whose units all stay on one such
device, or on two with nothing streamed, runs with no host synchronisation of automap's own
(none through the ops, and the aten ops that make a GPU's host wait run as often as in the plain
model), gives the plain model's outputs exactly, and carries no hook between units that share
a device where the model's code says what each one is given (an ``nn.Sequential``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import automap
from automap.kinds import DeviceKind, register_kind, unregister_kind
from automap.runtime import state_of
from conftest import tiny_gpt2, tiny_llama
from fake_streams import FakeOps, HostSyncs

MADE: list[FakeOps] = []  # every FakeOps the fake kind handed out (a transfer to it would make one)


def fake_ops(device: torch.device) -> FakeOps:
    MADE.append(FakeOps())
    return MADE[-1]


FAKE_GPU = DeviceKind(
    "fakegpu",
    rank=1,
    computes=True,
    is_storage=False,
    host_addressable=False,
    async_copies=True,
    flops_per_second=50e12,
    link_bytes_per_second=25e9,
    memory_bytes_per_second=1e12,
    overlaps=True,
    indexed=True,
    count=lambda: 2,
    torch_device=lambda name: torch.device("cpu"),
    ops=fake_ops,
)


@pytest.fixture(autouse=True)
def fake_gpu():
    register_kind(FAKE_GPU)
    MADE.clear()
    yield
    unregister_kind(FAKE_GPU.name)


def sequential() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(32, 32), nn.GELU())]).eval()


def inputs_of(model: nn.Module) -> torch.Tensor:
    if isinstance(model, nn.Sequential):
        return torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    return torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))


def output_of(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, int]]:
    """The model's output for ``x`` and the host-synchronising aten ops its forward ran."""
    with torch.no_grad(), HostSyncs() as syncs:
        out = model(x)
    return getattr(out, "logits", out), syncs.ops


def split_map(model: nn.Module, devices: tuple[str, ...]) -> dict[str, str]:
    """The model's units in order, in runs of about equal length, one run per device."""
    units = [u.name for u in automap.plan(model, max_memory={"cpu": "1GiB", "disk": 0}).units]
    return {u: devices[i * len(devices) // len(units)] for i, u in enumerate(units)}


def hooked(model: nn.Module) -> list[str]:
    """The modules that run a forward hook of automap's (pre or post)."""
    return [n for n, m in model.named_modules() if m._forward_pre_hooks or m._forward_hooks]


def host_syncs_through_the_ops() -> int:
    return sum(ops.syncs for ops in MADE)


BUILDS = {
    "llama": lambda: tiny_llama(layers=4),
    "gpt2": lambda: tiny_gpt2(layers=4),
    "sequential": sequential,
}


@pytest.mark.parametrize("build", list(BUILDS))
def test_one_resident_device_has_no_hook_and_no_host_sync(build):
    model = BUILDS[build]()
    x = inputs_of(model)
    expected, plain_syncs = output_of(copy.deepcopy(model), x)
    automap.dispatch(model, split_map(model, ("fakegpu:0",)))
    got, syncs = output_of(model, x)
    assert torch.equal(got, expected)
    assert state_of(model).transfer is None and not MADE, "nothing streams: no transfer, no stream ops"
    assert host_syncs_through_the_ops() == 0
    assert syncs == plain_syncs, "automap's runtime adds no host-synchronising op of its own"
    assert hooked(model) == [], "one device, nothing moves: no hook on the model or any unit"
    automap.undispatch(model)


@pytest.mark.parametrize("build", ["llama", "gpt2"])
def test_greedy_generate_on_one_resident_device_matches_without_host_syncs(build):
    model = BUILDS[build]()
    plain = copy.deepcopy(model)
    ids = torch.randint(1, 256, (1, 5), generator=torch.Generator().manual_seed(2))
    options = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    with HostSyncs() as plain_syncs:
        expected = plain.generate(ids, attention_mask=torch.ones_like(ids), **options)
    automap.dispatch(model, split_map(model, ("fakegpu:0",)))
    with HostSyncs() as syncs:
        got = model.generate(ids, attention_mask=torch.ones_like(ids), **options)
    assert torch.equal(got, expected)
    assert syncs.ops == plain_syncs.ops and host_syncs_through_the_ops() == 0 and not MADE
    automap.undispatch(model)


@pytest.mark.parametrize("build", list(BUILDS))
def test_two_devices_where_nothing_streams_issue_no_host_sync(build):
    model = BUILDS[build]()
    x = inputs_of(model)
    expected, plain_syncs = output_of(copy.deepcopy(model), x)
    device_map = split_map(model, ("fakegpu:0", "fakegpu:1"))
    assert set(device_map.values()) == {"fakegpu:0", "fakegpu:1"}
    automap.dispatch(model, device_map)
    got, syncs = output_of(model, x)
    assert torch.equal(got, expected)
    assert state_of(model).transfer is None and host_syncs_through_the_ops() == 0
    assert syncs == plain_syncs
    automap.undispatch(model)
    assert hooked(model) == []


def test_a_sequential_on_two_devices_is_hooked_only_where_its_device_changes():
    """Each unit of an ``nn.Sequential`` is given the output of the one before (the GELUs
    between hold no tensors and compute where their inputs are): the first unit on each device
    moves what it is given, the others on that device need no hook."""
    model = sequential()
    x = inputs_of(model)
    expected, _ = output_of(copy.deepcopy(model), x)
    device_map = {"0": "fakegpu:0", "2": "fakegpu:0", "4": "fakegpu:0", "6": "fakegpu:1", "8": "fakegpu:1"}
    device_map["10"] = "fakegpu:1"
    automap.dispatch(model, device_map)
    assert hooked(model) == ["", "0", "6"], "the model's own hook, and one where each device's run starts"
    assert torch.equal(output_of(model, x)[0], expected)
    automap.undispatch(model)
    assert hooked(model) == []


class CalledTwice(nn.Module):
    """A ``Sequential`` whose last unit the model also calls on its own, with other inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.body = sequential()
        self.side = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + self.body[10](self.side(x))


def test_a_unit_the_trace_saw_called_twice_keeps_its_hook():
    model = CalledTwice().eval()
    x = inputs_of(model.body)
    expected, _ = output_of(copy.deepcopy(model), x)
    device_map = {f"body.{i}": "fakegpu:0" if i < 6 else "fakegpu:1" for i in range(0, 12, 2)}
    plan = automap.plan(model, {**device_map, "side": "fakegpu:0"}, example_inputs=(x,))
    assert next(u.calls for u in plan.units if u.name == "body.10") == 2
    automap.dispatch(model, plan)
    assert "body.10" in hooked(model), "its second call's inputs come from elsewhere"
    assert torch.equal(output_of(model, x)[0], expected)
    automap.undispatch(model)


def test_the_counter_sees_the_ops_that_make_a_gpus_host_wait():
    x = torch.tensor([0.0, 2.0, 3.0])
    with HostSyncs() as syncs:
        x.sum().item()
        bool(x[1] > 0)
        x.nonzero()
        x + 1  # queued, no wait
    assert syncs.ops == {"_local_scalar_dense": 2, "nonzero": 1}
