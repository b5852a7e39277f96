"""Offloaded weights: where they live between uses (weight sources: the owned store, checkpoints
read in place, RAM) and how they reach the execution device (transfers).
"""

from automap.offload.format import (
    DTYPE_NAMES,
    DTYPES,
    Header,
    TensorInfo,
    load_json,
    read_header,
    read_regular,
    write_file,
)
from automap.offload.cleanup import CleanResult, clean, store_size
from automap.offload.mapped import MappedFile, open_for_map
from automap.offload.opening import backing_file
from automap.offload.reference import CheckpointSource
from automap.offload.source import (
    HoldingSource,
    MappedSource,
    RamSource,
    RowSource,
    SourceSet,
    SourceStats,
    WeightSource,
)
from automap.offload.store import (
    LOCK,
    MANIFEST,
    STORE_PREFIX,
    OffloadStore,
    Record,
    TensorSpec,
    check_offload_dir,
    checksum,
    read_manifest,
)
from automap.offload.transfer import (
    CudaOps,
    DeviceCopyOps,
    DeviceOps,
    HostCopyOps,
    PageTransfer,
    StagedTransfer,
    Transfer,
    make_transfer,
)
from automap.offload.direct import DirectTransfer

__all__ = [
    "DTYPES",
    "DTYPE_NAMES",
    "LOCK",
    "MANIFEST",
    "STORE_PREFIX",
    "CheckpointSource",
    "CleanResult",
    "CudaOps",
    "DeviceCopyOps",
    "DeviceOps",
    "DirectTransfer",
    "Header",
    "HoldingSource",
    "HostCopyOps",
    "MappedFile",
    "MappedSource",
    "OffloadStore",
    "PageTransfer",
    "RamSource",
    "Record",
    "RowSource",
    "SourceSet",
    "SourceStats",
    "StagedTransfer",
    "TensorInfo",
    "TensorSpec",
    "Transfer",
    "WeightSource",
    "backing_file",
    "check_offload_dir",
    "checksum",
    "clean",
    "load_json",
    "make_transfer",
    "open_for_map",
    "read_header",
    "read_manifest",
    "read_regular",
    "store_size",
    "write_file",
]
