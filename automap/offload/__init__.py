"""Offloaded weights: where they live between uses, and how they reach the execution device.

- :mod:`~automap.offload.format`: the safetensors format — the one validating parser, and a
  streaming writer;
- :mod:`~automap.offload.mapped`: a safetensors file mapped copy-on-write, a tensor per entry;
- :mod:`~automap.offload.source`: the :class:`WeightSource` protocol, RAM and composite sources;
- :mod:`~automap.offload.store`: the store directory automap creates, owns and locks, with
  :mod:`~automap.offload.store_files` (every write, through a directory handle, never through a
  link), :mod:`~automap.offload.store_lock`, :mod:`~automap.offload.manifest` and
  :mod:`~automap.offload.store_writer`;
- :mod:`~automap.offload.reference`: a user's checkpoint read in place;
- :mod:`~automap.offload.readahead`: reading a unit's file ranges with several large requests in flight;
- :mod:`~automap.offload.transfer`: bringing weights to the execution device, one unit ahead (two on CPU
  execution).
"""
from automap.offload.format import (DTYPE_NAMES, DTYPES, Header, TensorInfo, load_json, read_header, read_regular,
                                    write_file)
from automap.offload.mapped import MappedFile, backing_file
from automap.offload.reference import CheckpointSource
from automap.offload.source import HoldingSource, MappedSource, RamSource, RowSource, SourceSet, SourceStats, WeightSource
from automap.offload.store import (LOCK, MANIFEST, STORE_PREFIX, OffloadStore, Record, TensorSpec, check_offload_dir,
                                   checksum, read_manifest)
from automap.offload.transfer import (CudaOps, DeviceCopyOps, DeviceOps, HostCopyOps, PageTransfer, StagedTransfer,
                                      Transfer, make_transfer)

__all__ = ["DTYPES", "DTYPE_NAMES", "LOCK", "MANIFEST", "STORE_PREFIX", "CheckpointSource", "CudaOps", "DeviceCopyOps",
           "DeviceOps",
           "Header", "HoldingSource", "HostCopyOps", "MappedFile", "MappedSource", "OffloadStore", "PageTransfer", "RamSource",
           "Record", "RowSource", "SourceSet", "SourceStats", "StagedTransfer", "TensorInfo", "TensorSpec", "Transfer",
           "WeightSource", "backing_file", "check_offload_dir", "checksum", "load_json", "make_transfer", "read_header",
           "read_manifest", "read_regular", "write_file"]
