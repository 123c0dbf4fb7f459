"""vLLM's AMD model state hands the PLE layer its n-gram context buffer with more rows than the
step has requests: 0.34.0 the whole buffer (a row per possible request, max_num_seqs rows),
both releases a padded request count. vLLM's ``ple_ngram_ids`` kernel reads the rows of the
``len(query_start_loc) - 1`` requests only; through the plugin the step must hash the same ids
and give the same embeddings as with exactly those rows.

Runs in a fresh interpreter: vLLM's own AMD ``Qwen4ExpModelState.prepare_inputs`` (its __init__
skipped: it needs a model runner) and AMD ``Qwen4ExpPLELayer`` on the CPU; the ids are compared
with the oracle (``qwen4exp_ext.reference.ngram_ids``) over the step's requests' rows.
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_support import require_vllm, run_python, vllm_version

pytestmark = require_vllm()
_MAX_REQS = 6  # vLLM's max_num_seqs in the script: the context buffer's rows

_SCRIPT = r"""
import json, os, sys
from types import SimpleNamespace
import torch
import vllm.plugins
vllm.plugins.load_general_plugins()  # VLLM_PLUGINS=qwen4exp: only ours
from transformers import Qwen4ExpTextConfig
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.forward_context import ForwardContext, override_forward_context
from vllm.models.qwen4_exp.amd import model_state as amd_state
from vllm.models.qwen4_exp.amd.ple_layer import Qwen4ExpPLELayer
from vllm.models.qwen4_exp.common.ops import ple as ple_ops
import qwen4exp_ext.vllm as plugin
from qwen4exp_ext import reference

sys.path.insert(0, os.environ["QWEN4EXP_TESTS"])
from hf_support import EOS, tiny_config

MAX_REQS = int(os.environ["QWEN4EXP_MAX_REQS"])
cfg = Qwen4ExpTextConfig(**tiny_config().to_dict())
vc = VllmConfig(device_config=DeviceConfig("cpu"))
with set_current_vllm_config(vc):
    init_distributed_environment(1, 0, "file://" + os.environ["QWEN4EXP_STORE"], 0, "gloo")
    initialize_model_parallel(1, 1)
object.__setattr__(vc, "model_config", SimpleNamespace(dtype=torch.float32))
vc.cache_config.mamba_block_size = 16
prefix = "amd.ple"
with set_current_vllm_config(vc):
    layer = Qwen4ExpPLELayer(cfg, vc, layer_idx=0, ple_dense_layer_id=0, prefix=prefix)
layer.eval()
emb = layer.ple_embedding
g = torch.Generator().manual_seed(5)
with torch.no_grad():
    emb.ngram_embedding.weight.copy_(torch.randn(emb.ngram_embedding.weight.shape, generator=g))

# vLLM's AMD model state, as its __init__ leaves it for this model (the runner it needs aside).
n_ctx = cfg.ngram_size - 1
state = object.__new__(amd_state.Qwen4ExpModelState)
state.vllm_config, state.model, state.rope_state = vc, layer, None
state.uses_ngram_embedding, state.ngram_context_len, state.ngram_eos_token_id = True, n_ctx, EOS
state.ngram_context = torch.full((MAX_REQS, n_ctx), EOS, dtype=torch.int32)
state.ngram_context_offsets = torch.arange(-n_ctx, 0, dtype=torch.int64)
state.ple_query_start_loc = torch.zeros(MAX_REQS + 1, dtype=torch.int32)

tokens = torch.randint(0, cfg.vocab_size, (3, 12), generator=g)
tokens[tokens % 7 == 0] = EOS
done = [0, 0, 0]
# Each step: (request, tokens this step) and the padded request count (vLLM pads the request
# count to a captured batch size; padded requests have no tokens).
STEPS = [([(0, 5), (1, 4)], 2), ([(0, 1), (1, 1)], 4), ([(2, 6)], 1), ([(2, 1), (0, 2)], 3)]

def batch(step, padded):
    ids, qsl = [], [0]
    for r, n in step:
        ids.append(tokens[r, done[r]:done[r] + n])
        qsl.append(qsl[-1] + n)
    qsl += [qsl[-1]] * (padded - len(step))
    input_batch = SimpleNamespace(
        num_reqs=len(step), num_reqs_after_padding=padded, num_tokens=qsl[-1],
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        idx_mapping=torch.tensor([r for r, _ in step], dtype=torch.int32),
        input_ids=torch.cat(ids).to(torch.int32))
    req_states = SimpleNamespace(num_computed_tokens=SimpleNamespace(gpu=torch.tensor(done)),
                                 all_token_ids=SimpleNamespace(gpu=tokens))
    return input_batch, req_states

def hashed(input_ids, qsl, ctx):
    return reference.ngram_ids(input_ids, qsl, ctx, emb.layer_multipliers,
                               emb.ngram_heads_vocab_sizes, emb.ngram_heads_offsets,
                               emb.eos_token_id, emb.heads_per_ngram)

result = {"swapped": plugin.swapped(), "steps": []}
context = ForwardContext(no_compile_layers={prefix: layer}, attn_metadata={}, slot_mapping={})
for step, padded in STEPS:
    input_batch, req_states = batch(step, padded)
    inputs = state.prepare_inputs(input_batch, req_states)
    qsl, ctx, ids = inputs["query_start_loc"], inputs["ngram_context"], input_batch.input_ids
    exact = ctx[: qsl.numel() - 1].clone()  # the rows of this step's (padded) requests
    want = hashed(ids, qsl, exact)
    found = {"context_rows": ctx.shape[0], "requests": qsl.numel() - 1}
    with override_forward_context(context), torch.no_grad():
        got = ple_ops.ple_ngram_ids(ids, qsl, ctx, emb.layer_multipliers,
                                    emb.ngram_heads_vocab_sizes, emb.ngram_heads_offsets,
                                    emb.eos_token_id, emb.heads_per_ngram)
        found["ids_equal"] = bool(torch.equal(got, want))
        rows = emb(ids, qsl, ctx)  # vLLM's AMD forward: its ngram_ids op, then the lookup
        expected = emb(ids, qsl, exact)
    found["rows_equal"] = bool(torch.equal(rows, expected))
    # The rows themselves: the table's rows at the oracle's ids, a token's heads side by side.
    table = emb.ngram_embedding.weight
    found["rows_are_the_tables"] = bool(torch.equal(rows, table[want].view(rows.shape)))
    result["steps"].append(found)
    for r, n in step:
        done[r] += n
print(json.dumps(result))
"""


def test_fewer_requests_than_context_rows_hash_only_the_steps_rows(tmp_path: Path) -> None:
    out = run_python(
        _SCRIPT,
        env={
            "VLLM_PLUGINS": "qwen4exp",
            "QWEN4EXP_TESTS": str(Path(__file__).parent),
            "QWEN4EXP_STORE": str(tmp_path / "store"),
            "QWEN4EXP_MAX_REQS": str(_MAX_REQS),
            "QWEN4EXP_VLLM_KERNELS": "ours",
            "QWEN4EXP_VLLM_CHOICE_CACHE": "0",
        },
    )
    result = json.loads(out.strip().splitlines()[-1])
    assert result["swapped"]
    for found in result["steps"]:
        assert found["context_rows"] >= found["requests"]
        assert found["ids_equal"], found
        assert found["rows_equal"], found
        assert found["rows_are_the_tables"], found
    if vllm_version() != "0.33.0":
        # 0.34.0 on hands over the whole buffer (0.33.0 slices it to the padded request count).
        assert all(f["context_rows"] == _MAX_REQS for f in result["steps"]), result
