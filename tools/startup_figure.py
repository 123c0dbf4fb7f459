#!/usr/bin/env python3
"""The start-up figure of issue #49: time to a ready PLE layer from a safetensors checkpoint
against from a packed table file (mapped where it is; shared through a /dev/shm copy, by the
process that stages it and by one that finds it staged).

"Ready" is: the layer constructed, its table where it reads it, and one lookup done (so a
layer that defers work to its first lookup pays for it). Each way is timed cold (the files'
pages dropped from the page cache first, posix_fadvise: no root needed) and warm (just read).
Prints the table's size, the CPU (lscpu) and the disk the files are on; ``--json`` writes the
same as a JSON object (e.g. under results/).

    python tools/startup_figure.py --rows-base 2000000 --dir /var/tmp/startup

The layers timed are builders in LAYERS, each with its sources: ``ours`` (qwen4exp_ext's
NGramEmbedding: from safetensors, the file mapped, shared through /dev/shm) and ``vllm``
(``--layer vllm``: vLLM's own Qwen4Exp n-gram embedding, NVIDIA class, on the CPU, with the
plugin, built and loaded through vLLM's safetensors iterator: from safetensors, or with the
packed file's directory as its table directory, issue #49 item 1, where it maps the file and
skips the checkpoint's row shards). The vLLM layer sets up vLLM's one-process gloo group and
loads the plugin in this process: run it in a process of its own.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

from qwen4exp_ext.layers import NGramEmbedding
from qwen4exp_ext.tables.checkpoint import BUFFER_NAMES, SHARD_PREFIX, checkpoint_shard_rows
from qwen4exp_ext.tables.shared import SHM_DIR, open_shared_table

LAYER_INDEX = 1
SOURCES = ("safetensors", "file_mmap", "shared_first", "shared_later")


def config(rows_base: int, embed_dim: int) -> SimpleNamespace:
    """A Qwen4Exp text config with ~``rows_base`` rows per n-gram head."""
    return SimpleNamespace(
        vocab_size=151_936,
        ngram_size=3,
        heads_per_ngram=2,
        ple_embed_dim=embed_dim,
        ngram_vocab_size_base=rows_base,
        make_ngram_vocab_size_divisible_by=64,
        eos_token_id=5,
        seed=1234,
        split_ngram_parts=8,
    )


def write_inputs(cfg: SimpleNamespace, directory: Path, dtype: str) -> dict[str, Path]:
    """The same random table as a safetensors checkpoint (row shards, as released) and as a
    packed table file."""
    from safetensors.torch import save_file

    layer = NGramEmbedding(cfg, LAYER_INDEX, placement="cpu", dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for start in range(0, layer.num_rows, 1 << 20):
            rows = layer.weight[start : start + (1 << 20)]
            rows.copy_(torch.randn(rows.shape, generator=gen).to(rows.dtype))
    tensors = {name: getattr(layer, name) for name in BUFFER_NAMES}
    for shard in range(cfg.split_ngram_parts):
        start, count = checkpoint_shard_rows(layer.num_rows, cfg.split_ngram_parts, shard)
        tensors[f"{SHARD_PREFIX}{shard}.weight"] = layer.weight[start : start + count].clone()
    paths = {"safetensors": directory / "ple.safetensors", "file": directory / "ple1.q4xt"}
    save_file(tensors, paths["safetensors"])
    layer.save_table_file(paths["file"])
    return paths


def _batch(cfg: SimpleNamespace):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (64,), generator=gen)
    return ids, torch.tensor([0, 64], dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int64)


def ours(source: str, cfg, paths: dict[str, Path], dtype: str, shm_dir: str) -> Callable:
    """NGramEmbedding ready from ``source``: returns a function that closes what it opened."""
    batch = _batch(cfg)
    if source == "safetensors":
        layer = NGramEmbedding(cfg, LAYER_INDEX, placement="cpu", dtype=dtype)
        layer.load_safetensors([paths["safetensors"]])
        layer(*batch)
        return lambda: None
    shared = None
    path = paths["file"]
    if source.startswith("shared"):
        shared = open_shared_table(path, shm_dir=shm_dir)
        path = shared.path
    layer = NGramEmbedding(
        cfg, LAYER_INDEX, placement="file", dtype=dtype, table_path=path, table_reader="mmap"
    )
    layer(*batch)

    def close():
        layer.close_table()
        if shared is not None:
            shared.close()

    return close


VLLM_SOURCES = ("safetensors", "table_dir")
_VLLM_DTYPES = {"bfloat16": None, "float8_e4m3fn": "float8_e4m3fn"}  # ple_embedding_dtype


@functools.cache
def _vllm_process(store: str) -> None:
    """vLLM as a worker process has it: the plugin loaded, a one-rank gloo group (``store``:
    its rendezvous file, beside the table, removed with it)."""
    os.environ["VLLM_PLUGINS"] = "qwen4exp"
    import vllm.plugins
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    vllm.plugins.load_general_plugins()
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu"))):
        init_distributed_environment(1, 0, "file://" + store, 0, "gloo")
        initialize_model_parallel(1, 1)


def vllm_layer(source: str, cfg, paths: dict[str, Path], dtype: str, shm_dir: str) -> Callable:
    """vLLM's Qwen4Exp n-gram embedding ready from ``source`` (built, loaded from the
    checkpoint through vLLM's safetensors iterator, one lookup done)."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

    from qwen4exp_ext.vllm.table_dir import ADDITIONAL_CONFIG_KEY, layer_table

    if dtype not in _VLLM_DTYPES:
        raise ValueError(
            f"--layer vllm: --dtype must be one of {sorted(_VLLM_DTYPES)}, got {dtype!r}"
        )
    _vllm_process(str(paths["file"].parent / "vllm-store"))
    additional = {}
    if source == "table_dir":
        additional = {ADDITIONAL_CONFIG_KEY: str(paths["file"].parent)}
    current = VllmConfig(device_config=DeviceConfig("cpu"), additional_config=additional)
    text = SimpleNamespace(**vars(cfg), ple_embedding_dtype=_VLLM_DTYPES[dtype])
    with set_current_vllm_config(current), torch.device("cpu"):
        embedding = Qwen4ExpNGramEmbedding(
            text,
            cfg.ple_embed_dim,
            LAYER_INDEX,
            64,
            data_parallel_rank=0,
            prefix="ple",
            params_dtype=torch.bfloat16,
        )
    embedding.load_weights(safetensors_weights_iterator([str(paths["safetensors"])], False))
    if (layer_table(embedding) is None) != (source == "safetensors"):
        raise RuntimeError(f"vLLM's embedding from {source}: the plugin did not do what was asked")
    rows = embedding.ngram_embedding.weight.shape[0]
    ids = torch.randint(0, rows, (64, embedding.ngram_heads), generator=torch.Generator())
    with torch.no_grad():
        embedding.ngram_embedding(ids)
    return lambda: None  # the table (or its mapping) goes with the module


LAYERS: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "ours": (ours, SOURCES),
    "vllm": (vllm_layer, VLLM_SOURCES),
}


def _drop_cache(paths) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def time_sources(
    cfg, paths, dtype: str, shm_dir: str, layer: str = "ours", repeat: int = 3
) -> dict:
    """Seconds to a ready layer from each source, cold and warm (the median of ``repeat``)."""
    build, sources = LAYERS[layer]
    times: dict[str, dict[str, float]] = {}
    for source in sources:  # untimed: imports and first calls are not the table's start-up
        build(source, cfg, paths, dtype, shm_dir)()
    for state in ("cold", "warm"):
        for source in sources:
            runs = []
            for _ in range(repeat):
                if state == "cold":
                    _drop_cache(paths.values())
                holder = None
                if source == "shared_later":  # another user of the node staged it already
                    holder = open_shared_table(paths["file"], shm_dir=shm_dir)
                start = time.perf_counter()
                close = build(source, cfg, paths, dtype, shm_dir)
                runs.append(time.perf_counter() - start)
                close()
                if holder is not None:
                    holder.close()
            times.setdefault(source, {})[state] = sorted(runs)[len(runs) // 2]
    return times


def _run(*command: str) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def machine(directory: Path) -> dict[str, str]:
    """The CPU (lscpu) and the disk and file system ``directory`` is on."""
    cpu = {}
    for line in _run("lscpu").splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("Model name", "CPU(s)", "Thread(s) per core", "L3"):
            cpu[key.strip()] = value.strip()
    source, fstype = (
        _run("findmnt", "-no", "SOURCE,FSTYPE", "-T", str(directory)).split() or ["?", "?"]
    )[:2]
    device = os.path.basename(os.path.realpath(source)).rstrip("0123456789")
    rotational = Path(f"/sys/block/{device}/queue/rotational")
    # As the kernel reports it: a VM's virtio disk says 1 whatever is behind it.
    kind = f"rotational={rotational.read_text().strip()}" if rotational.exists() else "?"
    return {
        "cpu": ", ".join(f"{k}: {v}" for k, v in cpu.items()),
        "disk": f"{source} ({fstype}, {kind})",
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows-base", type=int, default=200_000, help="rows per n-gram head")
    parser.add_argument("--embed-dim", type=int, default=256, help="ple_embed_dim")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--dir", type=Path, default=None, help="where the files go (a disk)")
    parser.add_argument("--shm-dir", default=SHM_DIR, help="where the shared copy is staged")
    parser.add_argument("--layer", default="ours", choices=sorted(LAYERS))
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure (median)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figure here")
    args = parser.parse_args(argv)
    cfg = config(args.rows_base, args.embed_dim)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="q4x-startup-") as directory:
        paths = write_inputs(cfg, Path(directory), args.dtype)
        table_bytes = os.path.getsize(paths["file"])
        times = time_sources(cfg, paths, args.dtype, args.shm_dir, args.layer, args.repeat)
        facts = machine(Path(directory))
    figure = {
        "layer": args.layer,
        "dtype": args.dtype,
        "table_bytes": table_bytes,
        "repeat": args.repeat,
        "seconds": times,
        **facts,
    }
    print(
        f"start-up to a ready PLE layer ({args.layer}), table {table_bytes / 2**20:.1f} MiB "
        f"{args.dtype}"
    )
    print(f"cpu: {facts['cpu']}")
    print(f"disk: {facts['disk']}")
    print(f"{'from':<14}{'cold s':>10}{'warm s':>10}")
    for source, by_state in times.items():
        print(f"{source:<14}{by_state['cold']:>10.4f}{by_state['warm']:>10.4f}")
    if args.json is not None:
        args.json.write_text(json.dumps(figure, indent=2) + "\n")
    return figure


if __name__ == "__main__":
    main(sys.argv[1:])
