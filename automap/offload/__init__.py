"""Offloaded weights: the on-disk store (:mod:`automap.offload.store`) and the loader that
brings them to the execution device one unit ahead (:mod:`automap.offload.stream`)."""
from automap.offload.store import (DTYPE_NAMES, DTYPES, INDEX_NAME, INDEX_VERSION, Entry, OffloadStore,
                                   checkpoint_entries, checksum, read_header)
from automap.offload.stream import Loader

__all__ = ["DTYPES", "DTYPE_NAMES", "INDEX_NAME", "INDEX_VERSION", "Entry", "Loader", "OffloadStore",
           "checkpoint_entries", "checksum", "read_header"]
