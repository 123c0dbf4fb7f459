"""vLLM 0.33.0's own Triton PLE kernels, loaded for Triton's CPU interpreter.

vLLM turns Triton off on a machine without a GPU, and importing ``vllm`` pulls in far more than
these kernels need. So this loader finds ``vllm/models/qwen4_exp/common/ops/ple.py`` through
``importlib.util.find_spec("vllm")`` (which locates the installed package without importing it),
replaces its three vLLM imports by the plain ``triton``/``triton.language`` modules, a platform
stub without PDL (programmatic dependent launch, a Hopper-only launch option) and the null block
id 0, and executes the source as a private module under Triton's CPU interpreter
(``TRITON_INTERPRET=1``, set only while the kernels are defined and run: see ``interpreter()``,
so that other Triton users in the same process, e.g. torch.compile on a GPU, are unaffected).
Triton's standard library is fixed when ``triton.language`` is first imported: on a machine with
no GPU, tests/conftest.py imports it under the interpreter before any test can.

``load()`` returns None when vllm (``pip install --no-deps vllm==0.33.0``) or triton is not
installed, so tests skip cleanly.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import types
from collections.abc import Iterator
from functools import cache
from pathlib import Path

VLLM_VERSION = "0.33.0"
PLE_PATH = ("models", "qwen4_exp", "common", "ops", "ple.py")
# The NVFP4 PLE lookup and the two decoders it calls.
NVFP4_KERNELS = (
    (
        ("model_executor", "layers", "quantization", "utils", "nvfp4_emulation_utils.py"),
        ("_e2m1_inline", "_e4m3_inline"),
    ),
    (
        ("models", "qwen4_exp", "common", "ngram_embedding.py"),
        ("_lookup_nvfp4_ple_embedding_kernel",),
    ),
)

_REPLACED_IMPORTS = {
    "from vllm.platforms import current_platform\n": "current_platform = _NoPdlPlatform()\n",
    "from vllm.triton_utils import tl, triton\n": "import triton\nimport triton.language as tl\n",
    "from vllm.v1.attention.backends.utils import NULL_BLOCK_ID\n": "NULL_BLOCK_ID = 0\n",
}


class _NoPdlPlatform:
    """Stands in for vllm.platforms.current_platform: no programmatic dependent launch."""

    @staticmethod
    def is_arch_support_pdl() -> bool:
        return False


def vllm_source_path(parts: tuple[str, ...]) -> Path | None:
    """Path of a file of the installed vLLM, or None (found without importing vllm)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = Path(root).joinpath(*parts)
        if path.is_file():
            return path
    return None


def ple_source_path() -> Path | None:
    """Path of the installed vLLM's ple.py, or None."""
    return vllm_source_path(PLE_PATH)


def installed_vllm_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("vllm")
    except Exception:  # noqa: BLE001 - not installed, or metadata unreadable
        return None


@cache
def load() -> types.ModuleType | None:
    """The kernels module (``ple_gate``, ``ple_conv``, ``ple_ngram_ids``...), or None."""
    path = ple_source_path()
    if path is None or importlib.util.find_spec("triton") is None:
        return None
    source = path.read_text()
    for original, replacement in _REPLACED_IMPORTS.items():
        if original not in source:
            raise RuntimeError(
                f"{path}: expected import line {original.strip()!r} not found; this loader "
                f"is written for vLLM {VLLM_VERSION}, installed is {installed_vllm_version()}"
            )
        source = source.replace(original, replacement)
    module = types.ModuleType("qwen4exp_tests_vllm_ple")
    module.__file__ = str(path)
    module._NoPdlPlatform = _NoPdlPlatform
    # Triton's @jit reads the source of each kernel through linecache/inspect: register the
    # rewritten text under the module's file name so it finds the code it compiles.
    import linecache

    linecache.cache[str(path)] = (len(source), None, source.splitlines(True), str(path))
    with interpreter():
        exec(compile(source, str(path), "exec"), module.__dict__)  # noqa: S102 - vLLM's source
    return module


@contextlib.contextmanager
def interpreter() -> Iterator[None]:
    """Runs Triton kernels on the CPU interpreter inside the block (Triton reads the variable
    each time it defines or launches a kernel)."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


@cache
def load_nvfp4_lookup() -> types.ModuleType | None:
    """vLLM's ``_lookup_nvfp4_ple_embedding_kernel`` with its ``_e2m1_inline`` and
    ``_e4m3_inline``, or None. Their modules import much of vLLM, so only these three functions
    are taken from the installed sources (with ``ast``) and defined under the interpreter."""
    import ast
    import linecache

    if importlib.util.find_spec("triton") is None:
        return None
    module = types.ModuleType("qwen4exp_tests_vllm_nvfp4")
    pieces = ["import triton\nimport triton.language as tl\n"]
    for parts, names in NVFP4_KERNELS:
        path = vllm_source_path(parts)
        if path is None:
            return None
        text = path.read_text()
        found = {
            node.name: node
            for node in ast.parse(text).body
            if isinstance(node, ast.FunctionDef) and node.name in names
        }
        missing = set(names) - set(found)
        if missing:
            raise RuntimeError(
                f"{path}: {sorted(missing)} not found; this loader is written for vLLM "
                f"{VLLM_VERSION}, installed is {installed_vllm_version()}"
            )
        for name in names:
            pieces.append(ast.get_source_segment(text, found[name], padded=False) + "\n")
            # the decorator line precedes the def node's own segment
            pieces[-1] = "@triton.jit\n" + pieces[-1]
    source = "\n\n".join(pieces)
    filename = "<vllm 0.33.0 NVFP4 PLE lookup>"
    module.__file__ = filename
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    with interpreter():
        exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102 - vLLM's source
    return module
