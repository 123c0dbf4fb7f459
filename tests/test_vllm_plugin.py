"""The vLLM plugin against the real vLLM 0.33.0 (no mocks): entry point, VLLM_PLUGINS filtering,
idempotent register(), the version/signature guard, and the swap itself — vLLM's module-level
functions and its torch.ops.vllm ops run our kernels (profiler record) with results equal to our
reference. With the plugin filtered out, vLLM's functions are untouched."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
import torch

from qwen4exp_ext import ops, reference
from vllm_support import recorded_ops, require_vllm, run_python

pytestmark = require_vllm()

PLE_OPS = "vllm.models.qwen4_exp.common.ops.ple"
AMD_LAYER = "vllm.models.qwen4_exp.amd.ple_layer"
MARK = "__qwen4exp_replaces__"
# vLLM's module-level names of each swappable function, and the op of ours that serves it.
FUNCTIONS = {"ple_ngram_ids": "ngram_ids", "ple_gate": "ple_gate", "ple_conv": "ple_conv"}


@pytest.fixture(scope="module")
def vllm_plugged():
    """vLLM's AMD PLE layer imported first (so its torch.ops.vllm ops hold vLLM's own function
    objects), then the general plugins loaded the way every vLLM process does, with only ours."""
    saved = os.environ.get("VLLM_PLUGINS")
    os.environ["VLLM_PLUGINS"] = "qwen4exp"
    import importlib

    import vllm.plugins

    amd = importlib.import_module(AMD_LAYER)
    ple = importlib.import_module(PLE_OPS)
    originals = {name: getattr(ple, name) for name in FUNCTIONS}
    vllm.plugins.load_general_plugins()
    import qwen4exp_ext.vllm as plugin

    yield SimpleNamespace(amd=amd, ple=ple, originals=originals, plugin=plugin)
    if saved is None:
        os.environ.pop("VLLM_PLUGINS", None)
    else:
        os.environ["VLLM_PLUGINS"] = saved


def _toy_case(device: str = "cpu", id_dtype=torch.int64):
    """A few requests of odd lengths with EOS inside; the layout of the released model's first
    PLE layer (real multipliers, prime head sizes, 64-bit offsets)."""
    from qwen4exp_ext import layout

    g = torch.Generator().manual_seed(7)
    lens = [5, 1, 0, 13, 2]
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    eos = 3
    ids = torch.randint(0, 40, (int(qsl[-1]),), generator=g, dtype=id_dtype)
    ctx = torch.randint(0, 40, (len(lens), 2), generator=g, dtype=id_dtype)
    heads = layout.head_vocab_layout(20_000_000, 16, 0, 128)
    mult = torch.tensor(layout.layer_multipliers(248_320, 3, 1234, 0))
    args = (
        ids.to(device),
        qsl.to(device),
        ctx.to(device),
        mult.to(device),
        torch.tensor(heads.sizes, device=device),
        torch.tensor(heads.offsets, device=device),
        eos,
        8,
    )
    return args


# ---- packaging ------------------------------------------------------------------------------


def test_importing_the_package_never_imports_vllm():
    out = run_python(
        """
        import sys
        import qwen4exp_ext, qwen4exp_ext.ops, qwen4exp_ext.vllm, qwen4exp_ext.vllm.shims
        print(sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm.")))
        """
    )
    assert out.strip() == "[]"


def test_entry_point_names_the_register_function():
    from importlib.metadata import entry_points

    found = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert found.get("qwen4exp") == "qwen4exp_ext.vllm:register", (
        'pyproject.toml must declare [project.entry-points."vllm.general_plugins"] '
        f'qwen4exp = "qwen4exp_ext.vllm:register"; found {found}'
    )


# ---- the swap, in this process (4a) ---------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_every_function_is_swapped_iff_our_build_has_its_kernel(vllm_plugged, name):
    have = hasattr(ops, FUNCTIONS[name])
    original = vllm_plugged.originals[name]
    for module in (vllm_plugged.ple, vllm_plugged.amd):
        fn = getattr(module, name)
        if have:
            assert getattr(fn, MARK, None) is original, f"{module.__name__}.{name} not swapped"
            assert name in vllm_plugged.plugin.swapped()
        else:
            assert fn is original, f"{module.__name__}.{name} swapped without our kernel"


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("where", ["common.ops.ple", "amd.ple_layer"])
def test_ple_ngram_ids_runs_ours_and_equals_the_reference(vllm_plugged, where, id_dtype):
    module = vllm_plugged.ple if where == "common.ops.ple" else vllm_plugged.amd
    args = _toy_case(id_dtype=id_dtype)
    expected = reference.ngram_ids(*args)
    with recorded_ops() as names:
        got = module.ple_ngram_ids(*args)
    assert "qwen4exp::ngram_ids" in names
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # vLLM's keyword call, into a preallocated int64 output (as the AMD op does)
    out = torch.full_like(expected, -1)
    kwargs = dict(
        zip(
            [
                "input_ids",
                "query_start_loc",
                "ngram_context",
                "layer_multipliers",
                "ngram_heads_vocab_sizes",
                "ngram_heads_offsets",
                "eos_token_id",
                "heads_per_ngram",
            ],
            args,
            strict=True,
        )
    )
    assert module.ple_ngram_ids(**kwargs, output=out) is out
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_torch_op_qwen4_exp_amd_ple_ngram_ids_runs_ours(vllm_plugged):
    """The op vLLM registered at import calls the module global, which is now ours."""
    from vllm.forward_context import ForwardContext, override_forward_context

    amd = vllm_plugged.amd
    args = _toy_case()
    ids, qsl, ctx, mult, sizes, offsets, eos, heads = args
    layer = amd.Qwen4ExpPLELayer.__new__(amd.Qwen4ExpPLELayer)
    torch.nn.Module.__init__(layer)
    layer.ple_embedding = SimpleNamespace(
        layer_multipliers=mult,
        ngram_heads_vocab_sizes=sizes,
        ngram_heads_offsets=offsets,
        eos_token_id=eos,
        heads_per_ngram=heads,
    )
    context = ForwardContext(no_compile_layers={"ple.0": layer}, attn_metadata={}, slot_mapping={})
    expected = reference.ngram_ids(*args)
    out = torch.empty_like(expected)
    with override_forward_context(context), recorded_ops() as names:
        torch.ops.vllm.qwen4_exp_amd_ple_ngram_ids(ids, qsl, ctx, out, "ple.0")
    assert "qwen4exp::ngram_ids" in names
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.skipif(not hasattr(ops, "ple_gate"), reason="ops.ple_gate not in this build yet")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_torch_op_qwen4_exp_ple_gate_runs_ours(vllm_plugged, dtype):
    """vLLM registered torch.ops.vllm.qwen4_exp_ple_gate with its own function object before
    the plugin loaded: the plugin re-registered the kernel for this platform's dispatch key."""
    g = torch.Generator().manual_seed(3)
    t, m, h = 7, 3, 40
    kv = torch.randn(t, m * h + h, generator=g).to(dtype)
    key, value = kv.split([m * h, h], dim=-1)
    hidden = torch.randn(t, m * h, generator=g).to(dtype)
    w = [0.1 * torch.randn(m * h, generator=g).to(dtype) for _ in range(3)]
    exp_gated, exp_conv = reference.ple_gate(key, value, hidden, *w, 1e-6)
    with recorded_ops() as names:
        gated, conv_in = torch.ops.vllm.qwen4_exp_ple_gate(key, value, hidden, *w, 1e-6)
    assert "qwen4exp::ple_gate" in names
    torch.testing.assert_close(gated, exp_gated)
    torch.testing.assert_close(conv_in, exp_conv)


@pytest.mark.skipif(not hasattr(ops, "gather_rows"), reason="ops.gather_rows not in this build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_table_lookups_run_ours(vllm_plugged, dtype):
    """vLLM's Qwen4ExpPLEEmbeddingMethod (shared by its unquantized and FP8 methods): the device
    table's ``embedding`` and the pinned table's ``lookup_from_pinned`` (this rank owning rows
    [start, end) of the global table; other rows read zero)."""
    import vllm.models.qwen4_exp.common.ngram_embedding as ne

    method = ne.Qwen4ExpPLEUnquantizedEmbeddingMethod()
    g = torch.Generator().manual_seed(5)
    rows, d, t, nh = 300, 24, 9, 4
    table = torch.randn(rows, d, generator=g).to(dtype)
    ids = torch.randint(0, rows, (t, nh), generator=g)
    layer = SimpleNamespace(weight=table)
    with recorded_ops() as names:
        got = method.embedding(layer, ids)
    assert "qwen4exp::gather_rows" in names
    assert torch.equal(got, torch.nn.functional.embedding(ids, table))

    start, end = 1000, 1000 + rows
    global_ids = torch.randint(start - 200, end + 200, (t * nh,), generator=g)
    shard = SimpleNamespace(org_vocab_start_index=start, org_vocab_end_index=end)
    pinned = SimpleNamespace(_uva_weight=table, weight=table, shard_indices=shard, embedding_dim=d)
    output = torch.full((t, nh, d), float("nan"), dtype=dtype)
    with recorded_ops() as names:
        method.lookup_from_pinned(pinned, global_ids, output)
    assert "qwen4exp::gather_rows" in names
    owned = (global_ids >= start) & (global_ids < end)
    expected = torch.where(
        owned[:, None], table[(global_ids - start).clamp(0, rows - 1)], torch.zeros((), dtype=dtype)
    )
    assert torch.equal(output.view(-1, d), expected)


def test_fp8_table_lookups_stay_vllms(vllm_plugged):
    """vLLM moves fp8 rows as raw bytes through its all-reduce; our gather dequantizes, so fp8
    tables keep vLLM's own lookup (same bytes either way)."""
    import vllm.models.qwen4_exp.common.ngram_embedding as ne

    method = ne.Qwen4ExpPLEFp8EmbeddingMethod()
    table = torch.randn(50, 16).to(torch.float8_e4m3fn)
    ids = torch.randint(0, 50, (5, 2))
    with recorded_ops() as names:
        got = method.embedding(SimpleNamespace(weight=table), ids)
    assert "qwen4exp::gather_rows" not in names
    assert torch.equal(got.view(torch.uint8), table.view(torch.uint8)[ids])


def test_register_again_changes_nothing_and_warns_nothing(vllm_plugged, caplog):
    plugin = vllm_plugged.plugin
    before = {n: getattr(vllm_plugged.ple, n) for n in FUNCTIONS}
    swapped = plugin.swapped()
    logger = logging.getLogger("vllm.qwen4exp_ext")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        for _ in range(3):
            plugin.register()
    finally:
        logger.removeHandler(handler)
    assert {n: getattr(vllm_plugged.ple, n) for n in FUNCTIONS} == before
    assert plugin.swapped() == swapped
    assert not [r for r in records if r.levelno >= logging.WARNING]


# ---- fresh interpreters: other import orders, the plugin off, the guard ---------------------

_PROBE = """
import importlib, json, sys
MARK = "__qwen4exp_replaces__"
def probe():
    ple = sys.modules["vllm.models.qwen4_exp.common.ops.ple"]
    out = {}
    for mod_name in ("vllm.models.qwen4_exp.common.ops.ple", "vllm.models.qwen4_exp.amd.ple_layer"):
        mod = sys.modules[mod_name]
        for name in ("ple_ngram_ids", "ple_gate", "ple_conv"):
            fn = getattr(mod, name)
            label = mod_name.rsplit(".", 1)[-1] + "." + name
            out[label] = fn.__module__ + ("+ours" if hasattr(fn, MARK) else "")
    out["plugin_imported"] = "qwen4exp_ext.vllm" in sys.modules
    return out
"""


# Collects the plugin's log records in `records`.
_CAPTURE_PLUGIN_LOG = """
import logging
records = []
class H(logging.Handler):
    def emit(self, r): records.append(r)
logging.getLogger("vllm.qwen4exp_ext").addHandler(H())
"""


def test_plugin_filtered_out_leaves_vllm_untouched():
    out = run_python(
        _PROBE
        + """
import vllm.plugins
vllm.plugins.load_general_plugins()
importlib.import_module("vllm.models.qwen4_exp.amd.ple_layer")
print(json.dumps(probe()))
""",
        env={"VLLM_PLUGINS": "some_other_plugin"},
    )
    import json

    found = json.loads(out.strip().splitlines()[-1])
    assert found.pop("plugin_imported") is False
    assert found and all(v == PLE_OPS for v in found.values()), found


def test_plugin_loaded_before_vllm_imports_the_model():
    """vLLM loads plugins before it imports the model: the post-import hook swaps the functions
    before ple_layer binds them, so its op registrations take ours directly."""
    out = run_python(
        _PROBE
        + """
import vllm.plugins, torch
vllm.plugins.load_general_plugins()
assert "vllm.models.qwen4_exp.common.ops.ple" not in sys.modules  # nothing imported eagerly
amd = importlib.import_module("vllm.models.qwen4_exp.amd.ple_layer")
import qwen4exp_ext.vllm as plugin
from qwen4exp_ext import reference
print(json.dumps({**probe(), "swapped": plugin.swapped()}))
""",
        env={"VLLM_PLUGINS": "qwen4exp"},
    )
    import json

    found = json.loads(out.strip().splitlines()[-1])
    assert found["plugin_imported"] is True
    assert found["ple.ple_ngram_ids"] == "qwen4exp_ext.vllm.shims+ours"
    assert found["ple_layer.ple_ngram_ids"] == "qwen4exp_ext.vllm.shims+ours"
    for name, our_op in FUNCTIONS.items():
        want = "qwen4exp_ext.vllm.shims+ours" if hasattr(ops, our_op) else PLE_OPS
        assert found[f"ple_layer.{name}"] == want
        assert (name in found["swapped"]) == hasattr(ops, our_op)


def test_unknown_vllm_version_warns_once_and_swaps_nothing():
    out = run_python(
        _PROBE
        + _CAPTURE_PLUGIN_LOG
        + """
import qwen4exp_ext.vllm as plugin
plugin.version = lambda name: "0.34.1"  # what importlib.metadata would say after an upgrade
for _ in range(3):
    plugin.register()
importlib.import_module("vllm.models.qwen4_exp.amd.ple_layer")
warnings = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
print(json.dumps({**probe(), "warnings": warnings, "swapped": plugin.swapped()}))
"""
    )
    import json

    found = json.loads(out.strip().splitlines()[-1])
    assert len(found["warnings"]) == 1 and "0.34.1" in found["warnings"][0], found["warnings"]
    assert found["swapped"] == []
    assert all(v == PLE_OPS for k, v in found.items() if "." in k and k.endswith(tuple(FUNCTIONS)))


def test_changed_vllm_signature_warns_once_naming_it_and_swaps_nothing():
    out = run_python(
        _PROBE
        + _CAPTURE_PLUGIN_LOG
        + """
ple = importlib.import_module("vllm.models.qwen4_exp.common.ops.ple")
vllm_fn = ple.ple_ngram_ids
def ple_ngram_ids(input_ids, query_start_loc, ngram_context, layer_multipliers,
                  ngram_heads_vocab_sizes, ngram_heads_offsets, eos_token_id, heads_per_ngram,
                  output=None, new_flag=False):
    return vllm_fn(input_ids, query_start_loc, ngram_context, layer_multipliers,
                   ngram_heads_vocab_sizes, ngram_heads_offsets, eos_token_id, heads_per_ngram,
                   output)
ple_ngram_ids.__module__ = ple.__name__
ple.ple_ngram_ids = ple_ngram_ids  # a future vLLM with one more parameter
before = {n: getattr(ple, n) for n in ("ple_ngram_ids", "ple_gate", "ple_conv")}
import qwen4exp_ext.vllm as plugin
for _ in range(3):
    plugin.register()
importlib.import_module("vllm.models.qwen4_exp.amd.ple_layer")
after = {n: getattr(ple, n) for n in before}
warnings = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
print(json.dumps({"warnings": warnings, "swapped": plugin.swapped(),
                  "unchanged": all(before[n] is after[n] for n in before)}))
"""
    )
    import json

    found = json.loads(out.strip().splitlines()[-1])
    assert len(found["warnings"]) == 1, found["warnings"]
    assert "ple_ngram_ids" in found["warnings"][0] and "new_flag" in found["warnings"][0]
    assert found["swapped"] == [] and found["unchanged"] is True
