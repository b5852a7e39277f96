"""``skip_when_compiling``: ``torch.compiler.disable`` without importing ``torch._dynamo`` early.

``torch.compiler.disable`` imports ``torch._dynamo`` (about a second, and most of ``import
automap``) when it decorates. Nothing can be compiling until ``torch._dynamo`` is imported (a
``torch.compile`` imports it), so the decorated body runs plainly until then, and behind
``torch._dynamo.disable`` after: a compiled model breaks its graph at the call, never traces it.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def skip_when_compiling(fn: F) -> F:
    """Decorate ``fn`` so that dynamo never traces it; ``torch._dynamo`` is imported only once
    something else has imported it."""
    disabled = torch._disable_dynamo(fn)  # lazy too: it imports dynamo at its first call

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" in sys.modules:
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]
