"""qwen4exp_ext: fast kernels for the Qwen4Exp PLE layer (hashed n-gram memory).

Importing the package loads the compiled kernels, which registers ``torch.ops.qwen4exp.*``; it
never needs a GPU. The typed Python door to the kernels is :mod:`qwen4exp_ext.ops`.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import torch

from . import (
    _kernels,  # noqa: F401  (loading the library registers torch.ops.qwen4exp)
    ops,
)

__all__ = ["build_info", "ops"]
__version__ = "0.1.0"


@cache
def build_info() -> dict[str, Any]:
    """What the loaded binary was built with: backends, GPU archs, torch version.

    ``backends`` lists the kernels compiled in ("cpu", plus "cuda" or "rocm"); ``torch`` is the
    version built against, ``torch_runtime`` the one running now (they must agree in major.minor).
    """
    info = json.loads(torch.ops.qwen4exp.build_info())
    info["torch_runtime"] = torch.__version__
    return info
