"""The ``qwen4exp-table`` command (``python -m qwen4exp_ext.tables.cli``): pack a PLE layer's
table from a safetensors checkpoint into a table file, verify one, or print its header::

    qwen4exp-table pack --config config.json --layer L [--prefix P] [--dtype D] -o OUT CKPT...
    qwen4exp-table verify --config config.json --layer L [--prefix P] TABLE CKPT...
    qwen4exp-table info TABLE
    qwen4exp-table pack-model [--prefix TEMPLATE] [--dtype D] -o OUT_DIR CHECKPOINT_DIR
    qwen4exp-table verify-model [--prefix TEMPLATE] CHECKPOINT_DIR TABLE_DIR

The work is :mod:`qwen4exp_ext.tables.pack`'s (:func:`~qwen4exp_ext.tables.pack.pack_table`,
:func:`~qwen4exp_ext.tables.pack.verify_table`) and, for a whole model's directory,
:mod:`qwen4exp_ext.tables.pack_model`'s; this module parses the arguments, prints the progress
lines (stdout) and turns a failure into one error line (stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict

from qwen4exp_ext import layout
from qwen4exp_ext.tables.file_format import TableFileError, read_header
from qwen4exp_ext.tables.pack import pack_table, verify_table
from qwen4exp_ext.tables.pack_model import PREFIX_TEMPLATES, pack_model, verify_model

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qwen4exp-table",
        description="Pack a PLE layer's table from a safetensors checkpoint into a table file "
        "(served from disk), verify one, or show its header; or pack and verify every PLE layer "
        "of a model directory at once (pack-model, verify-model).",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def layer_arguments(command: argparse.ArgumentParser) -> None:
        command.add_argument(
            "--config", required=True, help="the model's HF config.json (its text_config)"
        )
        command.add_argument(
            "--layer", required=True, type=_layer, help="dense PLE layer index L (0 = first)"
        )
        command.add_argument(
            "--prefix",
            default="",
            help="the layer's checkpoint name prefix, stripped (e.g. model.layers.3.ple.)",
        )

    pack = commands.add_parser("pack", help="write a table file from a checkpoint")
    layer_arguments(pack)
    pack.add_argument(
        "--dtype", default=None, help="the table format (default: the checkpoint's rows')"
    )
    pack.add_argument("-o", "--output", required=True, help="the table file to write")
    pack.add_argument("checkpoint", nargs="+", help=".safetensors files or directories")

    verify = commands.add_parser("verify", help="compare a table file with its checkpoint")
    layer_arguments(verify)
    verify.add_argument("table", help="the table file")
    verify.add_argument("checkpoint", nargs="+", help=".safetensors files or directories")

    info = commands.add_parser("info", help="print a table file's header (validated)")
    info.add_argument("table", help="the table file")

    def model_arguments(command: argparse.ArgumentParser) -> None:
        command.add_argument(
            "--prefix",
            default=None,
            metavar="TEMPLATE",
            help="the PLE embeddings' checkpoint name prefix, {layer} standing for the decoder "
            "layer (zero-based); default: the first of "
            + ", ".join(PREFIX_TEMPLATES)
            + " that the checkpoint has",
        )

    pack_model = commands.add_parser(
        "pack-model",
        help="pack every PLE layer of a checkpoint directory into OUT_DIR/ple<L>.q4xt "
        "(resumable: a layer whose file verifies is skipped)",
    )
    model_arguments(pack_model)
    pack_model.add_argument(
        "--dtype", default=None, help="the tables' format (default: the checkpoint's rows')"
    )
    pack_model.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="OUT_DIR",
        help="the table directory (created if missing)",
    )
    pack_model.add_argument(
        "checkpoint_dir",
        metavar="CHECKPOINT_DIR",
        help="the model directory: config.json, *.safetensors",
    )

    verify_model = commands.add_parser(
        "verify-model", help="compare every PLE layer's table file with the checkpoint directory"
    )
    model_arguments(verify_model)
    verify_model.add_argument(
        "checkpoint_dir",
        metavar="CHECKPOINT_DIR",
        help="the model directory: config.json, *.safetensors",
    )
    verify_model.add_argument(
        "table_dir", metavar="TABLE_DIR", help="the table directory (ple<L>.q4xt files)"
    )
    return parser


def _layer(text: str) -> int:
    """--layer: an integer in [0, layout.MAX_LAYER_INDEX] (argparse names the option)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    try:
        return layout.check_layer_index(value, "it")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("it ")) from None


def _progress(line: str) -> None:
    print(line, flush=True)  # one line as each layer is done, also into a pipe


def main(argv: Sequence[str] | None = None) -> int:
    """The ``qwen4exp-table`` command: 0 on success, 1 with a one-line error on failure
    (argparse exits 2 on bad usage)."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "pack":
            header = pack_table(
                args.checkpoint, args.output, args.config, args.layer, args.dtype, args.prefix
            )
            print(
                f"wrote {args.output}: PLE layer {header.layer_index}, {header.format}, "
                f"{header.num_rows} rows x {header.head_dim}, {header.file_bytes} bytes"
            )
        elif args.command == "verify":
            counts = verify_table(args.table, args.checkpoint, args.config, args.layer, args.prefix)
            print(
                f"{args.table}: OK, {counts['rows']} rows ({counts['bytes']} bytes) equal the "
                f"checkpoint's"
            )
        elif args.command == "pack-model":
            start = time.monotonic()
            done = pack_model(args.checkpoint_dir, args.output, args.dtype, args.prefix, _progress)
            packed = sum(result.action != "skipped" for result in done)
            print(
                f"{args.output}: {len(done)} PLE layers, {packed} packed, "
                f"{len(done) - packed} skipped, "
                f"{sum(r.header.file_bytes for r in done)} bytes, "
                f"{time.monotonic() - start:.2f} s"
            )
        elif args.command == "verify-model":
            done = verify_model(args.checkpoint_dir, args.table_dir, args.prefix, _progress)
            print(f"{args.table_dir}: OK, {len(done)} PLE layers equal the checkpoint's")
        else:
            header = read_header(args.table)
            print(json.dumps({**asdict(header), "file_bytes": header.file_bytes}, indent=1))
    except (TableFileError, ValueError, OSError) as error:
        message = " ".join(str(error).split())
        print(f"qwen4exp-table: error: {message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
