"""The registry of device kinds: every rule about a kind of device or storage tier lives in its
:class:`DeviceKind` entry, and code elsewhere asks the entry instead of comparing names.

Invariants: this module names nothing above it and imports no torch at import time; the
factories of the built-in kinds (ops, weight sources) are attached by the modules that define
them (:func:`attach`).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Union

from automap.errors import DeviceError

if TYPE_CHECKING:
    import torch

Factory = Union[Callable[..., Any], str, None]


@dataclass(frozen=True)
class DeviceKind:
    """One kind of device or storage tier and every rule about it.

    Attributes:
        name: the kind, as device names start: ``"cuda"`` in ``"cuda:0"``.
        rank: order among kinds in a device list, fastest tier first.
        computes: units can run here (an accelerator or the host CPU).
        is_storage: offloaded weights can be kept here and streamed to the execution device.
        host_addressable: its tensors are host memory the CPU reads in place (no copy).
        async_copies: host-to-device copies run on a side stream from pinned host memory, so
            streaming overlaps compute (and host RAM offloaded to it is pinned).
        flops_per_second, link_bytes_per_second, memory_bytes_per_second: default speeds for
            the cost model (see :mod:`automap.devices`).
        overlaps: in the cost model, a step's compute, memory reads and streamed weights
            overlap here (an accelerator's copy engines run beside its kernels); else they add.
        indexed: names carry an index (``cuda:0``); a bare ``cuda`` means index 0.
        index_alias: an unindexed kind whose ``name:N`` is read as the kind itself (``mps:0``).
        integer_keys: a bare integer device key (``0``) names this kind, and device maps write
            its devices as that integer (the Hugging Face format).
        staged_via_host: a storage tier whose streamed weights pass through a pinned staging
            buffer in host RAM on their way to an accelerator (the planner keeps room for it).
        detect: ``() -> {name: free bytes}`` of the devices of this kind on this machine.
        count: ``() -> int``, how many exist here; None: always present (CPU RAM, disk).
        synchronize: ``(torch.device) -> None``, wait for the work queued there (timing).
        torch_module: the torch submodule of the kind (``"cuda"`` for ``torch.cuda``), which has
            ``current_device`` where the kind is indexed.
        compute_streams: the pipeline runs each device's stages on a compute stream of its own
            (``torch_module``'s ``Stream``, ``current_stream``, ``set_stream``).
        torch_device: ``(name) -> torch.device`` where tensors of the device ``name`` live;
            None: ``torch.device(name)`` (a kind that is not a torch device type maps its
            names here, a fake accelerator backed by CPU memory, say).
        ops: ``(torch.device) -> DeviceOps`` for staged copies into this kind when it executes;
            None: the weights are used where they are (host memory, prefetched pages).
        source: ``(tensors, groups, offload_dir, execution) -> WeightSource`` for a storage
            tier: holds the tensors ``groups`` names (tensor name -> unit name) for the
            execution device named ``execution``.
        runtime_base_bytes, runtime_share: the runtime's own memory where the kind computes,
            beyond weights, cache and activations: ``runtime_base_bytes + runtime_share x`` the
            activation peak (the allocator's slack and the kernels' scratch space; measured by
            ``benchmarks/fit.py``, see :mod:`automap.planning.memory`).
        read_ahead: offloaded units whose weights are read while earlier units compute on this
            kind (its transfer's ``lookahead``): the forward's predicted time overlaps them.
    """

    name: str
    rank: int
    computes: bool
    is_storage: bool
    host_addressable: bool
    async_copies: bool
    flops_per_second: float
    link_bytes_per_second: float
    memory_bytes_per_second: float
    overlaps: bool = False
    indexed: bool = False
    index_alias: bool = False
    integer_keys: bool = False
    staged_via_host: bool = False
    detect: Factory = None
    count: Factory = None
    synchronize: Factory = None
    torch_module: str | None = None
    compute_streams: bool = False
    torch_device: Factory = None
    ops: Factory = None
    source: Factory = None
    transfer: Factory = None  # a kind computing on host memory: its transfer from a weight source
    runtime_base_bytes: int = 0
    runtime_share: float = 0.0
    read_ahead: int = 1

    @property
    def is_accelerator(self) -> bool:
        """Computes in memory of its own: offloaded weights are copied in before use."""
        return self.computes and not self.host_addressable

    @property
    def is_host(self) -> bool:
        """The host CPU: computes, and its memory is where offloaded weights are staged."""
        return self.computes and self.host_addressable

    @property
    def stores_only(self) -> bool:
        """A storage tier that never computes (disk): its units always stream."""
        return self.is_storage and not self.computes

    def factory(self, field_name: str) -> Callable[..., Any] | None:
        """The callable in ``field_name``, resolving a ``"module:attribute"`` reference."""
        value = getattr(self, field_name)
        if isinstance(value, str):
            module, _, attribute = value.partition(":")
            value = getattr(importlib.import_module(module), attribute)
        return value

    def torch_api(self) -> Any:
        """The torch submodule of this kind (``torch.cuda``); None for a kind without one."""
        if self.torch_module is None:
            return None
        import torch

        return getattr(torch, self.torch_module)

    def present_count(self) -> int | None:
        """How many devices of this kind this machine has; None when it always has one."""
        count = self.factory("count")
        return None if count is None else int(count())


_REGISTRY: dict[str, DeviceKind] = {}
FACTORY_FIELDS = frozenset({"detect", "count", "synchronize", "torch_device", "ops", "source", "transfer"})


def register_kind(kind: DeviceKind, *, replace: bool = False) -> DeviceKind:
    """Add ``kind`` to the registry, so that its names parse, plans use it and dispatch runs it.

    Raises:
        DeviceError: a kind of that name exists (pass ``replace=True`` to redefine it), or the
            name is not a lowercase word.

    Example:
        >>> register_kind(DeviceKind("npu", rank=2, computes=True, is_storage=False,
        ...               host_addressable=False, async_copies=False, flops_per_second=50e12,
        ...               link_bytes_per_second=25e9, memory_bytes_per_second=1e12, indexed=True,
        ...               count=count_npus, ops=NpuOps))
    """
    if not kind.name.isalpha() or not kind.name.islower() or kind.name == "meta":
        raise DeviceError(f"a device kind is named by a lowercase word other than 'meta', got {kind.name!r}")
    if kind.name in _REGISTRY and not replace:
        raise DeviceError(
            f"device kind {kind.name!r} is registered already; pass replace=True to redefine it"
        )
    _REGISTRY[kind.name] = kind
    return kind


def attach(name: str, **factories: Factory) -> None:
    """Give the registered kind ``name`` the factories a module above this one defines (its
    ``ops``, a storage tier's ``source``): the module that defines them attaches them when it is
    imported, so this registry never names a module above it (ggml's backends register into
    their registry the same way).

    Raises:
        DeviceError: no kind is called ``name``, or a field is not one of its factories.
    """
    kind = _REGISTRY.get(name)
    if kind is None:
        raise DeviceError(f"no device kind {name!r} to attach {sorted(factories)} to")
    unknown = sorted(set(factories) - FACTORY_FIELDS)
    if unknown:
        raise DeviceError(f"{unknown} are not factories of a device kind; they are {sorted(FACTORY_FIELDS)}")
    _REGISTRY[name] = dataclasses.replace(kind, **factories)


def unregister_kind(name: str) -> None:
    """Remove a registered kind (a test's fake one, say); unknown names are ignored."""
    _REGISTRY.pop(name, None)


def registered_kinds() -> tuple[DeviceKind, ...]:
    """Every registered kind, fastest tier first."""
    return tuple(sorted(_REGISTRY.values(), key=lambda k: (k.rank, k.name)))


def find_kind(name: str) -> DeviceKind | None:
    """The kind called ``name`` (``"cuda"``, not ``"cuda:0"``), or None."""
    return _REGISTRY.get(name)


def kind_of(device: Any) -> DeviceKind:
    """The kind of a device: a :class:`~automap.devices.DeviceSpec`, a ``torch.device`` or a
    device name (``"cuda:0"``, ``"disk"``).

    Raises:
        DeviceError: no registered kind has that name (``meta`` included: it holds no data).
    """
    name = getattr(device, "kind", None) or getattr(device, "type", None) or str(device).split(":")[0]
    kind = _REGISTRY.get(name)
    if kind is None:
        raise DeviceError(
            f"unknown device kind {name!r}; the kinds are {[k.name for k in registered_kinds()]}"
        )
    return kind


def on_host(device: torch.device) -> bool:
    """True when a tensor on ``device`` is host memory (False for meta and for accelerators)."""
    kind = _REGISTRY.get(device.type)
    return kind is not None and kind.host_addressable


def default_memory_bandwidth(name: str) -> float:
    """The memory bandwidth (bytes/s) the kind ``name`` assumes by default; 0 for an unknown one."""
    kind = _REGISTRY.get(name)
    return kind.memory_bytes_per_second if kind is not None else 0.0


def torch_device(name: str) -> torch.device:
    """The torch device holding the tensors of the device ``name`` (``"cuda:0"``), as its kind says."""
    make = kind_of(name).factory("torch_device")
    if make is not None:
        return make(name)
    import torch

    return torch.device(name)


def is_host_name(name: str) -> bool:
    """True when the device named ``name`` is the host CPU; False for ``""`` (none chosen)."""
    return bool(name) and kind_of(name).is_host


def integer_kind() -> DeviceKind:
    """The kind a bare integer device key (``0``) names."""
    return next(k for k in registered_kinds() if k.integer_keys)


# ---------------------------------------------------------------------- the built-in kinds
# Speeds are deliberately round numbers (see automap.devices): sustained FLOP/s, the link that
# feeds the device, its own memory (HBM of a data-centre GPU, dual-channel DDR).

# Share of an accelerator's total memory a fresh process can count on (the context, the caching
# allocator's fragmentation and workspaces take the rest).
FRESH_ACCELERATOR_SHARE = 0.9


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _xpu_count() -> int:
    import torch

    return torch.xpu.device_count() if hasattr(torch, "xpu") and torch.xpu.is_available() else 0


def _mps_count() -> int:
    import torch

    return 1 if torch.backends.mps.is_available() else 0


def _cuda_budget(index: int) -> int:
    """Free memory of one GPU: measured when CUDA is already initialised (mem_get_info needs
    a context, and creating one would cost this process ~300 MiB on every GPU), else a share
    of the total from the device properties."""
    import torch

    if torch.cuda.is_initialized():
        free, _ = torch.cuda.mem_get_info(index)
        return int(free * FRESH_ACCELERATOR_SHARE)
    return int(torch.cuda.get_device_properties(index).total_memory * FRESH_ACCELERATOR_SHARE)


def _detect_cuda() -> dict[str, int]:
    return {f"cuda:{i}": _cuda_budget(i) for i in range(_cuda_count())}


def _detect_xpu() -> dict[str, int]:
    import torch

    return {
        f"xpu:{i}": int(torch.xpu.get_device_properties(i).total_memory * FRESH_ACCELERATOR_SHARE)
        for i in range(_xpu_count())
    }


def _detect_mps() -> dict[str, int]:
    return {"mps": int(available_ram_bytes() * 0.7)} if _mps_count() else {}


def _sync_cuda(device: torch.device) -> None:
    import torch

    torch.cuda.synchronize(device)


def _sync_xpu(device: torch.device) -> None:
    import torch

    torch.xpu.synchronize(device)


def _sync_mps(device: torch.device) -> None:
    import torch

    torch.mps.synchronize()


def available_ram_bytes() -> int:
    """Memory this process can still use without swapping (``MemAvailable``)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil

    return int(psutil.virtual_memory().available)


_ACCELERATOR = dict(computes=True, is_storage=False, host_addressable=False, overlaps=True)
# The CPU's runtime overhead where it computes (benchmarks/fit.py, notes/fit.md): 12 MiB of
# automap's and Python's own state after a load or dispatch (the plan, the skeleton's objects,
# hooks) and 10 MiB that oneDNN/MKL allocate at their first matmul; glibc keeps freed
# activation blocks in its arenas (its mmap threshold rises to the largest block freed), about
# 0.9 times the activation peak more at the run's peak (0.5-1.4 measured). The base is planned at
# 26 MiB, the top of its measured spread (22 +- 4 MiB over 27 runs), not its middle, and the
# share at 1.0: a plan that fills a budget to the byte must stay under it when the run lands
# high (ResNet-50 at 50 %, its budget filled to 99 %, once needed 0.96 beside another case's run).
_CPU_RUNTIME = dict(runtime_base_bytes=26 * 2**20, runtime_share=1.0)
register_kind(
    DeviceKind(
        "cuda",
        0,
        **_ACCELERATOR,
        async_copies=True,
        flops_per_second=100e12,
        link_bytes_per_second=25e9,
        memory_bytes_per_second=2e12,
        indexed=True,
        integer_keys=True,
        detect=_detect_cuda,
        count=_cuda_count,
        synchronize=_sync_cuda,
        torch_module="cuda",
        compute_streams=True,
    )
)
register_kind(
    DeviceKind(
        "xpu",
        1,
        **_ACCELERATOR,
        async_copies=False,
        flops_per_second=50e12,
        link_bytes_per_second=25e9,
        memory_bytes_per_second=1e12,
        indexed=True,
        detect=_detect_xpu,
        count=_xpu_count,
        synchronize=_sync_xpu,
        torch_module="xpu",
    )
)
register_kind(
    DeviceKind(
        "mps",
        2,
        **_ACCELERATOR,
        async_copies=False,
        flops_per_second=10e12,
        link_bytes_per_second=50e9,
        memory_bytes_per_second=2e11,
        index_alias=True,
        detect=_detect_mps,
        count=_mps_count,
        synchronize=_sync_mps,
        torch_module="mps",
    )
)
register_kind(
    DeviceKind(
        "cpu",
        3,
        computes=True,
        is_storage=True,
        host_addressable=True,
        async_copies=False,
        flops_per_second=2e11,
        link_bytes_per_second=25e9,
        memory_bytes_per_second=2e10,
        read_ahead=2,
        **_CPU_RUNTIME,
    )
)
register_kind(
    DeviceKind(
        "disk",
        4,
        computes=False,
        is_storage=True,
        host_addressable=True,
        async_copies=False,
        flops_per_second=0.0,
        link_bytes_per_second=2e9,
        memory_bytes_per_second=2e9,
        staged_via_host=True,
    )
)
