"""vLLM 0.34.0's PLE ``disk_offload`` (``Qwen4ExpPLEDiskOffloadEmbedding``) with the plugin in
place, on the CPU: vLLM stages the rows of a table kept in its safetensors file itself, and its
FP8 rows reach the method's ``dequantize`` as raw bytes, which the plugin must then scale as
vLLM does (its fused-FP8 shortcut is for the lookups it serves, not for rows it never read).

The table is a real safetensors file in tmp_path, handed to vLLM as its loader does: a view of
the file's mapping (``bind_file_shards`` finds the file and offset in /proc/self/maps)."""

from __future__ import annotations

import json

import pytest

from vllm_support import FILE_VIEWS_SCRIPT, require_vllm, run_python, vllm_version

pytestmark = require_vllm()
_HAS_DISK_OFFLOAD = pytest.mark.skipif(
    vllm_version() == "0.33.0", reason="vLLM 0.33.0 has no disk_offload (0.34.0 on)"
)

_SCRIPT = r"""
import json, os, struct, sys
import numpy as np
import torch
from safetensors.torch import save_file

if os.environ.get("VLLM_PLUGINS") == "qwen4exp":
    import vllm.plugins
    vllm.plugins.load_general_plugins()
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.models.qwen4_exp.common.ngram_embedding import Qwen4ExpPLEFp8EmbeddingMethod
from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpPLEDiskOffloadEmbedding
import qwen4exp_ext.vllm as plugin

folder = os.environ["QWEN4EXP_FOLDER"]
rows, width, heads, tokens, scale = 300, 64, 4, 5, 0.37
g = torch.Generator().manual_seed(5)
table = (torch.randn(rows, width, generator=g) * 4).to(torch.float8_e4m3fn)
path = os.path.join(folder, "ple.safetensors")
save_file({"ngram_embedding.weight": table}, path)
with open(path, "rb") as f:
    header_len = struct.unpack("<Q", f.read(8))[0]
    header = json.loads(f.read(header_len))
start = 8 + header_len + header["ngram_embedding.weight"]["data_offsets"][0]
mapped = np.memmap(path, dtype=np.uint8, mode="r", offset=start, shape=(rows * width,))
shard = torch.from_numpy(np.asarray(mapped)).view(torch.float8_e4m3fn).view(rows, width)

vc = VllmConfig(device_config=DeviceConfig("cpu"))
with set_current_vllm_config(vc):
    init_distributed_environment(1, 0, "file://" + os.path.join(folder, "store"), 0, "gloo")
    initialize_model_parallel(1, 1)
    emb = Qwen4ExpPLEDiskOffloadEmbedding(
        rows, width, params_dtype=torch.bfloat16, padding_size=1, prefix="ple",
        embedding_method=Qwen4ExpPLEFp8EmbeddingMethod(), num_ngram_heads=heads,
        max_total_tokens=tokens,
    )
emb.accept_checkpoint_shard(0, shard, rows, "weight")
with torch.no_grad():
    emb.weight_scale.fill_(scale)
emb.embedding_method.process_weights_after_loading(emb)  # binds the file, drops the view
ids = torch.randint(0, rows, (tokens, heads), generator=g)
emb.copy_ids_to_host(ids)
emb.stage_rows(tokens)
out = emb.dequantize(emb.staged_rows(tokens), torch.bfloat16)
# vLLM's FP8 dequantisation of the file's rows: row.to(out) * scale.to(out).
want = table[ids].to(torch.bfloat16).flatten(-2) * torch.tensor(scale).to(torch.bfloat16)
print(json.dumps({
    "equal": bool(torch.equal(out, want)),
    "max_error": float((out.float() - want.float()).abs().max()),
    "dequantize_swapped": "Qwen4ExpPLEFp8EmbeddingMethod.dequantize" in plugin.swapped(),
}))
"""


@_HAS_DISK_OFFLOAD
@pytest.mark.parametrize("plugins", ["qwen4exp", "none"])
def test_fp8_rows_staged_from_the_file_are_scaled_as_vllm_does(tmp_path, plugins):
    out = run_python(_SCRIPT, env={"VLLM_PLUGINS": plugins, "QWEN4EXP_FOLDER": str(tmp_path)})
    found = json.loads(out.strip().splitlines()[-1])
    assert found["dequantize_swapped"] is (plugins == "qwen4exp")
    assert found["equal"] is True, found


# ---- the staged rows: vLLM's read and ours, bit for bit ------------------------------------

# Builds vLLM's disk-offloaded layer of each format over real safetensors files: the table split
# into 3 checkpoint shards (vLLM's `split_ngram_parts`; 301 rows, so the last is shorter), shards
# 0 and 1 in one file behind an odd-sized tensor (unaligned data offsets), shard 2 in another
# (or, one_file, all three in the first).
_STAGE_SETUP = (
    r"""
import json, os, struct, sys
import numpy as np
import torch
from safetensors.torch import save_file

if os.environ.get("VLLM_PLUGINS") == "qwen4exp":
    import vllm.plugins
    vllm.plugins.load_general_plugins()
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.models.qwen4_exp.common import ngram_embedding as common
from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpPLEDiskOffloadEmbedding as Disk
import qwen4exp_ext.vllm as plugin

folder = os.environ["QWEN4EXP_FOLDER"]
ROWS, PARTS, HEADS, MAX_TOKENS = 301, 3, 3, 9
SHARD = (ROWS + PARTS - 1) // PARTS
g = torch.Generator().manual_seed(11)
# format -> (method, embedding width, {plane: full table as the checkpoint stores it})
FORMATS = {
    "bf16": (common.Qwen4ExpPLEUnquantizedEmbeddingMethod, 48,
             {"weight": torch.randn(ROWS, 48, generator=g).to(torch.bfloat16)}),
    "fp8": (common.Qwen4ExpPLEFp8EmbeddingMethod, 80,
            {"weight": (torch.randn(ROWS, 80, generator=g) * 4).to(torch.float8_e4m3fn)}),
    "nvfp4": (common.Qwen4ExpPLENvFp4EmbeddingMethod, 64,
              {"weight": torch.randint(0, 256, (ROWS, 32), generator=g, dtype=torch.uint8),
               "weight_scale": torch.rand(ROWS, 4, generator=g).to(torch.float8_e4m3fn)}),
}

vc = VllmConfig(device_config=DeviceConfig("cpu"))
with set_current_vllm_config(vc):
    init_distributed_environment(1, 0, "file://" + os.path.join(folder, "store"), 0, "gloo")
    initialize_model_parallel(1, 1)

"""
    + FILE_VIEWS_SCRIPT
    + r"""
def build(fmt, parts=PARTS, tokens=MAX_TOKENS, one_file=False):
    method, width, planes = FORMATS[fmt]
    shard = (ROWS + parts - 1) // parts
    with set_current_vllm_config(vc):
        emb = Disk(ROWS, width, params_dtype=torch.bfloat16, padding_size=1, prefix=fmt,
                   embedding_method=method(), num_ngram_heads=HEADS, max_total_tokens=tokens)
    files = {"a": {"pad": torch.zeros(3, dtype=torch.uint8)}, "b": {}}
    for name, table in planes.items():
        for i in range(parts):
            where = "b" if parts > 1 and i == parts - 1 and not one_file else "a"
            files[where][f"shard_{i}.{name}"] = table[i * shard:(i + 1) * shard].contiguous()
    for where, tensors in files.items():
        if tensors:
            stem = f"{fmt}-{parts}{'-one' if one_file else ''}-{where}"
            for key, view in file_views(os.path.join(folder, f"{stem}.safetensors"),
                                        tensors).items():
                if key != "pad":
                    i, name = key[len("shard_"):].split(".")
                    emb.accept_checkpoint_shard(int(i), view, shard, name)
    with torch.no_grad():
        if fmt == "fp8":
            emb.weight_scale.fill_(0.37)
        if fmt == "nvfp4":
            emb.weight_scale_2.fill_(0.5)
    emb.embedding_method.process_weights_after_loading(emb)  # binds the files, drops the views
    return emb, planes

def staged(emb, tokens):
    # Every plane's pinned host rows and device staging rows, as bytes.
    return {name: (host[:tokens].clone(), staging[:tokens].clone())
            for name, (staging, host, _) in emb._planes.items()}

vllm_stage_rows = getattr(Disk.stage_rows, "__qwen4exp_replaces__", Disk.stage_rows)
"""
)

_STAGE_SCRIPT = (
    _STAGE_SETUP
    + r"""
# Odd T (7 of 9), repeated ids (0 three times, 300 twice), ids in every shard and at each
# shard's edges (100|101, 201|202, 300 the last row); the rest random.
ids = torch.randint(0, ROWS, (7, HEADS), generator=g)
ids[0] = torch.tensor([0, 100, 101])
ids[1] = torch.tensor([201, 202, 300])
ids[2] = torch.tensor([0, 300, 0])
found = {}
for fmt in FORMATS:
    for parts, one_file in ((PARTS, False), (PARTS, True), (1, False)):
        emb, planes = build(fmt, parts, one_file=one_file)
        emb.copy_ids_to_host(ids)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            emb.stage_rows(7)
        ours = staged(emb, 7)
        for _, host, _ in emb._planes.values():
            host.view(torch.uint8).fill_(0xA5)  # vLLM must write every byte again
        vllm_stage_rows(emb, 7)
        theirs = staged(emb, 7)
        key = f"{fmt}/{parts}" + ("/one_file" if one_file else "")
        found[key] = {
            "read_file_rows": sum(e.name == "qwen4exp::read_file_rows" for e in prof.events()),
            # the file's rows, as vLLM's own staging leaves them, and as ours does
            "vllm_is_file": all(torch.equal(theirs[n][0], planes[n][ids])
                                and torch.equal(theirs[n][1], planes[n][ids]) for n in planes),
            "ours_is_vllm": all(torch.equal(ours[n][0].view(torch.uint8),
                                            theirs[n][0].view(torch.uint8))
                                and torch.equal(ours[n][1].view(torch.uint8),
                                                theirs[n][1].view(torch.uint8)) for n in planes),
        }
        if fmt != "nvfp4":  # NVFP4's staged rows are decoded by vLLM's Triton kernel (GPU)
            rows = emb.staged_rows(7)
            want = planes["weight"][ids].flatten(-2)
            found[key]["staged_rows"] = bool(torch.equal(rows.view(torch.uint8),
                                                         want.view(torch.uint8)))
print(json.dumps({"found": found, "swapped": plugin.swapped()}))
"""
)


@_HAS_DISK_OFFLOAD
@pytest.mark.parametrize("plugins", ["qwen4exp", "none"])
def test_staged_rows_are_vllm_s_bit_for_bit(tmp_path, plugins):
    """vLLM's disk-offload staging of bf16, FP8 and NVFP4 tables in 3 shards over 2 files, over
    1 file, and in one shard, with the plugin: read by our reader (the profiler sees the op, once
    per file region: consecutive shards of a file are one), and the pinned
    host rows and staging rows equal, byte for byte, those vLLM's own stage_rows leaves and the
    file's rows; without the plugin, vLLM's own read runs and nothing is swapped."""
    out = run_python(_STAGE_SCRIPT, env={"VLLM_PLUGINS": plugins, "QWEN4EXP_FOLDER": str(tmp_path)})
    result = json.loads(out.strip().splitlines()[-1])
    ours = plugins == "qwen4exp"
    assert ("Qwen4ExpPLEDiskOffloadEmbedding.stage_rows" in result["swapped"]) is ours
    if ours:  # one call per file region: consecutive shards of a file are one (bf16, fp8)
        for fmt in ("bf16", "fp8"):
            calls = {k: result["found"][f"{fmt}/{k}"]["read_file_rows"] for k in ("3", "1")}
            calls["3/one_file"] = result["found"][f"{fmt}/3/one_file"]["read_file_rows"]
            assert calls == {"3": 2, "1": 1, "3/one_file": 1}, (fmt, calls)
    assert len(result["found"]) == 9
    for key, case in result["found"].items():
        assert (case["read_file_rows"] > 0) is ours, key
        assert case["vllm_is_file"] is True, key
        assert case["ours_is_vllm"] is True, key
        assert case.get("staged_rows", True) is True, key


_TRUNCATED_SCRIPT = (
    _STAGE_SETUP
    + r"""
sys.path.insert(0, os.environ["QWEN4EXP_TESTS"])
from leak_support import nothing_left_behind

emb, _ = build("bf16", 1)
path = os.path.join(folder, "bf16-1-a.safetensors")
os.truncate(path, os.path.getsize(path) - 96 * 3 // 2)  # the last row and a half gone
result = {}
for name, ids in (("last", [[0, 5, ROWS - 1]]), ("range", [[0, ROWS, 1]])):
    emb.copy_ids_to_host(torch.tensor(ids))
    try:
        with nothing_left_behind():
            emb.stage_rows(1)
        result[name] = None
    except Exception as exc:
        result[name] = [type(exc).__name__, str(exc)]
emb.copy_ids_to_host(torch.tensor([[0, 5, ROWS - 3]]))  # rows the file still has
emb.stage_rows(1)
result["kept"] = bool(torch.equal(emb._planes["weight"][1][0],
                                  FORMATS["bf16"][2]["weight"][[0, 5, ROWS - 3]]))
result["path"] = path
print(json.dumps(result))
"""
)


@_HAS_DISK_OFFLOAD
@pytest.mark.parametrize("plugins", ["qwen4exp", "none"])
def test_a_truncated_file_and_an_id_out_of_range_raise_as_vllm_s(tmp_path, plugins):
    """A shard file cut short of a wanted row raises vLLM's ValueError naming the file, and an id
    past the table vLLM's IndexError, with the plugin as without it, leaving no descriptor or
    thread behind; rows the file still holds are read after that as before."""
    from pathlib import Path

    env = {
        "VLLM_PLUGINS": plugins,
        "QWEN4EXP_FOLDER": str(tmp_path),
        "QWEN4EXP_TESTS": str(Path(__file__).parent),
    }
    result = json.loads(run_python(_TRUNCATED_SCRIPT, env=env).strip().splitlines()[-1])
    assert result["last"][0] == "ValueError" and result["path"] in result["last"][1], result
    assert result["range"] == ["IndexError", "PLE id out of range for 301 rows"], result
    assert result["kept"] is True


_RELEASE_SCRIPT = r"""
import importlib, json, logging, sys
records = []
class H(logging.Handler):
    def emit(self, r): records.append(r)
logging.getLogger("vllm.qwen4exp_ext").addHandler(H())
import qwen4exp_ext.vllm as plugin
from qwen4exp_ext.vllm.shims import MARK, NVIDIA_EMBEDDING_MODULE, SWAPS
plugin.register()
later = [s for s in SWAPS if s.since == "0.34.0"]
# the modules whose import brings only rows of 0.34.0 (the AMD layer's brings older ones too)
triggers = sorted({s.trigger for s in later} - {s.trigger for s in SWAPS if s.since is None})
hooks = {getattr(f, "name", "") for f in sys.meta_path}
waiting = sorted(t for t in triggers if t in hooks)
hooked = sorted(t for t in triggers if t in hooks or t in sys.modules)  # or applied at once
for trigger in sorted({s.trigger for s in later}):
    importlib.import_module(trigger)
nvidia = sys.modules[NVIDIA_EMBEDDING_MODULE]
ours = sorted(
    f"{cls.__name__}.{name}"
    for cls in vars(nvidia).values()
    if isinstance(cls, type) and cls.__module__ == nvidia.__name__  # not the re-exported ones
    for name, fn in vars(cls).items() if getattr(fn, MARK, None) is not None
)
print(json.dumps({
    "waiting": waiting,
    "hooked": hooked,
    "triggers": triggers,
    "ours": ours,
    "stage_function_ours": getattr(getattr(nvidia, "stage_checkpoint_rows", None), MARK, None)
                           is not None,
    "labels": [s.label for s in later],
    "swapped": plugin.swapped(),
    "has_class": hasattr(nvidia, "Qwen4ExpPLEDiskOffloadEmbedding"),
    "warnings": [r.getMessage() for r in records if r.levelno >= logging.WARNING],
}))
"""


def test_the_disk_offload_rows_exist_from_0_34_0_on():
    """The disk_offload rows (``since`` 0.34.0: the read, the step and its staged rows, the
    config check, the AMD layer's construction and forward, the AMD model state's staging) are
    in 0.34.0's table only: on 0.33.0 the plugin neither waits for their modules nor changes
    anything in them, and warns nothing (it would decline, naming a missing class or function,
    if it looked for one); on 0.34.0 importing those modules swaps every one of them, and
    swapped() lists them. The NVIDIA embedding module's table-directory rows (every release)
    are there on both."""
    found = json.loads(run_python(_RELEASE_SCRIPT).strip().splitlines()[-1])
    assert found["warnings"] == []
    assert len(found["labels"]) == 7, found["labels"]
    # Every release: the n-gram embedding's rows of a PLE table directory (vllm/table_dir.py).
    table_dir_rows = ["Qwen4ExpNGramEmbedding.__init__", "Qwen4ExpNGramEmbedding.load_weights"]
    if vllm_version() == "0.33.0":
        assert found["has_class"] is False
        # No import hook waits for them (a module already imported, as vllm.config.engram is in
        # vLLM's own processes, is left as it is: the swapped() check below).
        assert found["triggers"] and found["waiting"] == [], found
        assert found["ours"] == table_dir_rows, found
        assert found["stage_function_ours"] is False
        assert not any(label in found["swapped"] for label in found["labels"]), found
    else:
        assert found["hooked"] == found["triggers"], found
        assert found["ours"] == sorted(
            [
                "Qwen4ExpPLEDiskOffloadEmbedding.stage_rows",
                "Qwen4ExpPLEDiskOffloadEmbedding.staged_rows",
                *table_dir_rows,
            ]
        ), found
        assert found["stage_function_ours"] is True
        missing = [label for label in found["labels"] if label not in found["swapped"]]
        assert missing == [], found
