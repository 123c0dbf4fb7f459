"""vLLM's own Triton PLE kernels (0.33.0 or 0.34.0: the releases the plugin supports, whose
kernels these loaders read alike), without importing vLLM: for the bench on a GPU (the
``vllm`` baselines) and for the tests on Triton's CPU interpreter.

Importing ``vllm`` pulls in far more than these kernels need, vLLM turns Triton off on a machine
without a GPU, and the GPU machine this project benchmarks on has no vLLM and reaches no
registry. So this loader takes vLLM's source file ``vllm/models/qwen4_exp/common/ops/ple.py``,
replaces its three vLLM imports by the plain ``triton``/``triton.language`` modules, a platform
object that answers ``is_arch_support_pdl()`` as vLLM's does (programmatic dependent launch:
CUDA compute capability 9 and up; never under the interpreter or on ROCm) and the null block id
0, and executes the source as a private module; nothing else of vLLM is used.

The source comes from, in order:

- ``$QWEN4EXP_VLLM_SOURCE``: a folder written by ``python -m qwen4exp_ext.bench.vllm_triton
  DIR`` where vLLM is installed (the files these loaders read, under ``vllm/``, and the version
  in ``VLLM_VERSION``). Carry that folder to a machine without vLLM (it is git-ignored as
  ``.vllm-source/``; tools/check-gpu.sh uses it when present). Nothing of vLLM is committed.
- the installed ``vllm`` package, found with ``importlib.util.find_spec("vllm")`` (which
  locates the package without importing it).

``load(interpret=True)`` defines the kernels under Triton's CPU interpreter
(``TRITON_INTERPRET=1``, set only while the kernels are defined and run: see ``interpreter()``,
so that other Triton users in the same process, e.g. torch.compile on a GPU, are unaffected);
Triton's standard library is fixed when ``triton.language`` is first imported, so on a machine
with no GPU tests/conftest.py imports it under the interpreter before any test can.
``load(interpret=False)`` defines them for the GPU. Either returns None when there is no vLLM
source or no triton, so callers skip cleanly. ``load_lookup_kernels(interpret)`` does the same
for vLLM's PLE table lookups (NVFP4, and the row copy of pinned bf16/fp8 tables), taken one
function at a time from files that import too much of vLLM to execute whole.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import sys
import types
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from ..vllm import SUPPORTED_VLLM

if TYPE_CHECKING:
    import torch

# The releases whose sources these loaders know: the plugin's (their imports and kernel names
# are the same; 0.34.0 only widened the program ids to int64).
VLLM_VERSIONS = SUPPORTED_VLLM
SOURCE_ENV = "QWEN4EXP_VLLM_SOURCE"
VERSION_FILE = "VLLM_VERSION"
PLE_PATH = ("models", "qwen4_exp", "common", "ops", "ple.py")
# The hyper-connection kernels (SPEC §10): the AMD file registers them as torch.ops.vllm ops.
HC_PATHS = {vendor: ("models", "qwen4_exp", vendor, "ops", "hc.py") for vendor in ("amd", "nvidia")}
_REGISTER_IMPORT = "from vllm.utils.torch_utils import direct_register_custom_op\n"
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
# What load_lookup_kernels takes: the NVFP4 lookup's functions, and from the same file the row
# copy of pinned bf16 and fp8 tables (Qwen4ExpPLEPinnedHostEmbedding's lookup_from_pinned).
PINNED_ROW_COPY = "_lookup_ple_embedding_from_pinned_kernel"
LOOKUP_KERNELS = (
    NVFP4_KERNELS[0],
    (NVFP4_KERNELS[1][0], (*NVFP4_KERNELS[1][1], PINNED_ROW_COPY)),
)

_REPLACED_IMPORTS = {
    "from vllm.platforms import current_platform\n": "current_platform = _Platform()\n",
    "from vllm.triton_utils import tl, triton\n": "import triton\nimport triton.language as tl\n",
    "from vllm.v1.attention.backends.utils import NULL_BLOCK_ID\n": "NULL_BLOCK_ID = 0\n",
}


class _InterpreterPlatform:
    """Stands in for vllm.platforms.current_platform under the interpreter: no PDL."""

    @staticmethod
    def is_arch_support_pdl() -> bool:
        return False


class _GpuPlatform:
    """Stands in for vllm.platforms.current_platform on a GPU, as vLLM 0.33.0/0.34.0 answer: PDL
    (CudaPlatform.is_arch_support_pdl) from compute capability 9 on; none on ROCm (the base
    Platform's answer, which RocmPlatform keeps)."""

    @staticmethod
    def is_arch_support_pdl() -> bool:
        import torch

        if torch.version.hip is not None:
            return False
        try:
            major, _ = torch.cuda.get_device_capability(torch.cuda.current_device())
        except Exception:  # noqa: BLE001 - vLLM's own answer when the query fails
            return False
        return major >= 9


def _installed_root() -> Path | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _carried_root() -> Path | None:
    """``$QWEN4EXP_VLLM_SOURCE``'s ``vllm`` folder (None where it is unset or empty); a value
    that names no folder written by :func:`extract` is a ValueError, not a silent fallback to
    the installed vLLM."""
    from qwen4exp_ext import _switches

    folder = _switches.env_directory(SOURCE_ENV)
    if folder is None:
        return None
    if not (folder / VERSION_FILE).is_file():
        raise ValueError(
            f"{SOURCE_ENV} must name a folder written by `python -m qwen4exp_ext.bench."
            f"vllm_triton DIR`, got {str(folder)!r}, which holds no {VERSION_FILE}"
        )
    return folder / "vllm"


def vllm_source_path(parts: tuple[str, ...]) -> Path | None:
    """Path of a file of vLLM's source (the carried copy first), or None."""
    for root in (_carried_root(), _installed_root()):
        if root is not None and root.joinpath(*parts).is_file():
            return root.joinpath(*parts)
    return None


def ple_source_path() -> Path | None:
    """Path of vLLM's ple.py, or None."""
    return vllm_source_path(PLE_PATH)


def vllm_source_version() -> str | None:
    """The version of the vLLM source in use: the carried copy's, else the installed one's."""
    carried = _carried_root()
    if carried is not None and (carried.parent / VERSION_FILE).is_file():
        return (carried.parent / VERSION_FILE).read_text().strip()
    try:
        from importlib.metadata import version

        return version("vllm")
    except Exception:  # noqa: BLE001 - not installed, or metadata unreadable
        return None


def source_origin() -> str | None:
    """Where the kernels come from, for reports: "vllm <version> from <path>", or None."""
    path = ple_source_path()
    return None if path is None else f"vllm {vllm_source_version()} from {path}"


@cache
def load(interpret: bool = True) -> types.ModuleType | None:
    """The kernels module (``ple_gate``, ``ple_conv``, ``ple_ngram_ids``...), defined for the
    CPU interpreter or (``interpret=False``) for the GPU; or None."""
    path = ple_source_path()
    if path is None or importlib.util.find_spec("triton") is None:
        return None
    return _exec_source(path, _REPLACED_IMPORTS, "ple", interpret)


def hc_source_path(vendor: str = "amd") -> Path | None:
    """Path of vLLM's hyper-connection kernels ``models/qwen4_exp/<vendor>/ops/hc.py``
    (``vendor`` "amd" or "nvidia"), or None."""
    if vendor not in HC_PATHS:
        raise ValueError(f"vendor must be one of {sorted(HC_PATHS)}, got {vendor!r}")
    return vllm_source_path(HC_PATHS[vendor])


@cache
def load_hc(interpret: bool = True, vendor: str = "amd") -> types.ModuleType | None:
    """vLLM's five hyper-connection Triton kernels and their launchers (SPEC §10), defined for
    the CPU interpreter or the GPU; or None. The AMD file's launchers are ``_hc_combine_norm``,
    ``_grouped_gemma_rmsnorm``, ``_hc_silu``, ``_hc_gate_mix`` and ``_hc_combine`` (it registers
    them as ``torch.ops.vllm.qwen4_exp_*``: that registration is left out here); the NVIDIA
    file's are the same names without the underscore, and accept ``injection_logits=None``."""
    path = hc_source_path(vendor)
    if path is None or importlib.util.find_spec("triton") is None:
        return None
    replaced = {k: v for k, v in _REPLACED_IMPORTS.items() if "NULL_BLOCK_ID" not in k}
    if vendor == "amd":
        replaced[_REGISTER_IMPORT] = "def direct_register_custom_op(**_): pass\n"
    return _exec_source(path, replaced, f"hc_{vendor}", interpret)


def _exec_source(
    path: Path, replaced: dict[str, str], name: str, interpret: bool
) -> types.ModuleType:
    """Executes vLLM's source file ``path`` as a private module, its vLLM imports replaced."""
    source = path.read_text()
    for original, replacement in replaced.items():
        if original not in source:
            raise RuntimeError(
                f"{path}: expected import line {original.strip()!r} not found; this loader is "
                f"written for vLLM {', '.join(VLLM_VERSIONS)}, the source is "
                f"{vllm_source_version()}"
            )
        source = source.replace(original, replacement)
    kind = "interpreted" if interpret else "gpu"
    module = types.ModuleType(f"qwen4exp_vllm_{name}_{kind}")
    module.__file__ = str(path)
    module._Platform = _InterpreterPlatform if interpret else _GpuPlatform
    # Triton's @jit reads the source of each kernel through linecache/inspect: register the
    # rewritten text under the module's file name so it finds the code it compiles.
    import linecache

    linecache.cache[str(path)] = (len(source), None, source.splitlines(True), str(path))
    with interpreter() if interpret else contextlib.nullcontext():
        exec(compile(source, str(path), "exec"), module.__dict__)  # noqa: S102 - vLLM's source
    return module


def extract(dest: Path) -> list[Path]:
    """Copies the installed vLLM's files that these loaders read into ``dest`` (for
    ``$QWEN4EXP_VLLM_SOURCE``), with its version; returns the files written."""
    root = _installed_root()
    if root is None:
        raise RuntimeError("vllm is not installed here: nothing to extract")
    written = []
    for parts in (PLE_PATH, *HC_PATHS.values(), *(parts for parts, _ in NVFP4_KERNELS)):
        target = dest.joinpath("vllm", *parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root.joinpath(*parts), target)
        written.append(target)
    from importlib.metadata import version

    (dest / VERSION_FILE).write_text(version("vllm") + "\n")
    return [*written, dest / VERSION_FILE]


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


def load_nvfp4_lookup() -> types.ModuleType | None:
    """vLLM's ``_lookup_nvfp4_ple_embedding_kernel`` with its ``_e2m1_inline`` and
    ``_e4m3_inline``, defined under the interpreter, or None (``load_lookup_kernels``)."""
    return load_lookup_kernels(interpret=True)


@cache
def load_lookup_kernels(interpret: bool = True) -> types.ModuleType | None:
    """vLLM's PLE table lookups (``LOOKUP_KERNELS``): ``_lookup_nvfp4_ple_embedding_kernel``
    with its ``_e2m1_inline`` and ``_e4m3_inline``, and ``PINNED_ROW_COPY``
    (``_lookup_ple_embedding_from_pinned_kernel``), the raw-byte row copy that its pinned bf16
    and fp8 tables run; or None. Their modules import much
    of vLLM, so only these functions are taken from the sources (with ``ast``), and defined under
    the interpreter or (``interpret=False``) for the GPU.

    The row copy declares its table and output as ``tl.pointer_type(tl.uint8)``, which Triton's
    interpreter does not apply: pass it byte views (``tensor.view(torch.uint8)``), as the GPU
    sees them either way."""
    import ast
    import linecache

    if importlib.util.find_spec("triton") is None:
        return None
    kind = "interpreted" if interpret else "gpu"
    module = types.ModuleType(f"qwen4exp_vllm_lookups_{kind}")
    pieces = ["import triton\nimport triton.language as tl\n"]
    for parts, names in LOOKUP_KERNELS:
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
                f"{', '.join(VLLM_VERSIONS)}, the source is {vllm_source_version()}"
            )
        for name in names:
            pieces.append(ast.get_source_segment(text, found[name], padded=False) + "\n")
            # the decorator line precedes the def node's own segment
            pieces[-1] = "@triton.jit\n" + pieces[-1]
    source = "\n\n".join(pieces)
    filename = f"<vllm {vllm_source_version()} PLE lookups, {kind}>"
    module.__file__ = filename
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    with interpreter() if interpret else contextlib.nullcontext():
        exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102 - vLLM's source
    return module


def lookup_rows(
    kernels: types.ModuleType,
    table: torch.Tensor,
    ids: torch.Tensor,
    output: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    block_scales: torch.Tensor | None = None,
    vocab_start: int = 0,
    vocab_end: int | None = None,
    staging: torch.Tensor | None = None,
) -> torch.Tensor:
    """The rows of ``ids`` (any shape, int64) into ``output`` [..., ids' heads · d] as vLLM
    looks them up with ``load_lookup_kernels``' kernels: a pinned table's bf16 or fp8 rows by its
    Triton row copy (``Qwen4ExpPLEEmbeddingMethod.lookup_from_pinned``), one program per id, of
    raw bytes (fp8: into ``staging`` [>= ids, d] uint8, then its eager ``dequantize``,
    ``.to(out) * scale.to(out)``); NVFP4 (``block_scales`` given; ``table`` the packed uint8
    rows, ``scale`` the global one) by its decode kernel, which vLLM runs for device and pinned
    tables alike. Ids outside [vocab_start, vocab_end) give zero rows. ``table`` may be a pinned
    table's device view; it is passed as bytes, as the GPU kernel declares uint8 pointers
    (Triton's interpreter does not apply them)."""
    import torch
    import triton

    flat = ids.reshape(-1)
    count = flat.numel()
    if count == 0:
        return output
    vocab_end = table.shape[0] if vocab_end is None else vocab_end
    if block_scales is not None:
        width = table.shape[1] * 2
        kernels._lookup_nvfp4_ple_embedding_kernel[(count,)](
            table,
            block_scales.view(torch.uint8),
            scale,
            flat,
            output.view(count, width),
            width,
            vocab_start,
            vocab_end,
            BLOCK_D=triton.next_power_of_2(width),
        )
        return output
    raw = table.view(torch.uint8)
    nbytes = raw.shape[1]
    target = staging[:count] if scale is not None else output.view(count, -1).view(torch.uint8)
    getattr(kernels, PINNED_ROW_COPY)[(count,)](
        raw,
        flat,
        target,
        nbytes,
        vocab_start,
        vocab_end,
        BLOCK_D=triton.next_power_of_2(nbytes),
    )
    if scale is not None:
        values = target.view(table.dtype).to(output.dtype)
        torch.mul(values, scale.to(output.dtype), out=output.view(count, -1))
    return output


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print(
            "usage: python -m qwen4exp_ext.bench.vllm_triton DIR\n"
            "copies the installed vLLM's PLE kernel sources into DIR (for $QWEN4EXP_VLLM_SOURCE)",
            file=sys.stderr,
        )
        return 2
    for path in extract(Path(args[0])):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
