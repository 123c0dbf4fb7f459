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

from qwen4exp_ext.vllm import SUPPORTED_VLLM

# The vLLM releases the plugin knows: its own table (one source of truth). CI runs every test that
# requires vLLM once per release (.ci/run, tools/check-vllm.sh).
VLLM_VERSIONS: tuple[str, ...] = SUPPORTED_VLLM
REQUIRE_ENV = "QWEN4EXP_REQUIRE_VLLM"


def vllm_version() -> str | None:
    """The installed vLLM's version, without a local part ("0.34.0+cu130" -> "0.34.0")."""
    if importlib.util.find_spec("vllm") is None:
        return None
    from importlib.metadata import version

    return version("vllm").split("+", 1)[0]


class _Marks(list):
    """Marks that go together: a module's ``pytestmark`` (a list) or a test's decorator."""

    def __call__(self, test):
        for mark in self:
            test = mark(test)
        return test


def require_vllm() -> _Marks:
    """The marks of a test that needs the real vLLM: ``vllm`` (so that ``pytest -m vllm``, as
    tools/check-vllm.sh runs it, finds every such test) and a skip unless a vLLM release the
    plugin supports is installed, except with $QWEN4EXP_REQUIRE_VLLM set (CI): there a missing
    or unsupported vLLM is a failure, so that the vLLM tests can never be skipped silently.
    ``1`` accepts any supported release; a version (``0.34.0``) only that one, so that a run
    meant for one release cannot pass on another."""
    found = vllm_version()
    required = os.environ.get(REQUIRE_ENV, "")
    if required:
        wanted = VLLM_VERSIONS if required == "1" else (required,)
        if found not in wanted or found not in VLLM_VERSIONS:
            pytest.fail(
                f"{REQUIRE_ENV}={required} but the installed vLLM is {found}; wanted "
                f"{' or '.join(wanted)} (the plugin supports {', '.join(VLLM_VERSIONS)})",
                pytrace=False,
            )
        skip = pytest.mark.skipif(False, reason=f"vLLM required ({REQUIRE_ENV}={required})")
    else:
        skip = pytest.mark.skipif(
            found not in VLLM_VERSIONS,
            reason=f"needs vllm {' or '.join(VLLM_VERSIONS)} (found {found}; pip install "
            "--no-deps -r tools/requirements-vllm.txt, or tools/requirements-vllm-<version>.txt)",
        )
    return _Marks([pytest.mark.vllm, skip])


# For the disk_offload tests' scripts (run in a subprocess that has imported json, struct, numpy
# as np, torch and safetensors.torch's save_file): writes a safetensors file and hands its tensors
# over as views of the file's mapping, as vLLM's loader does (with numpy's memmap).
FILE_VIEWS_SCRIPT = r"""
def file_views(path, tensors):
    # vLLM's loader hands over views of the file's mapping: the same, with numpy's memmap.
    save_file(tensors, path)
    with open(path, "rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(header_len))
    views = {}
    for key, tensor in tensors.items():
        start = 8 + header_len + header[key]["data_offsets"][0]
        nbytes = tensor.numel() * tensor.element_size()
        mapped = np.memmap(path, dtype=np.uint8, mode="r", offset=start, shape=(nbytes,))
        views[key] = torch.from_numpy(np.asarray(mapped)).view(tensor.dtype).view(tensor.shape)
    return views
"""


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


def script_with_recorded_ops(script: str) -> str:
    """``script`` (for :func:`run_python`) with :func:`recorded_ops` defined before it: a fresh
    interpreter has no tests/ on its path."""
    import inspect

    return "from contextlib import contextmanager\nimport torch\n" + (
        inspect.getsource(recorded_ops) + textwrap.dedent(script)
    )


class InterpretedHcKernels:
    """vLLM's own hyper-connection kernels (``vendor``: its ``amd`` or ``nvidia`` ops/hc.py) on
    Triton's CPU interpreter, under the doors' names: what tests/hc_support.py's
    ``vllm_mix``/``vllm_combine_and_mix`` take as ``ops``, so that vLLM's module pipeline runs
    on vLLM's kernels as the expected side of a plugin test (fp32 and fp16: the interpreter
    mis-rounds bf16, triton#8322)."""

    def __init__(self, vendor: str = "amd") -> None:
        self.vendor = vendor

    def __getattr__(self, op: str):
        from hc_support import OP_ARGS, run_vllm

        if op not in OP_ARGS:
            raise AttributeError(op)
        return lambda *args: run_vllm(op, *args, vendor=self.vendor)
