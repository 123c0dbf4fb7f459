"""The vLLM plugin's step-entry lookups for vLLM's (0.33.0, 0.34.0) AMD Qwen4Exp model
(python/qwen4exp_ext/vllm/prefetch.py), against the real vLLM: the swaps are in place by default
and say so in vLLM's log, ``QWEN4EXP_VLLM_PREFETCH=0`` leaves vLLM's code and says that, and the
lookups start only on eager steps (never during a CUDA-graph capture or replay, whose pieces
keep vLLM's own lookup)."""

from __future__ import annotations

import json

import pytest

from vllm_support import require_vllm, run_python

pytestmark = require_vllm()

MODEL_CALL = "amd.model Qwen4ExpModel step-entry PLE lookups"
PINNED_OP = "qwen4_exp_amd_ple_ngram_embedding_pinned"

_SCRIPT = """
import importlib, json, logging, sys
records = []
class H(logging.Handler):
    def emit(self, r): records.append(r.getMessage())
logging.getLogger("vllm.qwen4exp_ext").addHandler(H())
logging.getLogger("vllm.qwen4exp_ext").setLevel(logging.INFO)
import vllm.plugins
vllm.plugins.load_general_plugins()
model = importlib.import_module("vllm.models.qwen4_exp.amd.model")
layer = importlib.import_module("vllm.models.qwen4_exp.amd.ple_layer")
import qwen4exp_ext.vllm as plugin
MARK = "__qwen4exp_replaces__"
print(json.dumps({
    "swapped": plugin.swapped(),
    "call_is_ours": hasattr(model.Qwen4ExpModel.__dict__["__call__"], MARK),
    "op_is_ours": hasattr(layer.qwen4_exp_amd_ple_ngram_embedding_pinned, MARK),
    "gate_is_ours": hasattr(layer.ple_gate, MARK),
    "log": records,
}))
"""


def _run(env: dict[str, str]) -> dict:
    out = run_python(_SCRIPT, env={"VLLM_PLUGINS": "qwen4exp", **env})
    return json.loads(out.strip().splitlines()[-1])


def test_on_by_default_and_said_in_vllms_log():
    found = _run({})
    assert found["call_is_ours"] and found["op_is_ours"] and found["gate_is_ours"]
    assert MODEL_CALL in found["swapped"] and PINNED_OP in found["swapped"]
    said = [line for line in found["log"] if "pinned PLE tables" in line]
    assert len(said) == 1 and "looked up at step entry" in said[0], found["log"]


@pytest.mark.parametrize("value", ["0", "off"])
def test_switched_off_leaves_vllms_lookup_and_says_so(value):
    found = _run({"QWEN4EXP_VLLM_PREFETCH": value})
    assert not found["call_is_ours"] and not found["op_is_ours"]
    assert found["gate_is_ours"]  # the kernels are still ours
    assert MODEL_CALL not in found["swapped"] and PINNED_OP not in found["swapped"]
    said = [line for line in found["log"] if "pinned PLE tables" in line]
    assert len(said) == 1 and "QWEN4EXP_VLLM_PREFETCH=0" in said[0], found["log"]
    assert "sync_lookup" in said[0]


def test_lookups_start_only_on_eager_steps():
    """The gate of the step-entry lookups: vLLM's forward context of an eager step (mode NONE)
    lets them start; a CUDA-graph step (PIECEWISE or FULL: captured or replayed pieces, which
    hold vLLM's own lookup) or no forward context does not."""
    out = run_python(
        """
import json, torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import ForwardContext, override_forward_context
from qwen4exp_ext.vllm.shims import amd
seen = {"none": amd._eager_forward_context() is None}
for mode in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
    context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={},
                             cudagraph_runtime_mode=mode)
    with override_forward_context(context):
        seen[mode.name] = amd._eager_forward_context() is context
print(json.dumps(seen))
"""
    )
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen == {"none": True, "NONE": True, "PIECEWISE": False, "FULL": False}


def test_a_cpu_step_starts_nothing_and_takes_nothing():
    """On a CPU (no UVA, no pinned tables) the model's entry starts no lookup, and the pinned
    op finds none to take: vLLM runs exactly as before."""
    out = run_python(
        """
import json, torch
from types import SimpleNamespace
from vllm.config import CUDAGraphMode
from vllm.forward_context import ForwardContext, override_forward_context
from qwen4exp_ext.vllm import prefetch
from qwen4exp_ext.vllm.shims import amd
context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={},
                         cudagraph_runtime_mode=CUDAGraphMode.NONE)
model = SimpleNamespace(layers=[SimpleNamespace(ple=None)], start_layer=0, end_layer=1)
ids = torch.arange(6)
with override_forward_context(context):
    amd._start_step_lookups(model, (ids, None, None, None, torch.tensor([0, 6]),
                                    torch.zeros(1, 2, dtype=torch.long)), {})
print(json.dumps({"slots": len(prefetch.STEP_LOOKUPS._slots),
                  "taken": prefetch.STEP_LOOKUPS.take(torch.nn.Module(), 6, context) is None}))
"""
    )
    found = json.loads(out.strip().splitlines()[-1])
    assert found == {"slots": 0, "taken": True}
