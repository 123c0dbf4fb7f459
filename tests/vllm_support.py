"""Helpers for the vLLM plugin tests: is vLLM here, run a script in a fresh interpreter, profile.

The plugin patches process-wide state, so every "before/without the plugin" check runs in a
fresh interpreter (``run_python``); the in-process tests load the plugin once, as vLLM does.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
import warnings
from contextlib import contextmanager
from pathlib import Path

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


# The fork server (tests/vllm_fork_server.py): one per test process, started on first use. A script
# may run there only where its environment differs from the server's in variables read after the
# server's imports: vLLM's plugin filter (read when plugins load), the project's own (read by
# qwen4exp_ext, which the server never imports) and pytest's (PYTEST_CURRENT_TEST changes with
# every test). QWEN4EXP_TEST_FORK_SERVER=0 turns it off.
FORK_SERVER = Path(__file__).with_name("vllm_fork_server.py")
_READ_AFTER_IMPORT = ("VLLM_PLUGINS",)
_READ_AFTER_IMPORT_PREFIXES = ("QWEN4EXP_", "PYTEST_")


def _script_env(env: dict[str, str] | None) -> dict[str, str]:
    full_env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    full_env.update(env or {})
    return full_env


class _ForkServer:
    """A running server: its process, the environment it was started with, what its imports set
    in it (vLLM's import sets TORCHINDUCTOR_*, PYTORCH_NVML_BASED_CUDA_CHECK, ...: so does it in
    this process once a test has imported vLLM), its answers."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.process = subprocess.Popen(
            [sys.executable, str(FORK_SERVER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
        )
        ready = self._read(timeout=300)
        if not ready.get("ready"):
            self.close()
            raise RuntimeError(f"the fork server cannot serve: {ready.get('why')}")
        self.imported = {k: v for k, v in ready["env"].items() if env.get(k) != v}

    def _read(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            raise subprocess.TimeoutExpired(str(FORK_SERVER), timeout)
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server exited ({self.process.wait()})")
        return json.loads(line)

    def serves(self, env: dict[str, str]) -> bool:
        keys = set(env) | set(self.env)
        return all(
            env.get(k) == self.env.get(k)
            or (k in self.imported and env.get(k, self.imported[k]) == self.imported[k])
            or k in _READ_AFTER_IMPORT
            or k.startswith(_READ_AFTER_IMPORT_PREFIXES)
            for k in keys
        )

    def run(self, script: str, env: dict[str, str], timeout: float) -> tuple[int, str, str]:
        env = {**self.imported, **env}  # as the script's own import of vLLM would set them
        with tempfile.TemporaryDirectory(prefix="qwen4exp-fork-") as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            request = dict(
                script=script, env=env, cwd=os.getcwd(), stdout=str(out), stderr=str(err)
            )
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            pid = self._read(timeout=60)["pid"]
            try:
                returncode = self._read(timeout=timeout)["returncode"]
            except subprocess.TimeoutExpired:
                os.kill(pid, signal.SIGKILL)
                self._read(timeout=60)
                raise
            return returncode, out.read_text(), err.read_text()

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# The servers started in this process, by the environment they serve: a test that changes an
# import-time variable for a while (monkeypatch) gets its own, up to _MAX_FORK_SERVERS.
_fork_servers: list[_ForkServer] = []
_fork_server_failed = False
_MAX_FORK_SERVERS = 2


def _server_for(env: dict[str, str]) -> _ForkServer | None:
    global _fork_server_failed
    if os.environ.get("QWEN4EXP_TEST_FORK_SERVER", "1") == "0" or _fork_server_failed:
        return None
    for server in _fork_servers:
        if server.serves(env):
            return server
    if len(_fork_servers) >= _MAX_FORK_SERVERS:
        return None
    try:
        server = _ForkServer(env)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        # Only speed is lost: every script then starts its own interpreter.
        warnings.warn(f"vLLM test scripts run without the fork server: {e}", stacklevel=3)
        _fork_server_failed = True
        return None
    atexit.register(server.close)
    _fork_servers.append(server)
    return server


def run_python(
    script: str, *, env: dict[str, str] | None = None, timeout: int = 300, bare: bool = False
) -> str:
    """Runs ``script`` as ``python -c`` in a fresh process (this interpreter), returns its stdout;
    fails the test with its output when it exits non-zero. Where vLLM is installed, the process is
    forked from the fork server, which has imported torch, triton and vLLM's plugin loader and
    config, nothing of the plugin's (tests/vllm_fork_server.py), unless ``env`` changes what those
    imports read; ``bare=True`` starts a new interpreter, for a script that needs one without
    vLLM or triton loaded."""
    full_env = _script_env(env)
    script = textwrap.dedent(script)
    forkable = not bare and importlib.util.find_spec("vllm") is not None
    server = _server_for(full_env) if forkable else None
    if server is not None:
        returncode, stdout, stderr = server.run(script, full_env, timeout)
    else:
        proc = subprocess.run(
            [sys.executable, "-c", script],
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    if returncode != 0:
        pytest.fail(
            f"subprocess failed ({returncode})\n--- stdout\n{stdout}\n--- stderr\n{stderr[-6000:]}",
            pytrace=False,
        )
    return stdout


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
