"""Helpers for the vLLM plugin tests: is vLLM here, run a script in a fresh interpreter, profile.

The plugin patches process-wide state, so every "before/without the plugin" check runs in a
fresh interpreter (``run_python``); the in-process tests load the plugin once, as vLLM does.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from contextlib import contextmanager

import pytest
import torch

VLLM_VERSION = "0.33.0"


def vllm_version() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return None
    from importlib.metadata import version

    return version("vllm")


def require_vllm() -> pytest.MarkDecorator:
    """Skip when vLLM is absent, unless QWEN4EXP_REQUIRE_VLLM=1 (CI): there a missing vLLM is a
    failure, so that the vLLM tests can never be skipped silently."""
    found = vllm_version()
    if os.environ.get("QWEN4EXP_REQUIRE_VLLM") == "1":
        if found is None or found.split("+")[0] != VLLM_VERSION:
            pytest.fail(
                f"QWEN4EXP_REQUIRE_VLLM=1 but vllm=={VLLM_VERSION} is not installed "
                f"(found {found})",
                pytrace=False,
            )
        return pytest.mark.skipif(False, reason="vLLM required (QWEN4EXP_REQUIRE_VLLM=1)")
    return pytest.mark.skipif(
        found is None or found.split("+")[0] != VLLM_VERSION,
        reason=f"needs vllm=={VLLM_VERSION} (pip install --no-deps vllm=={VLLM_VERSION} + pins)",
    )


def run_python(script: str, *, env: dict[str, str] | None = None, timeout: int = 300) -> str:
    """Runs ``script`` in a fresh interpreter (this one's), returns its stdout; fails the test
    with its output when it exits non-zero."""
    full_env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"subprocess failed ({proc.returncode})\n--- stdout\n{proc.stdout}\n--- stderr\n"
            f"{proc.stderr[-6000:]}",
            pytrace=False,
        )
    return proc.stdout


@contextmanager
def recorded_ops():
    """Yields a list that, on exit, holds the names of every op the profiler saw (e.g.
    ``qwen4exp::ngram_ids``): proof of which kernel ran, with no instrumentation of ours."""
    names: list[str] = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield names
    names.extend(e.name for e in prof.events())
