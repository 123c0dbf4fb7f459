"""Issue #49 item 1: vLLM's own Qwen4Exp PLE embeddings (NVIDIA and AMD classes, on the CPU)
take their tables from a directory of packed table files (``qwen4exp-table pack-model``) named
by ``--additional-config '{"qwen4exp_table_dir": ...}'`` or ``$QWEN4EXP_VLLM_TABLE_DIR``.

A small model directory (``model_checkpoint.write_model``: config.json, two safetensors files,
every PLE layer's rows in row shards) is packed; vLLM's embedding of one layer is built and
loaded through vLLM's own safetensors iterator (the vLLM side: ``vllm_table_dir_script.py``, in
a fresh interpreter), in bf16, fp8 and NVFP4:

- with the directory, its table lies inside the file's mapping (/proc/self/maps), the loader
  skipped every row shard (and loads from a checkpoint whose row shards were deleted after
  packing), vLLM's own file filter with the plugin's skip hook drops a safetensors file of row
  shards only, and every row looked up is bit for bit the row loaded from safetensors;
- two gloo ranks (ETP = 2) each map half of the file, and their reduced rows equal one rank's;
- a missing, foreign, truncated, wrong-format or wrong-layer file, a checkpoint whose scale or
  hash buffers differ from the file's, a bad directory and (vLLM 0.34.0) a disk-offloaded table
  fail at construction or load, naming the file (or the setting), with nothing left behind; a
  good one, built, loaded and freed, leaves nothing behind either.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import model_checkpoint as mc
from vllm_support import require_vllm, run_python, vllm_version

pytestmark = require_vllm()

from qwen4exp_ext.tables import pack_model  # noqa: E402
from qwen4exp_ext.tables.file_format import table_path  # noqa: E402

SCRIPT = Path(__file__).with_name("vllm_table_dir_script.py")
TESTS = str(Path(__file__).parent)
LAYER = 1  # PLE layer 1: its rows are in both safetensors files
DECODER = mc.DECODER_LAYERS[LAYER]
PREFIX = mc.CONDITIONAL.replace("{layer}", str(DECODER))
# The model's formats: (model_checkpoint's format, vLLM's ple_embedding_dtype).
FORMATS = {"bfloat16": None, "float8_e4m3fn": "float8_e4m3fn", "nvfp4": "nvfp4"}


def _config(fmt: str) -> dict:
    config = mc.text_config()
    if FORMATS[fmt] is not None:
        config["ple_embedding_dtype"] = FORMATS[fmt]
    return config


def _rows() -> int:
    return mc.table("bfloat16", LAYER)[0].shape[0]


def _run(case: dict, work: Path, timeout: int = 300):
    case = {**case, "store": str(work / "dist_store"), "tests": TESTS}
    (work / "case.json").write_text(json.dumps(case))
    out = work / "out.pt"
    script = (
        f"import runpy, sys\nsys.argv = [{str(SCRIPT)!r}, {str(work / 'case.json')!r}, "
        f"{str(out)!r}]\nrunpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
    )
    stdout = run_python(script, timeout=timeout)
    assert stdout.strip().splitlines()[-1] == "ok", stdout
    return out


@pytest.fixture(scope="module", params=list(FORMATS))
def packed(request, tmp_path_factory):
    """(format, model directory, its safetensors files, table directory, files without row
    shards)."""
    fmt = request.param
    work = tmp_path_factory.mktemp(f"model_{fmt}")
    model = mc.write_model(work / "model", fmt)
    tables = work / "tables"
    pack_model.pack_model(model, tables)
    files = sorted(str(p) for p in model.glob("*.safetensors"))
    # The checkpoint with every row shard deleted after packing: what is left must still load.
    stripped = work / "stripped"
    stripped.mkdir()
    for path in files:
        tensors = load_file(path)
        kept = {k: v for k, v in tensors.items() if ".shard_" not in k}
        save_file(kept, stripped / Path(path).name)
    stripped_files = sorted(str(p) for p in stripped.glob("*.safetensors"))
    return fmt, model, files, tables, stripped_files


@pytest.fixture(scope="module")
def lookups(packed, tmp_path_factory):
    fmt, _, files, tables, stripped = packed
    runs = []
    for cls in ("nvidia", "amd"):
        runs += [
            dict(cls=cls, table_dir=None, files=files),
            dict(cls=cls, table_dir=str(tables), files=files),
            dict(cls=cls, table_dir=str(tables), files=stripped),
        ]
    # $QWEN4EXP_VLLM_TABLE_DIR instead of additional_config; a bad value: one warning, and
    # vLLM's own table, loaded from safetensors.
    runs += [
        dict(cls="nvidia", table_dir=None, env=str(tables), files=stripped),
        dict(cls="nvidia", table_dir=None, env=str(tables / "nowhere"), files=files),
    ]
    case = dict(
        mode="lookup", config=_config(fmt), layer=LAYER, prefix=PREFIX, rows=_rows(), runs=runs
    )
    out = _run(case, tmp_path_factory.mktemp(f"lookup_{fmt}"))
    return fmt, tables, files, torch.load(out, weights_only=False)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_rows_from_the_file_equal_the_rows_from_safetensors_bit_for_bit(lookups):
    _, _, _, results = lookups
    for cls in ("nvidia", "amd"):
        loaded, mapped, stripped = (r for r in results if r["cls"] == cls and "env" not in r)
        assert loaded["rows"].abs().sum() > 0  # a real table, not zeros
        assert torch.equal(_bits(mapped["rows"]), _bits(loaded["rows"])), cls
        assert torch.equal(_bits(stripped["rows"]), _bits(loaded["rows"])), cls


def test_the_environment_variable_names_the_directory_and_a_bad_value_warns_once(lookups):
    _, tables, _, results = lookups
    by_env, bad_env = (r for r in results if "env" in r)
    loaded = results[0]
    assert by_env["where"]["weight"]["path"] == str(table_path(tables, LAYER))
    assert torch.equal(_bits(by_env["rows"]), _bits(loaded["rows"]))
    assert bad_env["where"]["weight"]["path"] != str(table_path(tables, LAYER))
    assert torch.equal(_bits(bad_env["rows"]), _bits(loaded["rows"]))
    warned = [m for m in bad_env["warnings"] if "QWEN4EXP_VLLM_TABLE_DIR" in m]
    assert len(warned) == 1 and "nowhere" in warned[0] and "using the default, off" in warned[0]


def test_the_table_is_inside_the_files_mapping(lookups):
    fmt, tables, _, results = lookups
    path = str(table_path(tables, LAYER))
    for result in results:
        where = result["where"]
        for name, mapping in where.items():
            if (
                result["table_dir"] is None and "env" not in result
            ):  # loaded from safetensors: vLLM's own allocation
                assert mapping["path"] != path, (result["cls"], name, mapping)
            else:  # read-only and shared: the page cache's pages
                if result.get("env", "").endswith("nowhere"):
                    continue
                assert mapping["path"] == path, (result["cls"], name, mapping)
                assert mapping["perms"].startswith("r-") and mapping["perms"][3] == "s", mapping
        if fmt == "nvfp4":
            assert set(where) == {"weight", "weight_scale"}


def test_no_row_shard_is_read_from_safetensors(lookups):
    fmt, _, files, results = lookups
    shard_leaves = {"weight", "weight_scale"} if fmt == "nvfp4" else {"weight"}
    expected = sorted(
        f"ngram_embedding.shard_{i}.{leaf}"
        for i in range(mc.TEXT_CONFIG["split_ngram_parts"])
        for leaf in shard_leaves
    )
    for cls in ("nvidia", "amd"):
        loaded, mapped, stripped = (r for r in results if r["cls"] == cls and "env" not in r)
        assert loaded["skipped"] == []
        assert sorted(mapped["skipped"]) == expected, mapped["skipped"]
        assert stripped["skipped"] == []  # loaded from a checkpoint without row shards
        assert "ngram_embedding.weight" in mapped["loaded"]
        assert "ngram_embedding.weight" in stripped["loaded"]
        # vLLM's loader drops the safetensors files whose every tensor the hook calls unused:
        # none here (each file also holds other tensors), so both stay and the per-tensor skip
        # above is what keeps the rows unread.
        assert mapped["files_kept"] == files


# The file filter does not depend on the table's format: one format (each case is a vLLM
# start-up, and CI runs these on two vLLM releases within its time).
@pytest.mark.parametrize("packed", ["bfloat16"], indirect=True)
def test_vllms_file_filter_drops_a_file_of_row_shards_only(packed, tmp_path):
    fmt, _, _, tables, stripped = packed
    shards_only = tmp_path / "shards.safetensors"
    tensors = {k: v for path in (packed[2]) for k, v in load_file(path).items() if ".shard_" in k}
    save_file(tensors, shards_only)
    case = dict(
        mode="lookup",
        config=_config(fmt),
        layer=LAYER,
        prefix=PREFIX,
        rows=_rows(),
        runs=[dict(cls="nvidia", table_dir=str(tables), files=[*stripped, str(shards_only)])],
    )
    (result,) = torch.load(_run(case, tmp_path), weights_only=False)
    assert result["files_kept"] == stripped  # the file of row shards is never opened to read


# NVFP4: its rows and block scales are two planes each rank maps by its vocabulary shard, the
# case with most to get wrong (each run is two vLLM start-ups).
@pytest.mark.parametrize("packed", ["nvfp4"], indirect=True)
def test_two_gloo_ranks_each_map_half_and_reduce_to_one_ranks_rows(tmp_path, packed, lookups):
    fmt, _, files, tables, _ = packed
    single = lookups[3][0]["rows"]  # one rank, loaded from safetensors
    case = dict(
        mode="etp",
        world=2,
        cls="nvidia",
        table_dir=str(tables),
        files=files,
        config=_config(fmt),
        layer=LAYER,
        prefix=PREFIX,
        rows=_rows(),
    )
    out = _run(case, tmp_path)
    rows = _rows()
    path = str(table_path(tables, LAYER))
    shards = []
    for rank in range(2):
        result = torch.load(f"{out}.{rank}", weights_only=False)
        # + 0.0 turns -0 into +0: the plugin dequantises before the ETP sum, where a -0 element
        # (an NVFP4 code) becomes +0 (-0 + +0; README, "Table formats"), with or without files.
        assert torch.equal(_bits(result["rows"] + 0.0), _bits(single + 0.0)), rank
        assert result["table_rows"] == rows // 2
        assert result["where"]["weight"]["path"] == path
        row_bytes = (mc.D // 2 + mc.D // 16) if fmt == "nvfp4" else mc.D * 2
        # Only its half is mapped (page-rounded): far less than the whole table.
        assert result["where"]["weight"]["bytes"] <= rows // 2 * row_bytes + 2 * 4096
        shards.append(result["shard"])
    assert shards == [[0, rows // 2], [rows // 2, rows]]


def _bad_cases(tmp: Path, packed) -> list[dict]:
    fmt, model, files, tables, _ = packed
    config = _config(fmt)
    cases = []

    def directory(name: str, content: bytes | None = None, source: Path | None = None) -> str:
        d = tmp / name
        d.mkdir()
        target = table_path(d, LAYER)
        if source is not None:
            shutil.copy(source, target)
        if content is not None:
            target.write_bytes(content)
        return str(d)

    good = table_path(tables, LAYER)
    # A good file: built, loaded and freed, nothing is left mapped or open.
    cases.append(dict(name="good", table_dir=str(tables)))
    cases.append(dict(name="missing", table_dir=directory("missing")))
    cases.append(dict(name="foreign", table_dir=directory("foreign", b"PK\x03\x04" * 2048)))
    truncated = directory("truncated", source=good)
    with open(table_path(truncated, LAYER), "r+b") as f:
        f.truncate(good.stat().st_size - 7)
    cases.append(dict(name="truncated", table_dir=truncated))
    cases.append(
        dict(name="wrong_layer", table_dir=directory("wrong_layer", source=table_path(tables, 0)))
    )
    other = "nvfp4" if fmt != "nvfp4" else "bfloat16"
    cases.append(dict(name="wrong_format", table_dir=str(tables), config=_config(other)))
    if fmt != "bfloat16":  # a checkpoint whose scale is not the file's
        scaled = tmp / "scaled"
        scaled.mkdir()
        for path in files:
            tensors = load_file(path)
            for k in tensors:
                if k.endswith(("embedding.weight_scale_2", "embedding.weight_scale")) and (
                    tensors[k].numel() == 1
                ):
                    tensors[k] = tensors[k] * 2
            save_file(tensors, scaled / Path(path).name)
        cases.append(
            dict(
                name="scale_mismatch",
                table_dir=str(tables),
                files=sorted(str(p) for p in scaled.glob("*.safetensors")),
            )
        )
    hashed = tmp / "hashed"
    hashed.mkdir()
    for path in files:
        tensors = load_file(path)
        for k in tensors:
            if k.endswith("layer_multipliers"):
                tensors[k] = tensors[k] + 2
        save_file(tensors, hashed / Path(path).name)
    cases.append(
        dict(
            name="buffer_mismatch",
            table_dir=str(tables),
            files=sorted(str(p) for p in hashed.glob("*.safetensors")),
        )
    )
    cases.append(dict(name="no_directory", table_dir=str(tmp / "nowhere")))
    if vllm_version() != "0.33.0":  # 0.34's disk_offload reads the checkpoint itself
        cases.append(dict(name="disk_offload", table_dir=str(tables), disk_offload=True))
    for case in cases:
        case.setdefault("config", config)
        case.setdefault("files", files)
        case.setdefault("cls", "amd" if case["name"] in ("foreign", "wrong_layer") else "nvidia")
    return cases


# The formats with a scale to compare (a bf16 file's faults are the same as theirs).
@pytest.mark.parametrize("packed", ["float8_e4m3fn", "nvfp4"], indirect=True)
def test_bad_table_files_fail_naming_the_file_and_leave_nothing_behind(packed, tmp_path):
    fmt = packed[0]
    (tmp_path / "bad").mkdir()
    bad = _bad_cases(tmp_path / "bad", packed)
    case = dict(mode="bad", bad=bad, layer=LAYER, prefix=PREFIX, rows=_rows(), config=_config(fmt))
    messages = torch.load(_run(case, tmp_path), weights_only=False)
    file = f"ple{LAYER}.q4xt"
    expected = {
        "missing": ("TableFileNotFoundError", file, "no such table file"),
        "foreign": ("TableFileError", file, "not a qwen4exp table file"),
        "truncated": ("TableFileError", file, "truncated table file"),
        "wrong_layer": ("TableFileError", file, f"PLE layer 0's, expected layer {LAYER}'s"),
        "wrong_format": ("TableFileError", file, "format (dtype) is"),
        "scale_mismatch": ("TableFileError", file, "the file was packed from another checkpoint"),
        "buffer_mismatch": ("TableFileError", file, "layout checksum differs"),
        "no_directory": ("ValueError", "qwen4exp_table_dir", "must name an existing directory"),
        "disk_offload": ("TableFileError", file, "disk_offload reads the checkpoint itself"),
    }
    assert set(messages) == {c["name"] for c in bad}
    assert messages.pop("good") is None
    for name, message in messages.items():
        assert message is not None, f"{name}: no error"
        assert not message.startswith("LEAK"), f"{name}: {message}"
        for part in expected[name]:
            assert part in message, f"{name}: {message}"
