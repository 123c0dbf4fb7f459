"""Shared test setup: fixed seeds, hypothesis profiles, device list."""

from __future__ import annotations

import importlib.util
import os
import random
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

import vllm_triton

# CI runs the same examples every time (derandomize); a developer can ask for a longer search with
# HYPOTHESIS_PROFILE=dev.
settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _import_triton_for_its_interpreter() -> None:
    """Triton decides once, when ``triton.language`` is imported, whether its standard library
    (``tl.zeros``, ``tl.sum``...) is made of interpreter functions: imported first by anything
    else (torch.compile does, when it probes for Triton), vLLM's kernels then fail under the CPU
    interpreter with "Cannot call @triton.jit'd outside of the scope of a kernel", so the
    outcome of tests/test_ple_conv.py depended on which test file ran first. On a machine with
    no GPU, nothing else can use Triton, so the session imports it under the interpreter before
    any test does. With a GPU, Triton stays as it is for torch.compile."""
    if torch.cuda.is_available() or "triton" in sys.modules:
        return
    if importlib.util.find_spec("triton") is None or vllm_triton.ple_source_path() is None:
        return
    with vllm_triton.interpreter():
        import triton.language  # noqa: F401


_import_triton_for_its_interpreter()


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(0)
    torch.manual_seed(0)


def devices() -> list[str]:
    """CPU always; the GPU too when this machine has one and the extension was built for it."""
    import qwen4exp_ext

    found = ["cpu"]
    if torch.cuda.is_available() and len(qwen4exp_ext.build_info()["backends"]) > 1:
        found.append("cuda")
    return found
