#!/usr/bin/env python3
"""Issue #49's GPU check of the shared table (prepared for a lent GPU; needs a CUDA/ROCm build):
the zero-copy lookup from a table file's shared, host-registered mapping
(``SharedTable.device_rows``) against the same lookup from a private pinned table
(``pinned_host_table``), equal bit for bit, each timed beside a host-to-device copy of the
rows it returns (what the CPU-staged lookups move instead), as a % of that copy.

    python tools/shared_gpu_check.py --rows-base 2000000 --dir /var/tmp

Prints one line per batch size (tokens): microseconds of each and the % of the H2D copy.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from startup_figure import LAYER_INDEX, config  # noqa: E402

from qwen4exp_ext import ops  # noqa: E402
from qwen4exp_ext.layers import NGramEmbedding  # noqa: E402
from qwen4exp_ext.tables.host_memory import device_view, pinned_host_table  # noqa: E402
from qwen4exp_ext.tables.shared import SHM_DIR, open_shared_table  # noqa: E402
from qwen4exp_ext.vllm.table_dir import node_shared_table  # noqa: E402


def timed_us(fn, repeat: int) -> float:
    """Median microseconds of ``fn`` on the current stream (CUDA events)."""
    fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return sorted(times)[len(times) // 2]


def one_batch(shared, private, tokens: int, heads: int, repeat: int) -> str:
    """The line of one batch size: the two lookups checked equal, then timed."""
    ids = torch.randint(0, private.shape[0], (tokens, heads), device="cuda")
    got = ops.gather_rows(shared, ids)
    if not torch.equal(got, ops.gather_rows(private, ids)):
        raise SystemExit(f"tokens={tokens}: the shared lookup differs from the pinned one")
    host = torch.empty(got.shape, dtype=got.dtype, pin_memory=True)
    us_shared = timed_us(lambda: ops.gather_rows(shared, ids, output=got), repeat)
    us_pinned = timed_us(lambda: ops.gather_rows(private, ids, output=got), repeat)
    us_copy = timed_us(lambda: got.copy_(host, non_blocking=True), repeat)
    return (
        f"{tokens:>8}{us_shared:>12.1f}{us_pinned:>12.1f}{us_copy:>10.1f}"
        f"{100 * us_shared / us_copy:>9.0f}%{100 * us_pinned / us_copy:>9.0f}%"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows-base", type=int, default=2_000_000)
    parser.add_argument("--embed-dim", type=int, default=256)
    parser.add_argument("--dir", type=Path, default=None, help="where the table file goes")
    parser.add_argument("--shm-dir", default=SHM_DIR)
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 8192])
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args(argv)
    cfg = config(args.rows_base, args.embed_dim)
    heads = cfg.heads_per_ngram * (cfg.ngram_size - 1)
    layer = NGramEmbedding(cfg, LAYER_INDEX, placement="cpu", dtype="bfloat16")
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape).to(torch.bfloat16))
    pinned = pinned_host_table(layer.num_rows, layer.head_dim, torch.bfloat16)
    pinned.copy_(layer.weight.detach())
    private = device_view(pinned)
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        path = Path(directory) / "ple1.q4xt"
        layer.save_table_file(path)
        del layer
        with open_shared_table(path, shm_dir=args.shm_dir) as table:
            size = table.header.file_bytes / 2**30
            print(f"{table!r}: {size:.2f} GiB, {torch.cuda.get_device_name()}")
            shared = table.header.value_view(table.device_rows())
            print(
                f"{'tokens':>8}{'shared us':>12}{'pinned us':>12}{'H2D us':>10}"
                f"{'shared %':>10}{'pinned %':>10}"
            )
            for tokens in args.tokens:
                print(one_batch(shared, private, tokens, heads, args.repeat))
            # vLLM's pinned weight on rank 1 of 2: its rows of the node's registered mapping
            # (the copy staged above: a second user of it, as another rank of the node).
            vllm_rank_lines(table.header, path, private, heads, args)


def vllm_rank_lines(header, path: Path, private, heads: int, args) -> None:
    start = header.num_rows // 2
    rank = node_shared_table(path, header, start, header.num_rows - start, shm_dir=args.shm_dir)
    try:
        registered = rank.registered_rows()[start:]
        weight = device_view(header.value_view(registered))
        print(f"vLLM rank 1 of 2: rows [{start}, {header.num_rows}) of {rank!r}")
        for tokens in args.tokens:
            print(one_batch(weight, private[start:], tokens, heads, args.repeat))
        del registered, weight
    finally:
        rank.close()


if __name__ == "__main__":
    main(sys.argv[1:])
