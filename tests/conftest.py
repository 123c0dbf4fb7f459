"""Shared test setup: fixed seeds, hypothesis profiles, device list."""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import HealthCheck, settings

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
