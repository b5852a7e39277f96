"""The exceptions automap raises. Every one subclasses :class:`AutomapError`.

Messages name the thing that failed, the numbers involved, and what to do about it; warnings
point at the user's line (:func:`user_stacklevel`).
"""

from __future__ import annotations

import os
import sys


class AutomapError(Exception):
    """Base class of every error automap raises on purpose."""


class SizeError(AutomapError, ValueError):
    """A memory size (``"10GiB"``, ``500_000_000``) could not be parsed or is negative."""


class DeviceError(AutomapError):
    """A device is unknown, missing on this machine, or described inconsistently."""


class ProfileError(AutomapError):
    """The model could not be profiled (bad example inputs, unknown no-split classes)."""


class PlanError(AutomapError):
    """No valid placement exists, or a strategy name is unknown."""


class RuntimeBudgetError(PlanError):
    """A device that computes cannot hold the forward's activations and the runtime's overhead
    within its budget, even with every weight elsewhere (the message has the numbers)."""


class DeviceMapError(PlanError):
    """A user-given device map names unknown modules or leaves tensors without a device."""


class MapFormatError(PlanError):
    """No plan that fits can be written as a device map alone as well as one that cannot
    (accelerate's format cannot say where offloaded units compute unless it is the
    lowest-numbered GPU the map names). ``fallback``: the best plan that can be written, of a
    worse kind (the CPU computing units the GPUs could), or None."""

    def __init__(self, message: str, fallback: object = None) -> None:
        super().__init__(message)
        self.fallback = fallback


class DispatchError(AutomapError):
    """The model could not be dispatched; it was left exactly as it was."""


class ConversionError(DispatchError, RuntimeError):
    """A dtype or device conversion (``.to()``, ``.half()``, ``.cuda()``) of a dispatched model was
    refused: it would break the placement. Also a ``RuntimeError``, which is what accelerate
    raises for it, so scripts that catch that keep working."""


class OffloadError(AutomapError):
    """The offload store is unwritable, missing, changed or truncated."""


class CheckpointError(AutomapError):
    """A checkpoint is missing, corrupt, unsafe, or does not match the model."""


class OffloadDirError(DispatchError, CheckpointError):
    """The plan keeps weights on disk but no ``offload_dir`` was given (nor recorded in the
    plan), or the folder given has no room for them. Dispatch and load raise the same one:
    caught as either a :class:`DispatchError` or a :class:`CheckpointError`."""


class FormatError(CheckpointError, OffloadError):
    """A safetensors file (a checkpoint or a store file) breaks the format: a header that is
    not an object, bad offsets, overlapping or out-of-bounds ranges, an unknown dtype, or a
    truncated file. Caught as either a :class:`CheckpointError` or an :class:`OffloadError`."""


class PipelineError(AutomapError):
    """Pipelined execution was asked for with inconsistent settings."""


class SpecError(AutomapError, ValueError):
    """A model SPEC or command-line argument (--set, --max-memory, --dtype) could not be understood."""


class ArgumentError(AutomapError, TypeError):
    """A keyword argument automap does not take in that call (one of ``from_pretrained``'s that
    makes no sense here, or that automap does not do): the message names it and says why. Also a
    ``TypeError``, which Python raises for an unexpected keyword."""


class DependencyError(AutomapError, ImportError):
    """A library that one call needs (transformers, to build a model from a Hugging Face
    folder's ``config.json``) is not installed; the message says what to install."""


class ReportError(AutomapError):
    """A report could not be written (unknown picture format, missing folder, unwritable path)."""


def user_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn``, called by the function that warns, of the
    first caller outside automap: a warning points at the user's line, also when a drop-in
    or another of automap's functions stands between."""
    frame, level = sys._getframe(1), 1
    root = os.path.dirname(os.path.abspath(__file__))
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(root + os.sep):
        frame, level = frame.f_back, level + 1
    return level
