"""vLLM 0.34.0's PLE ``disk_offload`` a step at a time, with the plugin (issue #48, item 3):
on vLLM's AMD layer (which vLLM itself never builds with disk offload), started early, with
the pinned buffers' reuse kept safe, and FP8/NVFP4 decoded on the host or on the device.

Every case runs in a fresh interpreter over real safetensors files in tmp_path, handed to
vLLM as its loader does (views of the file's mapping), the table split into 3 checkpoint
shards over 2 files. The reference is vLLM's own NVIDIA staging of the same files: its
``stage_checkpoint_rows`` and ``staged_rows`` (the originals, which the plugin keeps).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_support import FILE_VIEWS_SCRIPT, require_vllm, run_python, vllm_version

pytestmark = require_vllm()
_HAS_DISK_OFFLOAD = pytest.mark.skipif(
    vllm_version() == "0.33.0", reason="vLLM 0.33.0 has no disk_offload (0.34.0 on)"
)

# Builds vLLM's AMD Qwen4ExpPLELayer (as test_vllm_layer builds it) with engram disk_offload,
# its table loaded by vLLM's AMD loader (the plugin's) from the files, and vLLM's NVIDIA
# Qwen4ExpNGramEmbedding over the same files; a fake-free AMD model state (vLLM's class, its
# __init__ skipped: it needs a model runner) whose prepare_inputs stages each step.
_SETUP = (
    r"""
import json, os, struct, sys, threading, time
from types import SimpleNamespace
import numpy as np
import torch
from safetensors.torch import save_file

import vllm.plugins
vllm.plugins.load_general_plugins()  # VLLM_PLUGINS=qwen4exp: only ours
from transformers import Qwen4ExpTextConfig
from vllm.config import (CompilationMode, CUDAGraphMode, DeviceConfig, EngramConfig, VllmConfig,
                         set_current_vllm_config)
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.models.qwen4_exp.amd import model_state as amd_state
from vllm.models.qwen4_exp.amd.ple_layer import Qwen4ExpPLELayer
from vllm.models.qwen4_exp.common import ngram_embedding as common
from vllm.models.qwen4_exp.nvidia import ngram_embedding as nvidia
import qwen4exp_ext.vllm as plugin
from qwen4exp_ext import reference
from qwen4exp_ext.vllm.shims import MARK
from qwen4exp_ext.vllm.shims import disk_offload_step as step_shim

sys.path.insert(0, os.environ["QWEN4EXP_TESTS"])
from hf_support import EOS, tiny_config

folder = os.environ["QWEN4EXP_FOLDER"]
FORMAT = os.environ["QWEN4EXP_FORMAT"]  # dense, fp8 or nvfp4
EAGER = os.environ.get("QWEN4EXP_EAGER", "1") == "1"
MAX_TOKENS, MAX_REQS, PARTS = 16, 4, 3
overrides = dict(ple_embed_dim=64, split_ngram_parts=PARTS)  # heads of 16: NVFP4 blocks
if FORMAT != "dense":
    overrides["ple_embedding_dtype"] = "nvfp4" if FORMAT == "nvfp4" else "float8_e4m3fn"
cfg = Qwen4ExpTextConfig(**tiny_config(**overrides).to_dict())

vc = VllmConfig(device_config=DeviceConfig("cpu"))
with set_current_vllm_config(vc):
    init_distributed_environment(1, 0, "file://" + os.path.join(folder, "store"), 0, "gloo")
    initialize_model_parallel(1, 1)
object.__setattr__(vc, "model_config", SimpleNamespace(dtype=torch.bfloat16))
object.__setattr__(vc, "engram_config", EngramConfig(disk_offload=True))
vc.cache_config.mamba_block_size = 16
vc.scheduler_config.max_num_batched_tokens = MAX_TOKENS
# The forward runs eagerly (enforce_eager), or is compiled and replayed as CUDA graphs.
vc.compilation_config.mode = CompilationMode.NONE if EAGER else CompilationMode.VLLM_COMPILE
vc.compilation_config.cudagraph_mode = CUDAGraphMode.NONE if EAGER else CUDAGraphMode.PIECEWISE

def original(fn):
    return getattr(fn, MARK, fn)

with set_current_vllm_config(vc):
    layer = Qwen4ExpPLELayer(cfg, vc, layer_idx=0, ple_dense_layer_id=0, prefix="amd.ple")
    twin = nvidia.Qwen4ExpNGramEmbedding(cfg, 64, 0, MAX_TOKENS, data_parallel_rank=0,
                                         prefix="nv", params_dtype=torch.bfloat16)
amd = layer.ple_embedding
rows = amd.ngram_embedding.org_vocab_size
shard = (rows + PARTS - 1) // PARTS
g = torch.Generator().manual_seed(23)
if FORMAT == "dense":
    planes = {"weight": torch.randn(rows, 16, generator=g).to(torch.bfloat16)}
    scales = {}
elif FORMAT == "fp8":
    planes = {"weight": (torch.randn(rows, 16, generator=g) * 4).to(torch.float8_e4m3fn)}
    scales = {"ngram_embedding.weight_scale": torch.tensor([0.37])}
else:
    planes = {"weight": torch.randint(0, 256, (rows, 8), generator=g, dtype=torch.uint8),
              "weight_scale": (torch.rand(rows, 1, generator=g) * 0.5 + 0.01).to(
                  torch.float8_e4m3fn)}
    scales = {"ngram_embedding.weight_scale_2": torch.tensor([0.37])}

"""
    + FILE_VIEWS_SCRIPT
    + r"""
files = {"a": {"pad": torch.zeros(3, dtype=torch.uint8)}, "b": {}}
for name, table in planes.items():
    for i in range(PARTS):
        where = "b" if i == PARTS - 1 else "a"
        files[where][f"ngram_embedding.shard_{i}.{name}"] = table[i * shard:(i + 1) * shard].clone()
checkpoint = dict(scales)
for where, tensors in files.items():
    views = file_views(os.path.join(folder, f"{FORMAT}-{where}.safetensors"), tensors)
    checkpoint.update({k: v for k, v in views.items() if k != "pad"})
for module in (amd, twin):
    module.load_weights(list(checkpoint.items()))
    module.ngram_embedding.embedding_method.process_weights_after_loading(module.ngram_embedding)

# vLLM's AMD model state, as its __init__ leaves it for this model (the runner it needs aside).
state = object.__new__(amd_state.Qwen4ExpModelState)
state.vllm_config, state.model, state.rope_state = vc, layer, None
state.uses_ngram_embedding, state.ngram_context_len, state.ngram_eos_token_id = True, 2, EOS
state.ngram_context = torch.full((MAX_REQS, 2), EOS, dtype=torch.int32)
state.ngram_context_offsets = torch.arange(-2, 0, dtype=torch.int64)
state.ple_query_start_loc = torch.zeros(MAX_REQS + 1, dtype=torch.int32)

# Three requests' tokens; each step: (request, tokens this step), decodes first.
tokens = torch.randint(0, cfg.vocab_size, (3, 12), generator=g)
tokens[tokens % 7 == 0] = EOS
done = [0, 0, 0]
STEPS = [[(0, 5), (1, 7)], [(0, 1), (1, 1), (2, 9)], [(2, 1), (0, 3), (1, 2)]]

def batch(step):
    ids, qsl = [], [0]
    for r, n in step:
        ids.append(tokens[r, done[r]:done[r] + n])
        qsl.append(qsl[-1] + n)
    input_batch = SimpleNamespace(
        num_reqs=len(step), num_reqs_after_padding=len(step), num_tokens=qsl[-1],
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        idx_mapping=torch.tensor([r for r, _ in step], dtype=torch.int32),
        input_ids=torch.cat(ids).to(torch.int32))
    req_states = SimpleNamespace(num_computed_tokens=SimpleNamespace(gpu=torch.tensor(done)),
                                 all_token_ids=SimpleNamespace(gpu=tokens))
    return input_batch, req_states

def advance(step):
    for r, n in step:
        done[r] += n

def vllm_nvidia(input_ids, qsl, ctx):
    # vLLM's own NVIDIA staging of this step: its ids, its staged planes and rows.
    original(nvidia.stage_checkpoint_rows)([(twin, twin.ngram_embedding)], input_ids, qsl, ctx)
    emb, n = twin.ngram_embedding, input_ids.shape[0]
    staged = {name: p[0][:n].clone() for name, p in emb._planes.items()}
    rows = None if FORMAT == "nvfp4" else original(type(emb).staged_rows)(emb, n).clone()
    return emb._host_ids[:n].clone(), staged, rows

# The plugin's choices (vllm/choice.py), timed on the CPU by a timer that makes the path of
# $QWEN4EXP_DECODE the faster for the host decode of disk-offloaded rows (both paths are run),
# and ours for every other op (vLLM's Triton kernels do not run on the CPU).
from qwen4exp_ext.vllm import choice
PREFER = os.environ.get("QWEN4EXP_DECODE", "ours")

def timer(op, label, which, setup, call):
    if op != step_shim.DECODE_OP:
        return 1.0 if which == "ours" else 2.0
    call(setup())
    return 1.0 if which == PREFER else 2.0

choice.reset(timer=timer, cache_path=None, timed_device_types=frozenset({"cpu"}))

# vLLM's NVFP4 decode_rows is a Triton kernel (GPU only): on the CPU its arguments are recorded
# and the rows decoded by the reference (tests/test_vllm_disk_offload_step.py's GPU test runs
# vLLM's own kernel against our host decode).
decode_calls = []
if FORMAT == "nvfp4" and not torch.cuda.is_available():
    def decode_rows(weight, weight_scale, weight_scale_2, ids, output, vocab_start, vocab_end):
        decode_calls.append({"weight": weight.clone(), "weight_scale": weight_scale.clone()})
        w, s = weight.flatten(0, 1)[ids], weight_scale.flatten(0, 1)[ids]
        decoded = reference.nvfp4_decode(w, s) * weight_scale_2.float()
        output.flatten(0, 1)[: ids.numel()].copy_(decoded.to(output.dtype))
    common.Qwen4ExpPLENvFp4EmbeddingMethod.decode_rows = staticmethod(decode_rows)
"""
)

_AMD_SCRIPT = (
    _SETUP
    + r"""
result = {"steps": [], "swapped": plugin.swapped(),
          "table_class": type(amd.ngram_embedding).__name__,
          "reduce_scatter": amd.use_reduce_scatter}
for step in STEPS:
    input_batch, req_states = batch(step)
    inputs = state.prepare_inputs(input_batch, req_states)  # stages (starts) the step
    qsl, ctx, n = inputs["query_start_loc"], inputs["ngram_context"], input_batch.num_tokens
    with torch.no_grad():
        rows = amd(input_batch.input_ids, qsl, ctx)  # vLLM's AMD forward: the staged rows
        activations = amd.ngram_embedding.dequantize(rows, torch.bfloat16)
    want_ids, want_planes, want_rows = vllm_nvidia(input_batch.input_ids, qsl, ctx)
    emb = amd.ngram_embedding
    found = {"ids": bool(torch.equal(emb._host_ids[:n], want_ids)),
             "rows_dtype": str(rows.dtype)}
    if FORMAT == "nvfp4":
        flat = want_ids.flatten()
        want = (reference.nvfp4_decode(planes["weight"][flat], planes["weight_scale"][flat])
                * 0.37).to(torch.bfloat16).view(n, -1)
        found["decoded_equal"] = bool(torch.equal(activations.view(torch.int16),
                                                  want.view(torch.int16)))
        if rows.dtype == torch.bfloat16 and decode_calls:  # vLLM's device decode ran
            call = decode_calls.pop()  # the step's (the measuring may have called it too)
            decode_calls.clear()
            found["planes_equal"] = all(torch.equal(call[k][:n].view(torch.uint8),
                                                    want_planes[k].view(torch.uint8))
                                        for k in want_planes)
    else:
        theirs = twin.ngram_embedding.dequantize(want_rows, torch.bfloat16)
        found["rows_equal"] = bool(torch.equal(activations.view(torch.int16),
                                               theirs.view(torch.int16)))
        found["file_rows"] = bool(torch.equal(
            want_rows.view(torch.uint8),
            planes["weight"][want_ids].flatten(-2).contiguous().view(torch.uint8)))
    result["steps"].append(found)
    advance(step)
result["decode_calls_left"] = len(decode_calls)
print(json.dumps(result))
"""
)


def _env(tmp_path: Path, fmt: str, **extra: str) -> dict[str, str]:
    return {
        "VLLM_PLUGINS": "qwen4exp",
        "QWEN4EXP_FOLDER": str(tmp_path),
        "QWEN4EXP_TESTS": str(Path(__file__).parent),
        "QWEN4EXP_FORMAT": fmt,
        "QWEN4EXP_VLLM_CHOICE_CACHE": "0",
        **extra,
    }


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


@_HAS_DISK_OFFLOAD
@pytest.mark.parametrize("eager", ["1", "0"], ids=["eager", "graphs"])
@pytest.mark.parametrize("decode", ["ours", "vllm"])
@pytest.mark.parametrize("fmt", ["dense", "fp8", "nvfp4"])
def test_amd_layer_with_disk_offload_stages_vllm_s_nvidia_rows(tmp_path, fmt, decode, eager):
    """vLLM's AMD PLE layer with ``disk_offload``, through the plugin alone: it builds vLLM's
    disk-offloaded table (no reduce-scatter), loads it from the files, its model state stages
    three prefill/decode/mixed steps, and its forward returns rows that, after vLLM's own
    ``dequantize``, equal bit for bit those vLLM's NVIDIA staging gives for the same ids (the
    ids too are equal). FP8 and NVFP4 rows decoded on the host (chosen ``ours``, eager forward
    only: from the second step of a token class on, the first being measured) equal those
    decoded on the device (raw rows and vLLM's dequantize, or the planes vLLM's decode_rows
    gets)."""
    env = _env(tmp_path, fmt, QWEN4EXP_DECODE=decode, QWEN4EXP_EAGER=eager)
    result = _last_json(run_python(_AMD_SCRIPT, env=env))
    assert result["table_class"] == "Qwen4ExpPLEDiskOffloadEmbedding"
    assert result["reduce_scatter"] is False
    for label in (
        "amd.ple_layer Qwen4ExpNGramEmbedding.__init__ (disk_offload)",
        "amd.ple_layer Qwen4ExpNGramEmbedding.forward (disk_offload)",
        "amd.model_state Qwen4ExpModelState.prepare_inputs (disk_offload)",
        "Qwen4ExpNGramEmbedding.load_weights",
    ):
        assert label in result["swapped"], result["swapped"]
    # Steps of 12, 11 and 6 tokens: the 2nd is the first of a token class already measured.
    chosen = fmt != "dense" and decode == "ours" and eager == "1"
    for i, found in enumerate(result["steps"]):
        host_decoded = chosen and i == 1
        assert found["ids"] is True, (i, found)
        if fmt == "nvfp4":
            assert found["decoded_equal"] is True, (i, found)
            assert ("planes_equal" not in found) is host_decoded, (i, found)
            assert found.get("planes_equal", True) is True, (i, found)
        else:
            assert found["rows_equal"] is True and found["file_rows"] is True, (i, found)
        raw = {"dense": "torch.bfloat16", "fp8": "torch.float8_e4m3fn", "nvfp4": "torch.bfloat16"}
        assert found["rows_dtype"] == ("torch.bfloat16" if host_decoded else raw[fmt]), found
    assert result["decode_calls_left"] == 0


_VERIFY_SCRIPT = r"""
import json
from types import SimpleNamespace
import vllm.plugins
vllm.plugins.load_general_plugins()
from vllm.config import EngramConfig
from qwen4exp_ext.vllm.shims import MARK

def run(fn, config, arch, field):
    model = SimpleNamespace(architecture=arch, hf_text_config=SimpleNamespace(**{field: [1]}))
    try:
        fn(config, model)
        return None
    except ValueError as exc:
        return str(exc)

verify = EngramConfig.verify_model_config
vllms = getattr(verify, MARK, verify)
disk, plain = EngramConfig(disk_offload=True), EngramConfig()
print(json.dumps({
    "ours_qwen": run(verify, disk, "Qwen4ExpForCausalLM", "ple_layer_ids"),
    "ours_deepseek": run(verify, disk, "DeepseekV41ForCausalLM", "engram_layer_ids"),
    "ours_no_layers": run(verify, disk, "Qwen4ExpForCausalLM", "other"),
    "ours_plain": run(verify, plain, "Qwen4ExpForCausalLM", "ple_layer_ids"),
    "vllm_qwen": run(vllms, disk, "Qwen4ExpForCausalLM", "ple_layer_ids"),
}))
"""


@_HAS_DISK_OFFLOAD
def test_disk_offload_is_allowed_off_cuda_only_where_our_path_serves_it():
    """vLLM refuses disk_offload off CUDA; with the plugin, on this CPU-only platform (served
    by our CPU kernels) a Qwen4Exp model passes, and vLLM's other checks still refuse what
    they refused: another architecture with disk_offload, a model without n-gram layers."""
    found = _last_json(run_python(_VERIFY_SCRIPT, env={"VLLM_PLUGINS": "qwen4exp"}))
    assert found["vllm_qwen"] == "disk_offload requires a Qwen4Exp model on CUDA", found
    assert found["ours_qwen"] is None and found["ours_plain"] is None, found
    assert found["ours_deepseek"] == "disk_offload requires a Qwen4Exp model on CUDA or ROCm"
    assert "non-empty n-gram layer ids" in found["ours_no_layers"], found


# ---- starting early: vLLM's NVIDIA staging, swapped ------------------------------------------

_EARLY_SETUP = (
    _SETUP
    + r"""
from leak_support import nothing_left_behind

emb = twin.ngram_embedding
DELAY = 0.5
real_read_job = step_shim._read_job

def slow_read_job(job):  # the worker, deliberately late: a forward that does not wait sees it
    time.sleep(DELAY)
    real_read_job(job)

def step_inputs(step):
    ids, qsl, ctx = [], [0], []
    for r, n in step:
        ids.append(tokens[r, done[r]:done[r] + n])
        qsl.append(qsl[-1] + n)
        before = [EOS, EOS] + tokens[r, :done[r]].tolist()
        ctx.append(before[-2:])
    return (torch.cat(ids).to(torch.int32), torch.tensor(qsl, dtype=torch.int32),
            torch.tensor(ctx, dtype=torch.int32))

def wanted(input_ids, qsl, ctx):
    # the file's rows of vLLM's own ids for the step
    ids = original(type(twin).compute_ngram_ids)(twin, input_ids, qsl, ctx)
    return planes["weight"][ids].flatten(-2)

def same(a, b):
    return bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))
"""
)

_SLOW_WORKER_SCRIPT = (
    _EARLY_SETUP
    + r"""
step_shim._read_job = slow_read_job
found = []
with nothing_left_behind(), set_current_vllm_config(vc):
    for step in STEPS:
        input_ids, qsl, ctx = step_inputs(step)
        start = time.monotonic()
        nvidia.stage_checkpoint_rows([(twin, emb)], input_ids, qsl, ctx)
        returned = time.monotonic() - start
        pending = emb._qwen4exp_staging.pending
        early = pending is not None and not pending.done.is_set()
        rows = emb.staged_rows(input_ids.shape[0])
        found.append({"returned": returned, "early": early,
                      "waited": time.monotonic() - start,
                      "equal": same(rows, wanted(input_ids, qsl, ctx))})
        advance(step)
    step_shim.join_worker()
print(json.dumps({"found": found, "delay": DELAY,
                  "swapped": [s for s in plugin.swapped() if "stage" in s]}))
"""
)


@_HAS_DISK_OFFLOAD
def test_the_step_starts_early_and_the_forward_waits_for_its_layer(tmp_path):
    """vLLM's ``stage_checkpoint_rows`` with the plugin, its forward eager: it returns before
    the step's reads are done (the worker is made 0.5 s late), and the forward's
    ``staged_rows`` waits for them: every step's rows are the file's rows of vLLM's ids,
    never the previous step's; no thread or descriptor is left behind."""
    env = _env(tmp_path, "dense")
    result = _last_json(run_python(_SLOW_WORKER_SCRIPT, env=env))
    assert {"stage_checkpoint_rows", "Qwen4ExpPLEDiskOffloadEmbedding.staged_rows"} <= set(
        result["swapped"]
    ), result
    delay = result["delay"]
    for i, found in enumerate(result["found"]):
        assert found["early"] is True and found["returned"] < delay / 2, (i, found)
        assert found["waited"] >= delay, (i, found)
        assert found["equal"] is True, (i, found)


_REUSE_SCRIPT = (
    _EARLY_SETUP
    + r"""
class CopyInFlight:
    # Stands in for the CUDA event recorded after a step's H2D copy out of a pinned host set
    # (on the CPU the copy has ended when it returns): "done" only when the test says so.
    def __init__(self):
        self.released, self.waited_on = threading.Event(), threading.Event()
    def synchronize(self):
        self.waited_on.set()
        if not self.released.wait(timeout=30):
            raise TimeoutError("the copy was never released")

found = {}
with set_current_vllm_config(vc):
    inputs = []
    for step in STEPS:
        inputs.append(step_inputs(step))
        advance(step)
    nvidia.stage_checkpoint_rows([(twin, emb)], *inputs[0])
    first = emb.staged_rows(inputs[0][0].shape[0]).clone()  # a view of the staging buffer
    staging = emb._qwen4exp_staging
    set0 = staging.hosts[0]["weight"]
    step1_host = set0.clone()
    copy = CopyInFlight()
    staging.copied[0] = copy  # step 1's copy out of set 0 still reads it
    nvidia.stage_checkpoint_rows([(twin, emb)], *inputs[1])  # step 2: the other set
    second = emb.staged_rows(inputs[1][0].shape[0]).clone()
    nvidia.stage_checkpoint_rows([(twin, emb)], *inputs[2])  # step 3: set 0 again
    found["waited_on"] = copy.waited_on.wait(timeout=10)
    time.sleep(0.3)
    found["set0_kept"] = bool(torch.equal(set0.view(torch.uint8), step1_host.view(torch.uint8)))
    found["step3_waiting"] = not staging.pending.done.is_set()
    copy.released.set()
    third = emb.staged_rows(inputs[2][0].shape[0])
    found["rows"] = [same(rows, wanted(*args))
                     for rows, args in zip((first, second, third), inputs)]
    step_shim.join_worker()
print(json.dumps(found))
"""
)


@_HAS_DISK_OFFLOAD
def test_a_step_does_not_overwrite_a_pinned_set_the_previous_copy_still_reads(tmp_path):
    """Two pinned host sets, alternating per step: step 2 writes the other set while step 1's
    copy still reads set 0, and step 3's worker, back on set 0, waits for that copy before it
    writes (set 0 still holds step 1's rows meanwhile); every step's rows are right."""
    result = _last_json(run_python(_REUSE_SCRIPT, env=_env(tmp_path, "dense")))
    assert result["waited_on"] is True, result
    assert result["set0_kept"] is True and result["step3_waiting"] is True, result
    assert result["rows"] == [True, True, True], result


# ---- the host decode against vLLM's device decode, on a GPU ----------------------------------

_GPU_DECODE_SCRIPT = r"""
import json
import torch
from vllm.models.qwen4_exp.common.ngram_embedding import Qwen4ExpPLENvFp4EmbeddingMethod as Nvfp4
from qwen4exp_ext import ops

g = torch.Generator().manual_seed(31)
found = {}
for tokens in (1, 64, 8192):  # decode and prefill sizes; 4 heads of 64
    n, width = tokens * 4, 64
    packed = torch.randint(0, 256, (n, width // 2), generator=g, dtype=torch.uint8)
    blocks = (torch.rand(n, width // 16, generator=g) * 0.5 + 0.01).to(torch.float8_e4m3fn)
    fp8 = (torch.randn(n, width, generator=g) * 4).to(torch.float8_e4m3fn)
    scale = torch.tensor([0.37])
    ids = torch.arange(n).reshape(-1, 1)
    # ours: the CPU gather of the host rows, as disk_offload_step decodes them
    ours_nvfp4 = ops.gather_rows(packed, ids, scale=scale, block_scales=blocks,
                                 out_dtype=torch.bfloat16)
    ours_fp8 = ops.gather_rows(fp8, ids, scale=scale, out_dtype=torch.bfloat16)
    # vLLM's: its decode_rows (Triton) and its FP8 dequantize, on the GPU
    out = torch.empty(n, width, dtype=torch.bfloat16, device="cuda")
    Nvfp4.decode_rows(packed.cuda(), blocks.cuda(), scale.cuda(), torch.arange(n, device="cuda"),
                      out, 0, n)
    vllm_fp8 = fp8.cuda().to(torch.bfloat16) * scale.cuda().to(torch.bfloat16)
    found[tokens] = {
        "nvfp4": bool(torch.equal(ours_nvfp4.view(torch.int16), out.cpu().view(torch.int16))),
        "fp8": bool(torch.equal(ours_fp8.view(torch.int16), vllm_fp8.cpu().view(torch.int16))),
    }
print(json.dumps(found))
"""


@_HAS_DISK_OFFLOAD
def test_host_decode_equals_vllm_s_device_decode_on_the_gpu():
    """Where a GPU and vLLM 0.34.0 are here (tools/check-gpu.sh): our CPU gather's decode of
    NVFP4 and FP8 rows (what the host decode stages) equals, bit for bit, vLLM's own device
    decode of the same rows: its NVFP4 ``decode_rows`` (Triton) and its FP8 ``dequantize``."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU: vLLM's decode_rows is a Triton kernel")
    found = _last_json(run_python(_GPU_DECODE_SCRIPT))
    assert all(case == {"nvfp4": True, "fp8": True} for case in found.values()), found


_FAILED_READ_SCRIPT = (
    _EARLY_SETUP
    + r"""
path = os.path.join(folder, "dense-b.safetensors")  # shard 2's rows
os.truncate(path, os.path.getsize(path) - 32 * 3 // 2)  # its last row and a half gone
found = {}
with nothing_left_behind(), set_current_vllm_config(vc):
    input_ids, qsl, ctx = step_inputs(STEPS[0])
    ids = original(type(twin).compute_ngram_ids)(twin, input_ids, qsl, ctx)
    ids[0, 0] = rows - 1  # the lost row (the ids buffer is vLLM's: rewrite the hashed ids)
    twin.compute_ngram_ids = lambda *args: ids  # this step's ids, as hashed above, with it
    nvidia.stage_checkpoint_rows([(twin, emb)], input_ids, qsl, ctx)
    found["returned"] = True  # the read failed on the worker, not here
    try:
        emb.staged_rows(input_ids.shape[0])
        found["error"] = None
    except Exception as exc:
        found["error"] = [type(exc).__name__, str(exc)]
    del twin.compute_ngram_ids
    ids[0, 0] = 0  # a row the file still has: the next step reads again
    twin.compute_ngram_ids = lambda *args: ids
    nvidia.stage_checkpoint_rows([(twin, emb)], input_ids, qsl, ctx)
    again = emb.staged_rows(input_ids.shape[0])
    found["next_step"] = same(again, planes["weight"][ids].flatten(-2))
    step_shim.join_worker()
found["path"] = path
print(json.dumps(found))
"""
)


@_HAS_DISK_OFFLOAD
def test_a_read_that_fails_on_the_worker_raises_in_the_forward(tmp_path):
    """Early started, a shard file cut short of a wanted row: ``stage_checkpoint_rows`` returns,
    and the forward's ``staged_rows`` raises vLLM's ValueError naming the file; the next step
    reads as before, and no thread or descriptor is left behind."""
    result = _last_json(run_python(_FAILED_READ_SCRIPT, env=_env(tmp_path, "dense")))
    assert result["returned"] is True
    assert result["error"][0] == "ValueError" and result["path"] in result["error"][1], result
    assert result["next_step"] is True, result
