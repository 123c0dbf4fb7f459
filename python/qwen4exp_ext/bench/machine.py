"""What a bench run ran on: the environment every report is tagged with
(``describe_environment``: the device, torch, the build, the CPU kernels' paths, the CPU's
generation and caches, the source commit, the date), the device's name (``device_name``), and the
datasheet HBM bandwidth of the GPUs users serve on (``PEAK_TBPS``), against which
``pct_of_peak`` puts our bandwidth.
"""

from __future__ import annotations

import functools
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

import qwen4exp_ext
from qwen4exp_ext import ops
from qwen4exp_ext.bench import vllm_triton

# The memory roofline of the GPUs users serve on: datasheet HBM bandwidth, TB/s. A case's
# minimum time on one is its compulsory bytes at that bandwidth.
PEAK_TBPS = {"MI300X": 5.3, "MI325X": 6.0, "MI355X": 8.0, "H200": 4.8}


def describe_environment(device: torch.device) -> dict[str, Any]:
    build_info = getattr(qwen4exp_ext, "build_info", None)
    return {
        "device": device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "torch_gpu_runtime": torch.version.hip or torch.version.cuda,
        "threads": torch.get_num_threads(),
        "build_info": build_info() if callable(build_info) else None,
        # Outputs of at least this many bytes take the CPU gather's streaming path where a
        # threshold is set, else its timed path (-1: no streaming path); each CPU row's
        # "cpu_paths" says which path ran, and the timing behind it.
        "cpu_gather_stream_bytes": ops.cpu_gather_stream_bytes(),
        # How the CPU gather converted fp8 rows ("avx512", "avx2" or "scalar").
        "cpu_gather_fp8_lookup": ops.cpu_gather_fp8_lookup(),
        # How the CPU conv looked its SiLU up ("loop" or "gather": timed on this CPU).
        "cpu_conv_silu_lookup": ops.cpu_conv_silu_lookup(),
        # The source of the "vllm" baselines (GPU only; None: no vLLM source here).
        "vllm_kernels": vllm_triton.source_origin() if device.type == "cuda" else None,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        # What "AMD EPYC" alone (a VM's model name) does not say: the host CPU's generation,
        # vector extensions and caches, whichever device ran; "cpu_model" in words.
        "cpu": _cpu_facts(),
        "cpu_model": cpu_text(),
        "source": _source_commit(),
    }


# The x86 extensions that pick the CPU kernels' paths (simd.h, row_convert.h,
# gather_rows_stream.cpp), where present.
_CPU_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile")


@functools.cache  # read once per run: the header, the file name and the JSON all name the CPU
def _cpu_facts() -> dict[str, Any] | None:
    """The first CPU's vendor, family, model, name, the flags of ``_CPU_FLAGS`` it has and its
    L2 and L3 sizes, from /proc/cpuinfo and sysfs (Linux); None where there is neither."""
    facts: dict[str, Any] = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            fields = {}
            for line in cpuinfo:
                if not line.strip():
                    break  # the first processor's block
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        return None
    facts["vendor"] = fields.get("vendor_id")
    facts["family"] = fields.get("cpu family")
    facts["model"] = fields.get("model")
    facts["model_name"] = fields.get("model name")
    facts["generation"] = cpu_generation(facts["vendor"], facts["family"], facts["model"])
    flags = set(fields.get("flags", "").split())
    facts["flags"] = [flag for flag in _CPU_FLAGS if flag in flags]
    cache_dir = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(cache_dir.glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if kind != "Instruction" and level in ("2", "3"):
            facts[f"l{level}"] = size
    return facts


# The server generations the CPU kernels' figures come from (docs/design/cpu-kernel-notes.md),
# by vendor and family: (first model, last model, name), from the vendors' model numbers. A VM
# often names its CPU "AMD EPYC" or "Intel Xeon Processor" and nothing more.
_GENERATIONS = {
    ("AuthenticAMD", 23): ((0x00, 0x2F, "Zen/Zen+"), (0x30, 0xFF, "Zen 2")),
    ("AuthenticAMD", 25): (
        (0x00, 0x0F, "Zen 3"),
        (0x10, 0x1F, "Zen 4"),
        (0x20, 0x5F, "Zen 3"),
        (0x60, 0xAF, "Zen 4"),
    ),
    ("AuthenticAMD", 26): ((0x00, 0xFF, "Zen 5"),),
    ("GenuineIntel", 6): (
        (0x55, 0x55, "Skylake/Cascade Lake"),
        (0x6A, 0x6C, "Ice Lake"),
        (0x8F, 0x8F, "Sapphire Rapids"),
        (0xAD, 0xAE, "Granite Rapids"),
        (0xAF, 0xAF, "Sierra Forest"),
        (0xCF, 0xCF, "Emerald Rapids"),
    ),
}


def cpu_generation(vendor: str | None, family: str | None, model: str | None) -> str | None:
    """The CPU's generation ("Zen 4", "Sapphire Rapids") from /proc/cpuinfo's vendor_id, cpu
    family and model, where _GENERATIONS knows it; else None."""
    try:
        key, number = (vendor, int(family or "")), int(model or "")
    except ValueError:
        return None
    for first, last, name in _GENERATIONS.get(key, ()):
        if first <= number <= last:
            return name
    return None


def cpu_text(facts: dict[str, Any] | None = None) -> str | None:
    """The CPU in words for the summary: its model name, generation, family and model ("AMD
    EPYC (Zen 4, family 25 model 17)"); None where /proc/cpuinfo is not there."""
    facts = _cpu_facts() if facts is None else facts
    if not facts:
        return None
    details = [facts.get("generation")]
    if facts.get("family") is not None and facts.get("model") is not None:
        details.append(f"family {facts['family']} model {facts['model']}")
    details = [d for d in details if d]
    name = facts.get("model_name") or "unnamed CPU"
    return f"{name} ({', '.join(details)})" if details else name


def _source_commit() -> str | None:
    """The git commit of this package's checkout (with "-dirty" if the tracked files differ
    from it), or None outside a checkout or without git."""
    here = str(Path(__file__).resolve().parent)
    try:
        head = subprocess.run(
            ["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    facts = _cpu_facts()
    if facts is not None and facts["model_name"]:
        return facts["model_name"]
    return platform.processor() or platform.machine()


def _peak_tbps(device: torch.device) -> float | None:
    """The datasheet bandwidth of the GPU this runs on, where it is one of PEAK_TBPS's."""
    if device.type != "cuda":
        return None
    name = device_name(device).upper().replace(" ", "")
    return next((tbps for gpu, tbps in PEAK_TBPS.items() if gpu in name), None)


def pct_of_peak(gbps: float, device: torch.device) -> float | None:
    """Our effective bandwidth as a % of the running GPU's datasheet peak (None on a CPU or an
    unlisted GPU)."""
    peak = _peak_tbps(device)
    return None if peak is None else 100.0 * gbps / (peak * 1e3)
