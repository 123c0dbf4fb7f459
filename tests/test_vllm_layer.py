"""Issue test 4b (and #48 on 0.34.0): the installed vLLM's own ``Qwen4ExpPLELayer`` (AMD path)
on our kernels equals transformers 5.18's ``Qwen4ExpTextPLELayer``, for a dense, an FP8 and an
NVFP4 PLE table.

vLLM's layer is built on CPU from a small config (a ``VllmConfig``, a single-process gloo
distributed init), given transformers' weights, and run through chunked prefills and decode
steps of several requests, each step with the PLE short-conv metadata that vLLM's own
``PleShortConvAttentionMetadataBuilder`` builds from a ``CommonAttentionMetadata`` (decodes
first, as vLLM orders a batch), one conv-state slot per request in a cache whose slot 0 is the
null slot. The profiler proves that ``qwen4exp::ngram_ids``, ``qwen4exp::gather_rows``,
``qwen4exp::ple_gate`` and ``qwen4exp::ple_conv`` ran; the per-request outputs, stitched
together, must equal ``hidden + transformers(whole sequence)`` in fp32.

The quantized tables are loaded from a checkpoint through vLLM's own loader (one shard:
``split_ngram_parts=1``); transformers gets their dequantised values as its fp32 table. vLLM
itself refuses NVFP4 tables in its AMD layer: with the plugin, the layer builds, loads and runs
them on our gather.

The vLLM part runs in a fresh interpreter (distributed init, plugin registration and vLLM's
static forward context are process-global); transformers runs here, and the two exchange
tensors through a file.
"""

from __future__ import annotations

import os

import pytest
import torch

from vllm_support import require_vllm, run_python

pytestmark = require_vllm()

if os.environ.get("QWEN4EXP_REQUIRE_VLLM") != "1":  # vLLM itself needs it
    pytest.importorskip("transformers.models.qwen4_exp")
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextPLELayer  # noqa: E402

from hf_support import EOS, tiny_config  # noqa: E402
from qwen4exp_ext import reference  # noqa: E402

OUR_OPS = (
    "qwen4exp::ngram_ids",
    "qwen4exp::gather_rows",
    "qwen4exp::ple_gate",
    "qwen4exp::ple_conv",
)

# Request lengths and the schedule: each step lists (request, tokens this step). A one-token
# chunk of a request that already has tokens is a decode; vLLM puts decodes first in a batch.
LENGTHS = {"A": 14, "B": 10, "C": 8}
# Prompt lengths: a one-token prompt chunk after earlier ones (A's 12th, B's 4th and 5th token)
# is a prefill that vLLM turns into a decode; the tokens after the prompt are true decodes.
PROMPTS = {"A": 12, "B": 9, "C": 6}
SLOTS = {"A": 1, "B": 3, "C": 2}  # slot 0 is vLLM's null slot
STEPS = [
    [("A", 5), ("B", 3)],  # two first chunks (prefill, no initial state)
    [("B", 1), ("A", 6), ("C", 4)],  # a decode, a continued prefill, a new request
    [("A", 1), ("B", 1), ("C", 2)],  # two decodes, a short continued prefill
    [("A", 1), ("C", 1), ("B", 4)],  # decodes, then B's long chunk
    [("A", 1), ("C", 1)],  # decodes only
    [("B", 1)],  # a single decode
]


# The vLLM side. Reads the case from $QWEN4EXP_CASE (torch.save'd by the test), writes the
# per-step outputs and the profiler's op names next to it.
_VLLM_SCRIPT = r"""
import os
from types import SimpleNamespace

os.environ["VLLM_PLUGINS"] = "qwen4exp"
import torch
import vllm.plugins

vllm.plugins.load_general_plugins()  # as every vLLM process does: only our plugin

from transformers import Qwen4ExpTextConfig
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.forward_context import ForwardContext, override_forward_context
from vllm.models.qwen4_exp.amd.ple_layer import Qwen4ExpPLELayer
from vllm.v1.attention.backend import CommonAttentionMetadata

import qwen4exp_ext.vllm as plugin

case = torch.load(os.environ["QWEN4EXP_CASE"], weights_only=False)
cfg = Qwen4ExpTextConfig(**case["config"])
w = case["weights"]

vc = VllmConfig(device_config=DeviceConfig("cpu"))
store = os.path.join(os.path.dirname(os.environ["QWEN4EXP_OUT"]), "dist_store")
with set_current_vllm_config(vc):
    init_distributed_environment(1, 0, "file://" + store, 0, "gloo")
    initialize_model_parallel(1, 1)
# initialize_model_parallel reads model_config.is_moe; the layer reads only model_config.dtype.
object.__setattr__(vc, "model_config", SimpleNamespace(dtype=torch.float32))
vc.cache_config.mamba_block_size = 16  # for the MambaSpec; one state block per request

prefix = "model.layers.0.ple"
with set_current_vllm_config(vc):
    layer = Qwen4ExpPLELayer(
        cfg, vc, layer_idx=0, ple_dense_layer_id=case["ple_layer_index"], prefix=prefix
    )
layer.eval()
emb = layer.ple_embedding
for name in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets"):
    assert torch.equal(getattr(emb, name), w[name]), name  # vLLM hashes like transformers
table_format = case["table_format"]
if table_format == "dense":
    with torch.no_grad():
        assert emb.ngram_embedding.weight.shape == w["table"].shape
        emb.ngram_embedding.weight.copy_(w["table"])
else:  # a quantized checkpoint, through vLLM's AMD loader (the plugin's, for NVFP4)
    loaded = emb.load_weights(list(w["checkpoint"].items()))
    assert "ngram_embedding.weight" in loaded, loaded
with torch.no_grad():
    layer.kv_proj.weight.copy_(torch.cat([w["key_proj"], w["value_proj"]]))
    layer.norm_key.weight.copy_(w["norm_key"])
    layer.norm_query.weight.copy_(w["norm_query"])
    layer.norm_conv.weight.copy_(w["norm_conv"])
    layer.conv1d.weight.copy_(w["conv1d"])

spec = layer.get_kv_cache_spec(vc)
builder = layer.get_attn_backend().get_builder_cls()(spec, [prefix], vc, torch.device("cpu"))
num_slots = max(case["slots"].values()) + 1
layer.kv_cache = (torch.zeros(num_slots, *layer.get_state_shape()[0], dtype=torch.float32),)

n_ctx = cfg.ngram_size - 1
done = {r: 0 for r in case["ids"]}
outputs = []  # per step: {request: [chunk, C]}
kinds = []
with recorded_ops() as names:
    for step in case["steps"]:
        # vLLM's batch order: decodes (one new token after earlier ones) before prefills
        decodes = [(r, n) for r, n in step if n == 1 and done[r] > 0]
        prefills = [(r, n) for r, n in step if not (n == 1 and done[r] > 0)]
        batch = decodes + prefills
        ids, hidden, ctx, qsl, seq_lens = [], [], [], [0], []
        for r, n in batch:
            a = done[r]
            ids.append(case["ids"][r][a : a + n])
            hidden.append(case["hidden"][r][a : a + n])
            before = [cfg.eos_token_id] * n_ctx + case["ids"][r][:a].tolist()
            ctx.append(before[len(before) - n_ctx :])
            qsl.append(qsl[-1] + n)
            seq_lens.append(a + n)
        ids, hidden = torch.cat(ids), torch.cat(hidden)
        qsl_t = torch.tensor(qsl, dtype=torch.int32)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=qsl_t,
            query_start_loc_cpu=qsl_t.clone(),
            seq_lens=seq_lens_t,
            seq_lens_cpu_upper_bound=seq_lens_t.clone(),
            is_prefilling=torch.tensor([done[r] < case["prompts"][r] for r, _ in batch]),
            num_reqs=len(batch),
            num_actual_tokens=qsl[-1],
            max_query_len=max(n for _, n in batch),
            max_seq_len=max(seq_lens),
            block_table_tensor=torch.tensor(
                [[case["slots"][r]] for r, _ in batch], dtype=torch.int32
            ),
            slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64),
        )
        md = builder.build(0, common)
        kinds.append([md.num_decodes, md.num_prefills])
        assert md.num_decodes == len(decodes) and md.num_prefills == len(prefills), kinds
        context = ForwardContext(
            no_compile_layers={prefix: layer}, attn_metadata={prefix: md}, slot_mapping={}
        )
        with override_forward_context(context), torch.no_grad():
            out = layer(hidden, ids, qsl_t, torch.tensor(ctx, dtype=ids.dtype))
        outputs.append({r: out[qsl[i] : qsl[i + 1]].clone() for i, (r, _) in enumerate(batch)})
        for r, n in batch:
            done[r] += n

state_max = layer.kv_cache[0].abs().flatten(1).amax(1).tolist()  # per slot
torch.save(
    {"outputs": outputs, "names": sorted(set(names)), "swapped": list(plugin.swapped()),
     "kinds": kinds, "state_max": state_max},
    os.environ["QWEN4EXP_OUT"],
)
print("ok")
"""


def _script() -> str:
    """The vLLM script, with vllm_support's profiler helper inlined (no tests/ on its path)."""
    import inspect

    from vllm_support import recorded_ops as helper

    source = inspect.getsource(helper)
    return "from contextlib import contextmanager\nimport torch\n" + source + _VLLM_SCRIPT


TABLE_FORMATS = ("dense", "fp8", "nvfp4")
FP8_SCALE = 0.05
NVFP4_GLOBAL_SCALE = 0.37


def quantized_checkpoint(table_format: str, hf_table: torch.Tensor):
    """(checkpoint tensors in vLLM's names, their dequantised fp32 table) for a table of
    ``hf_table``'s shape: what a quantized Qwen4Exp checkpoint holds, and what it means."""
    rows, width = hf_table.shape
    prefix = "ngram_embedding"
    if table_format == "fp8":
        rows_fp8 = (hf_table / FP8_SCALE).to(torch.float8_e4m3fn)
        scale = torch.tensor([FP8_SCALE])
        checkpoint = {f"{prefix}.shard_0.weight": rows_fp8, f"{prefix}.weight_scale": scale}
        return checkpoint, rows_fp8.float() * scale
    gen = torch.Generator().manual_seed(18)
    packed = torch.randint(0, 256, (rows, width // 2), dtype=torch.uint8, generator=gen)
    block_scales = (torch.rand(rows, width // 16, generator=gen) * 0.5 + 0.01).to(
        torch.float8_e4m3fn
    )
    scale = torch.tensor([NVFP4_GLOBAL_SCALE])
    checkpoint = {
        f"{prefix}.shard_0.weight": packed,
        f"{prefix}.shard_0.weight_scale": block_scales,
        f"{prefix}.weight_scale_2": scale,
    }
    return checkpoint, reference.nvfp4_decode(packed, block_scales) * scale


@pytest.fixture(scope="module", params=TABLE_FORMATS)
def transformers_case(request):
    table_format = request.param
    torch.manual_seed(16)
    overrides = {}
    if table_format != "dense":
        # vLLM's config field; one checkpoint shard; NVFP4 needs heads of 16 elements.
        overrides = dict(
            ple_embedding_dtype="nvfp4" if table_format == "nvfp4" else "float8_e4m3fn",
            split_ngram_parts=1,
        )
        if table_format == "nvfp4":
            overrides["ple_embed_dim"] = 64
    cfg = tiny_config(**overrides)
    ple_layer_index = 0
    hf = Qwen4ExpTextPLELayer(cfg, layer_idx=0, ple_layer_index=ple_layer_index)
    checkpoint = None
    with torch.no_grad():
        for norm in (hf.norm_key, hf.norm_query, hf.norm_conv):
            norm.weight.normal_(0.0, 0.3)
        hf.conv1d.weight.normal_(0.0, 0.5)
        if table_format != "dense":
            hf_table = hf.ple_embedding.ngram_embedding.weight
            checkpoint, dequantised = quantized_checkpoint(table_format, hf_table)
            hf_table.copy_(dequantised)
    gen = torch.Generator().manual_seed(17)
    c = cfg.hc_count * cfg.hidden_size
    ids, hidden, expected = {}, {}, {}
    for r, length in LENGTHS.items():
        ids[r] = torch.randint(0, cfg.vocab_size, (length,), generator=gen)
        ids[r][ids[r] % 6 == 0] = EOS  # EOS inside the sequences, some adjacent
        hidden[r] = torch.randn(length, c, generator=gen) * 2
        with torch.no_grad():
            expected[r] = hf(hidden[r][None], ids[r][None], None)[0]
    emb = hf.ple_embedding
    weights = dict(
        table=emb.ngram_embedding.weight.detach().clone(),
        layer_multipliers=emb.layer_multipliers.clone(),
        ngram_heads_vocab_sizes=emb.ngram_heads_vocab_sizes.clone(),
        ngram_heads_offsets=emb.ngram_heads_offsets.clone(),
        key_proj=hf.key_proj.weight.detach().clone(),
        value_proj=hf.value_proj.weight.detach().clone(),
        norm_key=hf.norm_key.weight.detach().clone(),
        norm_query=hf.norm_query.weight.detach().clone(),
        norm_conv=hf.norm_conv.weight.detach().clone(),
        conv1d=hf.conv1d.weight.detach().clone(),
    )
    if checkpoint is not None:
        weights["checkpoint"] = checkpoint
    case = dict(
        table_format=table_format,
        config=cfg.to_dict(),
        ple_layer_index=ple_layer_index,
        weights=weights,
        ids=ids,
        hidden=hidden,
        slots=SLOTS,
        prompts=PROMPTS,
        steps=STEPS,
    )
    return case, expected


@pytest.fixture(scope="module")
def vllm_run(transformers_case, tmp_path_factory):
    case, _ = transformers_case
    work = tmp_path_factory.mktemp("vllm_layer")
    torch.save(case, work / "case.pt")
    out = run_python(
        _script(),
        env={
            "QWEN4EXP_CASE": str(work / "case.pt"),
            "QWEN4EXP_OUT": str(work / "out.pt"),
        },
        timeout=240,
    )
    assert out.strip().splitlines()[-1] == "ok", out
    return torch.load(work / "out.pt", weights_only=False)


def test_schedule_covers_every_token_and_mixes_decodes_with_prefills(vllm_run):
    for r, length in LENGTHS.items():
        assert sum(n for step in STEPS for q, n in step if q == r) == length
    # decode + prefill batches, prefill-only and decode-only batches all occur
    kinds = {(d > 0, p > 0) for d, p in vllm_run["kinds"]}
    assert kinds == {(True, True), (False, True), (True, False)}, vllm_run["kinds"]


def test_conv_state_lives_in_the_requests_slots_and_never_in_the_null_slot(vllm_run):
    state_max = vllm_run["state_max"]
    assert state_max[0] == 0, f"the null slot was written: {state_max}"
    assert all(state_max[slot] > 0 for slot in SLOTS.values()), state_max


SWAPS_USED = {
    "dense": ("Qwen4ExpPLEEmbeddingMethod.embedding",),
    "fp8": ("Qwen4ExpPLEEmbeddingMethod.embedding", "Qwen4ExpPLEFp8EmbeddingMethod.dequantize"),
    "nvfp4": (
        "Qwen4ExpPLENvFp4EmbeddingMethod.embedding",
        "amd.ple_layer NVFP4 refusal",
        "Qwen4ExpNGramEmbedding.load_weights",
    ),
}


def test_vllm_ple_layer_runs_our_kernels(transformers_case, vllm_run):
    table_format = transformers_case[0]["table_format"]
    for label in ("ple_ngram_ids", "ple_gate", "ple_conv", *SWAPS_USED[table_format]):
        assert label in vllm_run["swapped"], vllm_run["swapped"]
    missing = [op for op in OUR_OPS if op not in vllm_run["names"]]
    assert not missing, f"not run: {missing}; profiler saw {vllm_run['names']}"


def test_vllm_ple_layer_chunked_prefill_and_decode_match_transformers(transformers_case, vllm_run):
    case, expected = transformers_case
    for r in LENGTHS:
        ours = torch.cat([step[r] for step in vllm_run["outputs"] if r in step])
        theirs = expected[r]
        scale = theirs.abs().max().item()
        torch.testing.assert_close(
            ours,
            case["hidden"][r] + theirs,
            rtol=0,
            atol=1e-5 * scale,
            msg=lambda m, r=r: f"request {r}: {m}",
        )
