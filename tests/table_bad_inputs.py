"""The bad-input tables of the table-file surface (issues #47, #49): ``qwen4exp-table`` (pack,
verify, info, pack-model, verify-model: every argument), ``NGramEmbedding(placement="file")`` and
``FileTable``.

A case overrides one argument of a valid baseline with one kind of mistake, and says the error
it must give; tests/test_table_bad_inputs.py runs each and checks that nothing is written or
left behind. The files a case needs (a FIFO, a directory, a truncated or foreign table...) are
made by :class:`World` in the test's tmp_path before the call.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import model_checkpoint
from lookup_support import CONFIG, NVFP4_CONFIG, make_embedding
from qwen4exp_ext.layers import NGramEmbedding
from qwen4exp_ext.tables.checkpoint import BUFFER_NAMES
from qwen4exp_ext.tables.file_format import HEADER_BYTES, MAGIC
from qwen4exp_ext.tables.pack import pack_table
from qwen4exp_ext.tables.pack_model import pack_model

LAYER = 1


class World:
    """A valid checkpoint (ckpt/model.safetensors, unsharded bf16 rows and the hash buffers of
    PLE layer 1), its config.json and its packed table (table.bin), and the bad files the cases
    ask for."""

    def __init__(self, root: Path) -> None:
        self.root = root
        module = make_embedding("bfloat16", "cpu", layer_index=LAYER)
        (root / "ckpt").mkdir()
        self.checkpoint = root / "ckpt" / "model.safetensors"
        state = {
            "ngram_embedding.weight": module.weight.detach().clone(),
            **{name: getattr(module, name).clone() for name in BUFFER_NAMES},
        }
        save_file(state, self.checkpoint)
        self.config = self.write_config(vars(CONFIG))
        self.table = root / "table.bin"
        pack_table([self.checkpoint], self.table, CONFIG, LAYER)
        self.output = root / "out.table"

    # --- things to pass -------------------------------------------------------------------------

    def path(self, name: str) -> str:
        return str(self.root / name)

    def fifo(self, name: str = "fifo") -> str:
        os.mkfifo(self.root / name)
        return self.path(name)

    def directory(self, name: str = "folder") -> str:
        (self.root / name).mkdir()
        return self.path(name)

    def file(self, name: str, data: bytes) -> str:
        (self.root / name).write_bytes(data)
        return self.path(name)

    def write_config(self, fields, name="config.json", wrap=True) -> str:
        text = json.dumps(
            {"architectures": ["Qwen4Exp"], "text_config": fields} if wrap else fields
        )
        return self.file(name, text.encode())

    def config_with(self, **changes) -> str:
        return self.write_config({**vars(CONFIG), **changes}, "changed.json")

    def config_without(self, name: str) -> str:
        fields = {k: v for k, v in vars(CONFIG).items() if k != name}
        return self.write_config(fields, "without.json")

    def table_of(self, layer_index=LAYER, dtype="bfloat16", config=CONFIG) -> str:
        """A real table file of another layer, format or width."""
        module = NGramEmbedding(config, layer_index, placement="cpu", dtype=dtype)
        path = self.root / f"other_{layer_index}_{dtype}.table"
        module.save_table_file(path)
        return str(path)

    def truncated(self) -> str:
        data = self.table.read_bytes()
        return self.file("truncated.table", data[:-3])

    def header_with(self, text: bytes | None = None, **changes) -> str:
        """table.bin with its header's JSON replaced (``text``, or its fields changed), under a
        valid checksum: only the fields can be wrong."""
        data = bytearray(self.table.read_bytes())
        length = struct.unpack_from("<I", data, 12)[0]
        if text is None:
            fields = json.loads(bytes(data[48 : 48 + length]))
            text = json.dumps({**fields, **changes}, sort_keys=True).encode()
        region = MAGIC + struct.pack("<II", 1, len(text)) + hashlib.sha256(text).digest() + text
        data[:HEADER_BYTES] = region.ljust(HEADER_BYTES, b"\0")
        return self.file("crafted.table", bytes(data))

    def nested_header(self) -> str:
        return self.header_with(text=b'{"scale":' + b"[" * 1800 + b"]" * 1800 + b"}")

    def link(self, target: Path, name: str, symbolic: bool) -> str:
        link = self.root / "ckpt" / name if not symbolic else self.root / name
        (link.symlink_to if symbolic else link.hardlink_to)(target)
        return str(link)

    # --- a model directory (pack-model, verify-model) -------------------------------------------

    def model(self) -> Path:
        """A valid model directory (tests/model_checkpoint.py), made on first use, and its
        packed table directory (self.tables)."""
        path = self.root / "model"
        if not path.exists():
            model_checkpoint.write_model(path)
            self.tables = self.root / "tables"
            pack_model(path, self.tables)
        return path

    def model_like(self, name: str = "other_model", config: dict | None = None, **kwargs) -> str:
        """Another model directory: write_model's ``kwargs``, then its config replaced."""
        path = model_checkpoint.write_model(self.root / name, **kwargs)
        if config is not None:
            model_checkpoint.write_config(path, config)
        return str(path)

    def model_config_with(self, **changes) -> str:
        return self.model_like(config=model_checkpoint.text_config(**changes))

    def model_config_without(self, name: str) -> str:
        fields = {k: v for k, v in model_checkpoint.text_config().items() if k != name}
        return self.model_like(config=fields)

    def model_without(self, *files: str) -> str:
        path = Path(self.model_like())
        for file in files:
            (path / file).unlink()
        return str(path)

    def model_plus(self, name: str, make) -> str:
        """A model directory with ``make(path)`` done at ``name`` in it."""
        path = Path(self.model_like())
        make(path / name)
        return str(path)

    def tables_with(self, layer: int, make) -> str:
        """A copy of the packed table directory with ``make(path)`` done to ple<layer>.q4xt."""
        copy = self.root / "tables_copy"
        copy.mkdir()
        for source in self.tables.iterdir():
            (copy / source.name).write_bytes(source.read_bytes())
        make(copy / f"ple{layer}.q4xt")
        return str(copy)

    def output_with(self, layer: int, make) -> str:
        """An output directory holding ``make(path)`` at ple<layer>.q4xt."""
        out = self.root / "out_dir"
        out.mkdir()
        make(out / f"ple{layer}.q4xt")
        return str(out)


# --- qwen4exp-table ---------------------------------------------------------------------------

# A baseline per command: the arguments of a call that succeeds.
COMMANDS = ("pack", "verify", "info", "pack-model", "verify-model")
MODEL_COMMANDS = ("pack-model", "verify-model")


def baseline(world: World, command: str) -> dict:
    if command in MODEL_COMMANDS:
        return {
            "checkpoint_dir": str(world.model()),
            "output": world.path("new_tables"),
            "table_dir": str(world.tables),
            "prefix": None,
            "dtype": None,
        }
    return {
        "config": world.config,
        "layer": str(LAYER),
        "prefix": "",
        "dtype": None,
        "output": str(world.output),
        "checkpoint": [str(world.root / "ckpt")],
        "table": str(world.table),
    }


OMIT = "<omitted>"  # an argument left off the command line


def argv(command: str, args: dict) -> list[str]:
    """The command line of ``command`` with ``args`` (those that are OMIT left off)."""

    def option(flag: str, name: str) -> list[str]:
        return [] if args[name] in (OMIT, None) else [flag, args[name]]

    def positional(name: str) -> list[str]:
        value = args[name]
        return [] if value == OMIT else list(value) if isinstance(value, list) else [value]

    if command == "info":
        return ["info", *positional("table")]
    if command == "pack-model":
        line = [command, *option("--prefix", "prefix"), *option("--dtype", "dtype")]
        return [*line, *option("-o", "output"), *positional("checkpoint_dir")]
    if command == "verify-model":
        line = [command, *option("--prefix", "prefix"), *positional("checkpoint_dir")]
        return [*line, *positional("table_dir")]
    line = [command, *option("--config", "config"), *option("--layer", "layer")]
    line += option("--prefix", "prefix")
    if command == "pack":
        line += option("--dtype", "dtype") + option("-o", "output")
        return [*line, *positional("checkpoint")]
    return [*line, *positional("table"), *positional("checkpoint")]


def cli(case_id, arg, value, match, code=1, commands=("pack", "verify")):
    """Cases of one argument: ``value(world)`` replaces it in each of ``commands``; the command
    exits with ``code`` and prints one error line matching ``match``."""
    return [
        pytest.param(command, arg, value, match, code, id=f"{command}-{arg}-{case_id}")
        for command in commands
    ]


def _c(changes):
    return lambda w: w.config_with(**changes)


# --- pack-model, verify-model: a model directory (config.json, *.safetensors) ----------------

M = MODEL_COMMANDS
PLE1 = "PLE layer 1 .decoder layer 3.: "
SAFETENSORS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
_LAYER2 = r"'model\.language_model\.layers\.4\.ple\.ple_embedding\.'"


def _mc(**changes):
    return lambda w: w.model_config_with(**changes)


def _fifo(path):
    os.mkfifo(path)


def _flip_last_byte(path):
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))


MODEL_CASES = [
    # left off (argparse)
    *cli("omitted", "checkpoint_dir", lambda w: OMIT, "arguments are required: CHECKPOINT_DIR", 2,
         commands=("pack-model",)),
    *cli("omitted", "output", lambda w: OMIT, "arguments are required: -o/--output", 2,
         commands=("pack-model",)),
    *cli("omitted", "table_dir", lambda w: OMIT, "arguments are required: TABLE_DIR", 2,
         commands=("verify-model",)),
    # the checkpoint directory itself
    *cli("missing", "checkpoint_dir", lambda w: w.path("absent"),
         "absent: no such checkpoint directory", commands=M),
    *cli("fifo", "checkpoint_dir", lambda w: w.fifo(),
         "fifo: the checkpoint directory is a FIFO, not a directory", commands=M),
    *cli("file", "checkpoint_dir", lambda w: str(w.checkpoint),
         "model.safetensors: the checkpoint directory is a file, not a directory", commands=M),
    *cli("dev-zero", "checkpoint_dir", lambda w: "/dev/zero",
         "/dev/zero: the checkpoint directory is a special file, not a directory", commands=M),
    # its config.json
    *cli("no-config", "checkpoint_dir", lambda w: w.model_without("config.json"),
         "other_model/config.json: no such config file", commands=M),
    *cli("config-fifo", "checkpoint_dir",
         lambda w: w.model_plus("config.json", lambda p: p.unlink() or _fifo(p)),
         "config.json: the config is a FIFO, not a regular file", commands=M),
    *cli("config-not-json", "checkpoint_dir",
         lambda w: w.model_plus("config.json", lambda p: p.write_bytes(b"{")),
         "config.json: the config is not JSON", commands=M),
    *cli("config-field", "checkpoint_dir", _mc(ngram_size="3"),
         'config.json: ngram_size must be an integer, got "3"', commands=M),
    *cli("no-ple-layers", "checkpoint_dir", lambda w: w.model_config_without("ple_layer_ids"),
         r"config.json: the config has no PLE layers \(ple_layer_ids is empty\)", commands=M),
    *cli("empty-ple-layers", "checkpoint_dir", _mc(ple_layer_ids=[]),
         "config.json: the config has no PLE layers", commands=M),
    *cli("ple-layers-string", "checkpoint_dir", _mc(ple_layer_ids="2"),
         "config.json: ple_layer_ids must be a list of integers, got '2'", commands=M),
    *cli("ple-layer-zero", "checkpoint_dir", _mc(ple_layer_ids=[2, 0]),
         r"ple_layer_ids must hold one-indexed decoder layer ids \(integers >= 1\), got 0",
         commands=M),
    *cli("ple-layer-bool", "checkpoint_dir", _mc(ple_layer_ids=[True]),
         "ple_layer_ids must hold one-indexed decoder layer ids .*, got True", commands=M),
    *cli("ple-layer-float", "checkpoint_dir", _mc(ple_layer_ids=[2.0]),
         "ple_layer_ids must hold one-indexed decoder layer ids .*, got 2.0", commands=M),
    *cli("ple-layer-past-end", "checkpoint_dir", _mc(ple_layer_ids=[2, 7]),
         "config.json: ple_layer_ids 7 is past num_hidden_layers = 6", commands=M),
    *cli("other-seed", "checkpoint_dir", _mc(seed=8),
         "layer_multipliers .* is not the config's layout of PLE layer 0", commands=M),
    # its safetensors
    *cli("no-safetensors", "checkpoint_dir",
         lambda w: w.model_without(*SAFETENSORS),
         "no .safetensors files in the directory", commands=M),
    *cli("safetensors-fifo", "checkpoint_dir", lambda w: w.model_plus("x.safetensors", _fifo),
         "x.safetensors: the checkpoint file is a FIFO, not a regular file", commands=M),
    *cli("not-safetensors", "checkpoint_dir",
         lambda w: w.model_plus("x.safetensors", lambda p: p.write_bytes(b"junk")),
         "x.safetensors: not a readable safetensors file", commands=M),
    *cli("a-layer-missing", "checkpoint_dir", lambda w: w.model_like(skip_layers=(2,)),
         "no PLE table rows .* under prefix " + _LAYER2, commands=M),
    *cli("other-names", "checkpoint_dir", lambda w: w.model_like(template="x.{layer}."),
         r"no table of PLE layer 0 \(decoder layer 1\) under model.language_model.layers.1.ple."
         r"ple_embedding. or model.layers.1.ple.ple_embedding.: give .* --prefix", commands=M),
    # --prefix
    *cli("no-placeholder", "prefix", lambda w: "model.layers.1.ple.ple_embedding.",
         "--prefix 'model.layers.1.ple.ple_embedding.' has no {layer}", commands=M),
    *cli("other", "prefix", lambda w: "x.{layer}.", "no PLE table rows .* under prefix 'x.1.'",
         commands=M),
    # --dtype (pack-model)
    *cli("unknown", "dtype", lambda w: "fp7", "unsupported table dtype 'fp7'",
         commands=("pack-model",)),
    *cli("other", "dtype", lambda w: "float16", "dtype mismatch: the table was asked for as "
         "float16", commands=("pack-model",)),
    # -o/--output (pack-model): a directory, not inside the checkpoint's scan, each layer's name
    # a regular file (or nothing) and none a checkpoint file
    *cli("file", "output", lambda w: str(w.table),
         "table.bin: the output directory is a file, not a directory", commands=("pack-model",)),
    *cli("fifo", "output", lambda w: w.fifo(),
         "fifo: the output directory is a FIFO, not a directory", commands=("pack-model",)),
    *cli("no-parent", "output", lambda w: w.path("absent/tables"),
         "tables: the output directory's parent .*absent does not exist",
         commands=("pack-model",)),
    *cli("in-checkpoint-scan", "output", lambda w: str(w.model() / "tables.safetensors"),
         r"inside the checkpoint directory .*model, named like its files \(\*.safetensors\)",
         commands=("pack-model",)),
    *cli("layer-is-directory", "output", lambda w: w.output_with(1, Path.mkdir),
         "ple1.q4xt: the output is a directory, not a regular file", commands=("pack-model",)),
    *cli("layer-is-fifo", "output", lambda w: w.output_with(2, _fifo),
         "ple2.q4xt: the output is a FIFO, not a regular file", commands=("pack-model",)),
    *cli("layer-is-checkpoint", "output", lambda w: w.output_with(
         0, lambda p: p.symlink_to(w.model() / "model-00002-of-00002.safetensors")),
         "ple0.q4xt: the output is the checkpoint file .*model-00002-of-00002.safetensors",
         commands=("pack-model",)),
    # the table directory (verify-model)
    *cli("missing", "table_dir", lambda w: w.path("absent"), "absent: no such table directory",
         commands=("verify-model",)),
    *cli("file", "table_dir", lambda w: str(w.table), "table.bin: the table directory is a file",
         commands=("verify-model",)),
    *cli("fifo", "table_dir", lambda w: w.fifo(), "fifo: the table directory is a FIFO",
         commands=("verify-model",)),
    *cli("layer-missing", "table_dir", lambda w: w.tables_with(1, Path.unlink),
         PLE1 + ".*ple1.q4xt: no such table file", commands=("verify-model",)),
    *cli("layer-differs", "table_dir", lambda w: w.tables_with(1, _flip_last_byte),
         PLE1 + ".*ple1.q4xt: row .* differs from the checkpoint's", commands=("verify-model",)),
    *cli("layer-truncated", "table_dir",
         lambda w: w.tables_with(1, lambda p: p.write_bytes(p.read_bytes()[:-3])),
         PLE1 + ".*ple1.q4xt: truncated table file", commands=("verify-model",)),
    *cli("layer-of-another", "table_dir",
         lambda w: w.tables_with(1, lambda p: p.write_bytes((w.tables / "ple0.q4xt").read_bytes())),
         PLE1 + ".*the table file is PLE layer 0's, expected layer 1's",
         commands=("verify-model",)),
    *cli("layer-fifo", "table_dir", lambda w: w.tables_with(1, lambda p: p.unlink() or _fifo(p)),
         PLE1 + ".*ple1.q4xt: the table file is a FIFO", commands=("verify-model",)),
]  # fmt: skip

NOT_REGULAR = "is a {}, not a regular file"
REQUIRED = "the following arguments are required: "
CLI_CASES = [
    # left off (argparse)
    *cli("omitted", "config", lambda w: OMIT, REQUIRED + "--config", 2),
    *cli("omitted", "layer", lambda w: OMIT, REQUIRED + "--layer", 2),
    *cli("omitted", "output", lambda w: OMIT, REQUIRED + "-o/--output", 2, commands=("pack",)),
    *cli("omitted", "checkpoint", lambda w: OMIT, REQUIRED + "checkpoint", 2),
    *cli("omitted", "table", lambda w: OMIT, REQUIRED + "table", 2, commands=("info",)),
    # --config: the file, then each field's JSON type and range
    *cli("missing", "config", lambda w: w.path("absent.json"), "absent.json: no such config file"),
    *cli("fifo", "config", lambda w: w.fifo(), "fifo: the config " + NOT_REGULAR.format("FIFO")),
    *cli("directory", "config", lambda w: w.directory(), "the config is a directory, not a"),
    *cli("dev-zero", "config", lambda w: "/dev/zero", "/dev/zero: the config is a character"),
    *cli("not-utf8", "config", lambda w: w.file("c.json", b'{"a": "\xff"}'), "c.json: the "
         "config is not UTF-8"),
    *cli("not-json", "config", lambda w: w.file("c.json", b"{"), "c.json: the config is not JSON"),
    *cli("too-deep", "config", lambda w: w.file("c.json", b"[" * 100000),
         "c.json: the config is not JSON"),
    *cli("not-object", "config", lambda w: w.file("c.json", b"[1]"), "not a JSON object"),
    *cli("text-config-list", "config", lambda w: w.write_config({"text_config": [1]}, wrap=False),
         r"config.json: text_config must be a JSON object, got \[1\]"),
    *cli("text-config-null", "config", lambda w: w.write_config(None),
         "config.json: text_config must be a JSON object, got null"),
    *cli("field-missing", "config", lambda w: w.config_without("ngram_size"),
         "without.json: the config has no ngram_size"),
    *cli("field-null", "config", _c({"vocab_size": None}),
         "changed.json: vocab_size must be an integer, got null"),
    *cli("field-string", "config", _c({"ngram_size": "3"}),
         'changed.json: ngram_size must be an integer, got "3"'),
    *cli("field-list", "config", _c({"heads_per_ngram": [2]}),
         r"heads_per_ngram must be an integer, got \[2\]"),
    *cli("field-float", "config", _c({"ple_embed_dim": 24.5}),
         "ple_embed_dim must be an integer, got 24.5"),
    *cli("field-bool", "config", _c({"make_ngram_vocab_size_divisible_by": True}),
         "make_ngram_vocab_size_divisible_by must be an integer, got true"),
    *cli("field-object", "config", _c({"ngram_vocab_size_base": {"a": 1}}),
         'ngram_vocab_size_base must be an integer, got {"a": 1}'),
    *cli("field-zero", "config", _c({"vocab_size": 0}), r"vocab_size must be in \[1, "),
    *cli("field-range", "config", _c({"ngram_size": 9}), r"ngram_size must be in \[2, 8\], got 9"),
    *cli("field-huge", "config", _c({"ngram_vocab_size_base": 2**64}),
         r"ngram_vocab_size_base must be in \[2, "),
    *cli("heads-zero", "config", _c({"heads_per_ngram": 0}), r"heads_per_ngram must be in \[1, "),
    *cli("heads-too-many", "config", _c({"heads_per_ngram": 1000}),
         r"\(ngram_size - 1\) \* heads_per_ngram .* at most 1024"),
    *cli("width", "config", _c({"ple_embed_dim": 25}),
         "ple_embed_dim must be divisible by the number of n-gram heads"),
    *cli("seed-type", "config", _c({"seed": "x"}),
         'changed.json: seed must be an integer, got "x"'),
    *cli("parts-zero", "config", _c({"split_ngram_parts": 0}),
         r"split_ngram_parts must be in \[1, "),
    # --layer
    *cli("not-int", "layer", lambda w: "x", "argument --layer: must be an integer, got 'x'", 2),
    *cli("negative", "layer", lambda w: "-1", "argument --layer: must be >= 0, got -1", 2),
    *cli("huge", "layer", lambda w: "1000000", "argument --layer: must be <= 1023, got 1000000", 2),
    *cli("int64", "layer", lambda w: str(2**63), f"argument --layer: must be <= 1023, got {2**63}",
         2),
    *cli("other-layer", "layer", lambda w: "0", "is not the config's layout of PLE layer 0"),
    # --prefix
    *cli("other", "prefix", lambda w: "model.x.", "no PLE table rows .* under prefix 'model.x.'"),
    # --dtype (pack)
    *cli("float64", "dtype", lambda w: "float64", "unsupported table dtype torch.float64",
         commands=("pack",)),
    *cli("unknown", "dtype", lambda w: "fp7", "unsupported table dtype 'fp7'", commands=("pack",)),
    *cli("other", "dtype", lambda w: "float16", "dtype mismatch: the table was asked for as "
         "float16", commands=("pack",)),
    # -o/--output (pack): never an input, nothing but a regular file
    *cli("same-file", "output", lambda w: str(w.checkpoint), "the output is the checkpoint file",
         commands=("pack",)),
    *cli("hard-link", "output", lambda w: w.link(w.checkpoint, "again.bin", False),
         "the output is the checkpoint file .*model.safetensors", commands=("pack",)),
    *cli("symlink", "output", lambda w: w.link(w.checkpoint, "link.table", True),
         "the output is the checkpoint file .*model.safetensors", commands=("pack",)),
    *cli("in-input-dir", "output", lambda w: w.path("ckpt/new.safetensors"),
         r"inside the checkpoint directory .*ckpt whose scan reads \*.safetensors",
         commands=("pack",)),
    *cli("no-dir", "output", lambda w: w.path("absent/t.table"), "the directory .*absent does not "
         "exist", commands=("pack",)),
    *cli("directory", "output", lambda w: w.directory(), "folder: the output is a directory, not "
         "a regular file", commands=("pack",)),
    *cli("fifo", "output", lambda w: w.fifo(), "fifo: the output is a FIFO, not a regular file",
         commands=("pack",)),
    # the checkpoint files
    *cli("missing", "checkpoint", lambda w: [w.path("absent")], "absent: no such checkpoint file"),
    *cli("fifo", "checkpoint", lambda w: [w.fifo()], "fifo: the checkpoint file is a FIFO"),
    *cli("fifo-in-dir", "checkpoint", lambda w: [w.fifo("ckpt/x.safetensors") and w.path("ckpt")],
         "x.safetensors: the checkpoint file is a FIFO, not a regular file"),
    *cli("dev-zero", "checkpoint", lambda w: ["/dev/zero"], "/dev/zero: the checkpoint file is a "
         "character device"),
    *cli("empty-dir", "checkpoint", lambda w: [w.directory()], "no .safetensors files in"),
    *cli("empty-file", "checkpoint", lambda w: [w.file("e.safetensors", b"")],
         "e.safetensors: not a readable safetensors file"),
    *cli("not-safetensors", "checkpoint", lambda w: [w.config], "not a readable safetensors file"),
    # the table file (verify, info)
    *cli("missing", "table", lambda w: w.path("absent.table"), "absent.table: no such table file",
         commands=("verify", "info")),
    *cli("fifo", "table", lambda w: w.fifo(), "fifo: the table file is a FIFO, not a regular file",
         commands=("verify", "info")),
    *cli("directory", "table", lambda w: w.directory(), "the table file is a directory",
         commands=("verify", "info")),
    *cli("dev-zero", "table", lambda w: "/dev/zero", "/dev/zero: the table file is a character "
         "device", commands=("verify", "info")),
    *cli("empty", "table", lambda w: w.file("e.table", b""), "e.table: not a qwen4exp table file",
         commands=("verify", "info")),
    *cli("truncated", "table", World.truncated, "truncated.table: truncated table file",
         commands=("verify", "info")),
    *cli("foreign", "table", lambda w: str(w.checkpoint), "model.safetensors: not a qwen4exp "
         "table file", commands=("verify", "info")),
    *cli("other-layer", "table", lambda w: w.table_of(layer_index=0),
         "the table file is PLE layer 0's, expected layer 1's", commands=("verify",)),
    *cli("other-format", "table", lambda w: w.table_of(dtype="float16"),
         "format .dtype. is float16, expected bfloat16", commands=("verify",)),
    *cli("nested-header", "table", World.nested_header, r"crafted.table: corrupted table file "
         r"header \(too deeply nested\)", commands=("verify", "info")),
    *cli("huge-rows", "table", lambda w: w.header_with(num_rows=10**30),
         "num_rows must be a non-negative integer below 2\\*\\*63, got 10{30}",
         commands=("verify", "info")),
    *cli("huge-scale", "table", lambda w: w.header_with(format="float8_e4m3fn", row_bytes=6,
         scale=10**400), "scale must be finite, got 1000000.*\\.\\.\\.", commands=("info",)),
    *cli("no-rows", "table", lambda w: w.header_with(num_rows=0), "num_rows must be positive",
         commands=("verify", "info")),
    *MODEL_CASES,
]  # fmt: skip


# --- NGramEmbedding(placement="file") and FileTable ---------------------------------------------


def embedding_baseline(world: World, reader: str) -> dict:
    return {
        "config": CONFIG,
        "layer_index": LAYER,
        "placement": "file",
        "table_path": str(world.table),
        "dtype": "bfloat16",
        "table_reader": reader,
        "io_threads": 0,
    }


def emb(case_id, arg, value, match, exc=(ValueError, TypeError)):
    return pytest.param(arg, value, match, exc, id=f"{arg}-{case_id}")


FILE_FAULTS = [
    emb("missing", "table_path", lambda w: w.path("absent"), "absent: no such table file",
        FileNotFoundError),
    emb("fifo", "table_path", lambda w: w.fifo(), "fifo: the table file is a FIFO, not a regular"),
    emb("directory", "table_path", lambda w: w.directory(),
        "folder: the table file is a directory"),
    emb("dev-zero", "table_path", lambda w: "/dev/zero", "/dev/zero: the table file is a character "
        "device"),
    emb("empty", "table_path", lambda w: w.file("e.table", b""), "e.table: not a qwen4exp table"),
    emb("truncated", "table_path", World.truncated, "truncated.table: truncated table file"),
    emb("foreign", "table_path", lambda w: str(w.checkpoint), "not a qwen4exp table file"),
    emb("nested-header", "table_path", World.nested_header, "corrupted table file header"),
    emb("huge-rows", "table_path", lambda w: w.header_with(num_rows=10**30),
        "num_rows must be a non-negative integer below"),
]  # fmt: skip

EMBEDDING_CASES = [
    *FILE_FAULTS,
    emb("none", "table_path", lambda w: None, "placement='file' needs table_path"),
    emb("int", "table_path", lambda w: 5, "table_path must be a path .str or os.PathLike., got 5"),
    emb("other-layer", "table_path", lambda w: w.table_of(layer_index=0),
        "the table file is PLE layer 0's, expected layer 1's"),
    emb("other-format", "table_path", lambda w: w.table_of(dtype="float16"),
        "format .dtype. is float16, expected bfloat16"),
    emb("other-width", "table_path", lambda w: w.table_of(config=NVFP4_CONFIG),
        "rows are 32 wide .head_dim., expected 6"),
    emb("no-rows", "table_path", lambda w: w.header_with(num_rows=0), "num_rows must be positive"),
    emb("unknown", "table_reader", lambda w: "aio", "table_reader must be one of"),
    emb("none", "table_reader", lambda w: None, "table_reader must be one of"),
    emb("negative", "io_threads", lambda w: -1, r"io_threads must be an integer in \[0, 1024\] .*"
        "got -1"),
    emb("int64", "io_threads", lambda w: 2**63, rf"io_threads must be .*, got {2**63}"),
    emb("huge", "io_threads", lambda w: 1025, r"io_threads must be .*\[0, 1024\] .*got 1025"),
    emb("string", "io_threads", lambda w: "4", "io_threads must be an integer .*, got '4'"),
    emb("float", "io_threads", lambda w: 1.5, "io_threads must be an integer .*, got 1.5"),
    emb("bool", "io_threads", lambda w: True, "io_threads must be an integer .*, got True"),
    emb("negative", "layer_index", lambda w: -1, "layer_index must be >= 0, got -1"),
    emb("huge", "layer_index", lambda w: 10**6, "layer_index must be <= 1023, got 1000000"),
    emb("int64", "layer_index", lambda w: 2**63, f"layer_index must be <= 1023, got {2**63}"),
    emb("string", "layer_index", lambda w: "1", "layer_index must be an integer, got '1'"),
    emb("float", "layer_index", lambda w: 1.0, "layer_index must be an integer, got 1.0"),
    emb("float64", "dtype", lambda w: torch.float64, "unsupported table dtype torch.float64"),
    emb("cuda", "device", lambda w: "cuda", "reads the table with the CPU"),
]  # fmt: skip

# FileTable(path, expected=None, ...): the file on its own (what NGramEmbedding's header check
# would otherwise refuse first).
FILE_TABLE_CASES = [
    *FILE_FAULTS,
    emb("no-rows", "table_path", lambda w: w.header_with(num_rows=0),
        "crafted.table: inconsistent table file header: num_rows must be positive"),
    emb("int", "table_path", lambda w: 5, "table_path must be a path"),
    emb("unknown", "table_reader", lambda w: "aio", "table_reader must be one of"),
    emb("int64", "io_threads", lambda w: 2**63, r"io_threads must be an integer in \[0, 1024\]"),
]  # fmt: skip
