"""The registry of device kinds (:mod:`automap.kinds`): a new kind is one registration plus its
classes, and the built-in accelerators get a transfer that lands weights on their own device.

The fake kinds here are registered from this file alone: an accelerator whose memory is CPU
memory (its weights arrive through its own :class:`DeviceOps`, which copy into fresh tensors),
and a storage tier whose weight source keeps each tensor as a private byte copy. Planned and
dispatched with them, a real model gives the plain model's outputs."""

from __future__ import annotations

from typing import Collection, Iterable, Mapping, Sequence

import pytest
import torch

import automap
from automap.devices import canonical_name, check_present, make_device
from automap.errors import DeviceError
from automap.kinds import DeviceKind, kind_of, register_kind, unregister_kind
from automap.offload import (
    CudaOps,
    DeviceCopyOps,
    HostCopyOps,
    PageTransfer,
    RamSource,
    SourceStats,
    StagedTransfer,
    make_transfer,
)
from automap.runtime import state_of
from conftest import ids_and_logits, logits_of, tiny_llama, weight_bytes


class CopyCountingOps(HostCopyOps):
    """The fake accelerator's ops: every weight is copied into a tensor of its own (its
    "device memory" is CPU memory), and the copies are counted."""

    def __init__(self, device: torch.device):
        self.device = device
        self.copied_bytes = 0

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)
        self.copied_bytes += src.nbytes


class BytesSource:
    """The fake storage tier's weight source: each tensor kept as a byte copy of its own, and
    rebuilt (once) as a CPU tensor with its true dtype and shape."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self._bytes = {
            n: (bytes(t.detach().contiguous().view(-1).view(torch.uint8).numpy()), t.dtype, t.shape)
            for n, t in tensors.items()
        }
        self._built: dict[str, torch.Tensor] = {}

    def names(self) -> Collection[str]:
        return self._bytes.keys()

    def get(self, name: str) -> torch.Tensor:
        if name not in self._built:
            raw, dtype, shape = self._bytes[name]
            self._built[name] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).view(shape)
        return self._built[name]

    def prefetch(self, names: Sequence[str], populate: bool = True) -> None:
        return None

    def check_unchanged(self, names: Iterable[str]) -> None:
        return None

    def stats(self) -> SourceStats:
        return SourceStats(ram_bytes=sum(len(raw) for raw, _, _ in self._bytes.values()))

    def close(self, discard: bool = False) -> None:
        self._bytes, self._built = {}, {}


def bytes_source(tensors, groups, offload_dir, execution) -> BytesSource:
    return BytesSource({n: tensors[n].data for n in groups})


FAKE_ACCELERATOR = DeviceKind(
    "fakeacc",
    rank=1,
    computes=True,
    is_storage=False,
    host_addressable=False,
    async_copies=False,
    flops_per_second=50e12,
    link_bytes_per_second=25e9,
    memory_bytes_per_second=1e12,
    indexed=True,
    count=lambda: 2,
    torch_device=lambda name: torch.device("cpu"),
    ops=CopyCountingOps,
)
FAKE_TIER = DeviceKind(
    "fakestore",
    rank=5,
    computes=False,
    is_storage=True,
    host_addressable=True,
    async_copies=False,
    flops_per_second=0.0,
    link_bytes_per_second=5e9,
    memory_bytes_per_second=5e9,
    source=bytes_source,
)


@pytest.fixture
def fake_kinds():
    for kind in (FAKE_ACCELERATOR, FAKE_TIER):
        register_kind(kind)
    yield
    for kind in (FAKE_ACCELERATOR, FAKE_TIER):
        unregister_kind(kind.name)


def test_a_registered_accelerator_and_tier_plan_and_dispatch_transparently(fake_kinds, tmp_path):
    model = tiny_llama(layers=4)
    ids, expected = ids_and_logits(model, (2, 9))
    budget = {"fakeacc:0": weight_bytes(model) // 2, "fakestore": "1GiB", "disk": 0}
    plan = automap.plan(model, "auto", budget, example_inputs=(ids,))
    assert plan.execution_device == "fakeacc:0"
    assert set(plan.used_devices) == {"fakeacc:0", "fakestore"}
    assert plan.offloaded_units and all(plan.device_of(u) == "fakestore" for u in plan.offloaded_units)
    automap.dispatch(model, plan)
    state = state_of(model)
    assert isinstance(state.transfer, StagedTransfer) and isinstance(state.transfer.ops, CopyCountingOps)
    assert isinstance(state.source, BytesSource)
    assert torch.equal(logits_of(model, ids), expected)
    assert state.transfer.ops.copied_bytes > 0, "the offloaded weights came through the kind's own ops"
    automap.undispatch(model)
    assert torch.equal(logits_of(model, ids), expected)


def test_a_registered_kind_has_names_speeds_and_a_presence_check(fake_kinds):
    assert canonical_name("FakeAcc") == "fakeacc:0"
    device = make_device("fakeacc:1", 1000)
    assert device.is_accelerator and device.flops_per_second == 50e12 and device.map_value == "fakeacc:1"
    assert device.sort_key() < make_device("cpu", 0).sort_key() < make_device("fakestore", 0).sort_key()
    check_present("fakeacc:1")
    with pytest.raises(DeviceError, match="has 2 fakeacc device"):
        check_present("fakeacc:2")
    with pytest.raises(DeviceError, match="registered already"):
        register_kind(FAKE_TIER)


def test_an_unregistered_kind_is_unknown():
    with pytest.raises(DeviceError, match="unknown device 'fakeacc:0'"):
        canonical_name("fakeacc:0")
    with pytest.raises(DeviceError, match="unknown device kind 'fakestore'"):
        kind_of("fakestore")


@pytest.mark.parametrize(
    "device", [torch.device("xpu", 0), torch.device("xpu", 1), torch.device("mps"), "xpu:0", "mps"]
)
def test_xpu_and_mps_get_a_transfer_that_lands_weights_on_their_device(device):
    """Before the registry, xpu and mps got the CPU's page transfer: the weights stayed on the
    CPU while the inputs went to the accelerator."""
    transfer = make_transfer(RamSource({}), device)
    assert isinstance(transfer, StagedTransfer) and transfer.swaps
    assert isinstance(transfer.ops, DeviceCopyOps)
    assert transfer.ops.device == torch.device(device)
    transfer.close()


def test_device_copy_ops_allocate_on_their_device():
    """What DeviceCopyOps gives the staged transfer to copy into lives on its device (meta
    stands in for hardware this machine lacks)."""
    ops = DeviceCopyOps(torch.device("meta"))
    assert ops.empty(torch.Size([2, 3]), torch.float16).device == torch.device("meta")
    ops = DeviceCopyOps(torch.device("cpu"))
    out = ops.empty(torch.Size([4]), torch.float32)
    ops.copy(out, torch.arange(4.0))
    assert torch.equal(out, torch.arange(4.0))


def test_cuda_gets_streams_and_the_cpu_its_pages():
    assert isinstance(make_transfer(RamSource({}), torch.device("cpu")), PageTransfer)
    assert kind_of(torch.device("cuda", 0)).factory("ops") is CudaOps
    assert kind_of("cuda:3").async_copies and not kind_of("xpu:0").async_copies
