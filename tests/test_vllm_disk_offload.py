"""vLLM 0.34.0's PLE ``disk_offload`` (``Qwen4ExpPLEDiskOffloadEmbedding``) with the plugin in
place, on the CPU: vLLM stages the rows of a table kept in its safetensors file itself, and its
FP8 rows reach the method's ``dequantize`` as raw bytes, which the plugin must then scale as
vLLM does (its fused-FP8 shortcut is for the lookups it serves, not for rows it never read).

The table is a real safetensors file in tmp_path, handed to vLLM as its loader does: a view of
the file's mapping (``bind_file_shards`` finds the file and offset in /proc/self/maps)."""

from __future__ import annotations

import json

import pytest

from vllm_support import require_vllm, run_python, vllm_version

pytestmark = [
    *require_vllm(),
    pytest.mark.skipif(
        vllm_version() == "0.33.0", reason="vLLM 0.33.0 has no disk_offload (0.34.0 on)"
    ),
]

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


@pytest.mark.parametrize("plugins", ["qwen4exp", "none"])
def test_fp8_rows_staged_from_the_file_are_scaled_as_vllm_does(tmp_path, plugins):
    out = run_python(_SCRIPT, env={"VLLM_PLUGINS": plugins, "QWEN4EXP_FOLDER": str(tmp_path)})
    found = json.loads(out.strip().splitlines()[-1])
    assert found["dequantize_swapped"] is (plugins == "qwen4exp")
    assert found["equal"] is True, found
