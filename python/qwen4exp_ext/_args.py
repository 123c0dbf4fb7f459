"""What the Python-side argument checks share (the kernels' own checks are in csrc/torch/args)."""

from __future__ import annotations

import operator
from typing import Any


def as_int(value: Any) -> int | None:
    """An integer argument's value: any integer type (int, a numpy or torch integer scalar:
    ``__index__``), but not a bool, a float or a string; None for anything else. Each caller
    raises its own error, naming its argument."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        return None
    return operator.index(value)
