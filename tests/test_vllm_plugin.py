"""The vLLM plugin against the real vLLM (each supported release: 0.33.0, 0.34.0; no mocks):
entry point, VLLM_PLUGINS filtering, idempotent register(), the release/signature guard, and the
swap itself — vLLM's module-level functions and its torch.ops.vllm ops run our kernels (profiler
record) with results equal to our reference. With the plugin filtered out, vLLM's functions are
untouched."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
import torch

from ngram_support import HASHING_ARGS
from qwen4exp_ext import ops, reference
from qwen4exp_ext.testing import assert_exact
from vllm_support import recorded_ops, require_vllm, run_python, vllm_version

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
        """,
        bare=True,
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
    kwargs = dict(zip(HASHING_ARGS, args, strict=True))
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


def _vllms(method_fn):
    """vLLM's own function behind one of our replacements (the plugin keeps it as __wrapped__)."""
    assert hasattr(method_fn, MARK), f"{method_fn} is not swapped"
    return method_fn.__wrapped__


def _fp8_layer(rows: int, width: int, *, gen, start: int = 0):
    """A vLLM FP8 PLE layer's attributes: fp8 rows (-0 and NaN bytes included), the global
    scale, the activation dtype; `_uva_weight` and the shard for the pinned lookup."""
    raw = torch.randint(0, 256, (rows, width), dtype=torch.uint8, generator=gen)
    raw[0, :4] = torch.tensor([0x80, 0x00, 0x7F, 0xFF], dtype=torch.uint8)  # -0, +0, NaN, NaN
    table = raw.view(torch.float8_e4m3fn)
    shard = SimpleNamespace(org_vocab_start_index=start, org_vocab_end_index=start + rows)
    return SimpleNamespace(
        weight=table,
        _uva_weight=table,
        weight_scale=torch.tensor([0.0123]),
        params_dtype=torch.bfloat16,
        shard_indices=shard,
        embedding_dim=width,
    )


def test_fp8_table_lookups_run_ours_dequantised(vllm_plugged):
    """vLLM's FP8 method: our gather looks the rows up and dequantises them (device table and
    pinned table, in the activation dtype), and its ``dequantize`` then only casts: the values
    are bit for bit vLLM's byte lookup followed by its ``row.to(out) * scale.to(out)``."""
    import vllm.models.qwen4_exp.common.ngram_embedding as ne

    method = ne.Qwen4ExpPLEFp8EmbeddingMethod()
    g = torch.Generator().manual_seed(6)
    layer = _fp8_layer(60, 16, gen=g)
    ids = torch.cat([torch.zeros(1, dtype=torch.long), torch.randint(0, 60, (19,), generator=g)])
    ids = ids.view(5, 4)
    vllm_rows = _vllms(type(method).embedding)(method, layer, ids)
    expected = _vllms(type(method).dequantize)(method, layer, vllm_rows, torch.bfloat16)
    with recorded_ops() as names:
        rows = method.embedding(layer, ids)
        got = method.dequantize(layer, rows, torch.bfloat16)
    assert "qwen4exp::gather_rows" in names
    assert rows.dtype == torch.bfloat16 and rows.shape == (5, 4, 16)
    # Bit for bit (so -0 and +0 differ), except that any NaN matches any NaN: the spec fixes no
    # NaN payload, and torch's fp8 decoding and ours choose different ones.
    assert_exact(got, expected, bitwise=True, equal_nan=True)

    # Pinned: lookup_dtype is the activation dtype; rows of other ranks are zeros.
    start = 500
    layer = _fp8_layer(60, 16, gen=g, start=start)
    assert method.lookup_dtype(layer) == torch.bfloat16
    global_ids = torch.randint(start - 30, start + 90, (40,), generator=g)
    output = torch.full((40, 16), float("nan"), dtype=torch.bfloat16)
    with recorded_ops() as names:
        method.lookup_from_pinned(layer, global_ids, output)
    assert "qwen4exp::gather_rows" in names
    owned = (global_ids >= start) & (global_ids < start + 60)
    local = torch.where(owned, global_ids - start, 0)
    vllm_bytes = torch.where(owned[:, None], layer.weight.view(torch.uint8)[local], 0)
    expected = _vllms(type(method).dequantize)(
        method, layer, vllm_bytes.view(torch.float8_e4m3fn), torch.bfloat16
    )
    assert_exact(output, expected, bitwise=True, equal_nan=True)


def test_fp8_dequantising_before_the_vocabulary_reduction(vllm_plugged):
    """Where our FP8 path differs from vLLM's: vLLM sums the ranks' raw fp8 bytes (each row has
    one owner, the others contribute zero bytes) and dequantises after; we dequantise in the
    lookup and sum activations. Same values everywhere, NaN included; only a -0 element of the
    table becomes +0 (-0 + +0), where vLLM keeps -0."""
    import vllm.models.qwen4_exp.common.ngram_embedding as ne

    method = ne.Qwen4ExpPLEFp8EmbeddingMethod()
    g = torch.Generator().manual_seed(8)
    whole = _fp8_layer(80, 16, gen=g)
    ids = torch.cat([torch.zeros(4, dtype=torch.long), torch.randint(0, 80, (60,), generator=g)])
    ranks = []
    for start, end in ((0, 30), (30, 80)):  # an ETP group of two
        part = SimpleNamespace(**vars(whole))
        part.weight = part._uva_weight = whole.weight[start:end]
        part.shard_indices = SimpleNamespace(org_vocab_start_index=start, org_vocab_end_index=end)
        ranks.append(part)
    ours = torch.zeros(64, 16, dtype=torch.bfloat16)
    vllm_bytes = torch.zeros(64, 16, dtype=torch.int8)
    for part in ranks:
        out = torch.empty(64, 16, dtype=method.lookup_dtype(part))
        method.lookup_from_pinned(part, ids, out)
        ours += out  # the all-reduce
        start = part.shard_indices.org_vocab_start_index
        owned = (ids >= start) & (ids < start + part.weight.shape[0])
        local = torch.where(owned, ids - start, 0)
        vllm_bytes += torch.where(owned[:, None], part.weight.view(torch.int8)[local], 0)
    theirs = _vllms(type(method).dequantize)(
        method, whole, vllm_bytes.view(torch.float8_e4m3fn), torch.bfloat16
    )
    assert torch.equal(torch.isnan(ours), torch.isnan(theirs))
    nan = torch.isnan(ours)
    assert torch.equal(ours[~nan], theirs[~nan])  # equal values (-0 == +0)
    negative_zero = (theirs.view(torch.int16) == -32768) & ~nan
    assert bool(negative_zero[:4].any()), "the table's -0 element must be looked up"
    same_bits = ours.view(torch.int16) == theirs.view(torch.int16)
    assert torch.equal(~same_bits & ~nan, negative_zero)
    assert bool((ours.view(torch.int16)[negative_zero] == 0).all())


def test_nvfp4_table_lookups_run_ours(vllm_plugged):
    """vLLM's NVFP4 method: the device table's ``embedding`` and the pinned table's
    ``lookup_from_pinned`` (rows and block scales in host memory, ranks' shards) run our gather;
    equal to the reference, i.e. to vLLM's Triton lookup (tests/gather_rows/test_kernel.py)."""
    import vllm.models.qwen4_exp.common.ngram_embedding as ne

    method = ne.Qwen4ExpPLENvFp4EmbeddingMethod()
    g = torch.Generator().manual_seed(9)
    rows, d = 70, 32
    packed = torch.randint(0, 256, (rows, d // 2), dtype=torch.uint8, generator=g)
    block_scales = (torch.rand(rows, d // 16, generator=g) * 4).to(torch.float8_e4m3fn)
    global_scale = torch.tensor([0.37])
    layer = SimpleNamespace(
        weight=packed,
        weight_scale=block_scales,
        weight_scale_2=global_scale,
        params_dtype=torch.bfloat16,
        embedding_dim=d,
    )
    ids = torch.randint(0, rows, (6, 3), generator=g)
    with recorded_ops() as names:
        got = method.embedding(layer, ids)
    assert "qwen4exp::gather_rows" in names
    expected = reference.gather_rows(
        packed, ids.reshape(-1, 1), scale=global_scale, block_scales=block_scales
    )
    assert torch.equal(got.view(-1, d).view(torch.int16), expected.view(torch.int16))
    assert got.shape == (6, 3, d)

    start = 1000
    layer._uva_weight = packed
    layer.shard_indices = SimpleNamespace(
        org_vocab_start_index=start, org_vocab_end_index=start + rows
    )
    method._uva_weight_scale = block_scales  # vLLM keeps the scales' UVA view on the method
    global_ids = torch.randint(start - 40, start + rows + 40, (50,), generator=g)
    output = torch.full((50, d), float("nan"), dtype=torch.bfloat16)
    with recorded_ops() as names:
        method.lookup_from_pinned(layer, global_ids, output)
    assert "qwen4exp::gather_rows" in names
    expected = reference.gather_rows(
        packed,
        global_ids[:, None],
        scale=global_scale,
        block_scales=block_scales,
        vocab_start=start,
        vocab_end=start + rows,
    )
    assert torch.equal(output.view(torch.int16), expected.view(torch.int16))


def test_pinned_tables_are_allocated_at_their_exact_size(vllm_plugged):
    """vLLM's pinned PLE table (``torch.empty(pin_memory=True)``: torch's caching host allocator
    rounds it up to a power of two) comes from host_memory.pinned_host_table: one mapping of the
    table's bytes, rounded up to a page only, zero-filled. Registered for the GPU where there is
    one (a GPU build without a GPU leaves it a plain host table)."""
    import vllm.models.qwen4_exp.common.ngram_embedding as ne

    from qwen4exp_ext.tables import host_memory
    from qwen4exp_ext.vllm import shims

    if "cuda" not in shims.DEVICE_TYPES:
        pytest.skip("a CPU-only build keeps vLLM's allocation (no host registration)")
    cls = ne.Qwen4ExpPLEPinnedHostEmbedding
    assert hasattr(cls.__dict__["allocate_embedding_weight"], MARK)
    rows, width = 3001, 80  # 240,080 bytes: torch would pin 256 KiB
    table = cls.allocate_embedding_weight(None, rows, width, torch.uint8)
    assert (
        table.shape == (rows, width) and table.dtype == torch.uint8 and table.device.type == "cpu"
    )
    found = host_memory.footprint(table)
    page = 4096
    assert found["host_table"] and found["mapping_bytes"] == -(-rows * width // page) * page
    assert found["registered"] == torch.cuda.is_available()
    assert not bool(table.any())


def test_cpu_device_tables_are_allocated_on_huge_pages(vllm_plugged):
    """vLLM's device PLE table (``torch.empty`` on the active device) comes, where that device is
    the CPU, from host_memory.empty_host_table: its own mapping, advised onto transparent huge
    pages before anything is written, so that our gather pays fewer page walks. Its rows load
    and gather as vLLM's would; a table on another device (here ``meta``) stays vLLM's."""
    import vllm.models.qwen4_exp.common.ngram_embedding as ne

    from qwen4exp_ext.tables import host_memory

    cls = ne.Qwen4ExpPLEDeviceEmbedding
    assert hasattr(cls.__dict__["allocate_embedding_weight"], MARK)
    huge = 2 << 20
    for dtype, rows, width in ((torch.bfloat16, 8191, 160), (torch.float8_e4m3fn, 13109, 160)):
        table = cls.allocate_embedding_weight(None, rows, width, dtype)
        assert table.shape == (rows, width) and table.dtype == dtype
        assert table.device.type == "cpu" and table.is_contiguous()
        assert table.untyped_storage().nbytes() >= huge  # large enough for its own mapping
        found = host_memory.footprint(table)
        assert found["host_table"], found
        if dtype == torch.bfloat16:
            source = torch.randn(rows, width).to(dtype)
            table.copy_(source)  # as vLLM's weight loader fills it
            ids = torch.tensor([[0, rows - 1], [rows // 2, 7]])
            assert_exact(ops.gather_rows(table, ids), source[ids].view(2, 2 * width))
    with torch.device("meta"):
        elsewhere = cls.allocate_embedding_weight(None, 8191, 160, torch.bfloat16)
    assert elsewhere.device.type == "meta"


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
    assert found["ple.ple_ngram_ids"] == "qwen4exp_ext.vllm.shims.ple+ours"
    assert found["ple_layer.ple_ngram_ids"] == "qwen4exp_ext.vllm.shims.ple+ours"
    for name, our_op in FUNCTIONS.items():
        want = "qwen4exp_ext.vllm.shims.ple+ours" if hasattr(ops, our_op) else PLE_OPS
        assert found[f"ple_layer.{name}"] == want
        assert (name in found["swapped"]) == hasattr(ops, our_op)


# Every row of the swap table, as swapped() names it: the same on every supported vLLM release
# (the ops, every table format's lookups, the AMD layer's NVFP4 tables and step-entry lookups,
# the AMD model's hyper-connection ops; the NVIDIA module's wait for vLLM's NVIDIA model:
# tests/test_vllm_hc.py).
EVERY_ROW = (
    "ple_ngram_ids",
    "ple_gate",
    "ple_conv",
    "Qwen4ExpPLEEmbeddingMethod.embedding",
    "Qwen4ExpPLEEmbeddingMethod.lookup_from_pinned",
    "Qwen4ExpPLEEmbeddingMethod.lookup_dtype",
    "Qwen4ExpPLEFp8EmbeddingMethod.dequantize",
    "Qwen4ExpPLENvFp4EmbeddingMethod.embedding",
    "Qwen4ExpPLENvFp4EmbeddingMethod.lookup_from_pinned",
    "Qwen4ExpPLEPinnedHostEmbedding.allocate_embedding_weight",
    "amd.ple_layer NVFP4 refusal",
    "qwen4_exp_amd_ple_ngram_embedding_pinned",
    "Qwen4ExpNGramEmbedding.load_weights",
    "amd.model Qwen4ExpModel step-entry PLE lookups",
    # A PLE table directory (vllm/table_dir.py); the NVIDIA embedding's rows apply when vLLM
    # imports that module (tests/test_vllm_disk_offload.py, tests/test_vllm_table_dir.py).
    "Qwen4ExpPLEDeviceEmbedding.allocate_embedding_weight",
    "amd Qwen4ExpNGramEmbedding.__init__ (PLE table directory)",
    "amd Qwen4ExpForCausalLM.is_unused_checkpoint_weight (PLE table directory)",
    "amd.ops.hc qwen4_exp_hc_combine_norm",
    "amd.ops.hc qwen4_exp_grouped_gemma_rmsnorm",
    "amd.ops.hc qwen4_exp_hc_silu",
    "amd.ops.hc qwen4_exp_hc_gate_mix",
    "amd.ops.hc qwen4_exp_hc_combine",
)
# From 0.34.0 on (rows with ``since``): the rows that vLLM's config and AMD layer bring (its
# disk_offload on ROCm; the other disk_offload rows wait for modules the AMD model never imports).
EVERY_ROW_SINCE_0_34 = (
    "EngramConfig.verify_model_config",
    "amd.ple_layer Qwen4ExpNGramEmbedding.__init__ (disk_offload)",
    "amd.ple_layer Qwen4ExpNGramEmbedding.forward (disk_offload)",
)


def test_every_row_is_swapped_on_the_installed_release():
    """On each supported vLLM (0.33.0, 0.34.0), once vLLM imports its AMD model (which imports
    the PLE ops, the embeddings and the AMD layer) every row of the table is swapped, with no
    warning, and vLLM's log names them."""
    out = run_python(
        _CAPTURE_PLUGIN_LOG
        + """
import importlib, json, logging
logging.getLogger("vllm.qwen4exp_ext").setLevel(logging.INFO)
import vllm.plugins
vllm.plugins.load_general_plugins()
importlib.import_module("vllm.models.qwen4_exp.amd.model")
import qwen4exp_ext.vllm as plugin
print(json.dumps({
    "swapped": plugin.swapped(),
    "warnings": [r.getMessage() for r in records if r.levelno >= logging.WARNING],
    "info": [r.getMessage() for r in records if r.levelno == logging.INFO],
}))
""",
        env={"VLLM_PLUGINS": "qwen4exp"},
    )
    import json

    found = json.loads(out.strip().splitlines()[-1])
    assert found["warnings"] == []
    want = [row for row in EVERY_ROW if row not in FUNCTIONS or hasattr(ops, FUNCTIONS[row])]
    if vllm_version() != "0.33.0":
        want += EVERY_ROW_SINCE_0_34
    assert sorted(found["swapped"]) == sorted(want)
    logged = " ".join(found["info"])
    assert all(row in logged for row in want), found["info"]


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


def test_a_release_whose_signature_changed_is_swapped_by_its_row():
    """A row's change for the installed release is what the plugin checks: with vLLM's
    ple_ngram_ids given one more parameter and the row told that this release has it (and a
    replacement made for it), the plugin swaps it, warns nothing, and the call runs ours."""
    out = run_python(
        _CAPTURE_PLUGIN_LOG
        + """
import importlib, json, logging
from dataclasses import replace
from importlib.metadata import version
import torch
ple = importlib.import_module("vllm.models.qwen4_exp.common.ops.ple")
vllm_fn = ple.ple_ngram_ids
def ple_ngram_ids(input_ids, query_start_loc, ngram_context, layer_multipliers,
                  ngram_heads_vocab_sizes, ngram_heads_offsets, eos_token_id, heads_per_ngram,
                  output=None, new_flag=False):
    raise AssertionError("vLLM's function ran")
ple_ngram_ids.__module__ = ple.__name__
ple.ple_ngram_ids = ple_ngram_ids  # this release's vLLM, with one more parameter
from qwen4exp_ext.vllm import shims
from qwen4exp_ext.vllm.shims import ple as ple_shims
def make(original):
    ours = ple_shims._make_ple_ngram_ids(original)
    def ple_ngram_ids(*args, new_flag=False):
        return ours(*args)
    return ple_ngram_ids
new_signature = shims.signature_text(ple_ngram_ids)
release = version("vllm").split("+")[0]
change = shims.Change(signature=new_signature, make=make)
shims.SWAPS = tuple(
    replace(row, changes=((release, change),)) if row.name == "ple_ngram_ids" else row
    for row in shims.SWAPS
)
import qwen4exp_ext.vllm as plugin
plugin.register()
importlib.import_module("vllm.models.qwen4_exp.amd.ple_layer")
from qwen4exp_ext import reference
g = torch.Generator().manual_seed(3)
args = (torch.randint(0, 40, (6,), generator=g), torch.tensor([0, 2, 6], dtype=torch.int32),
        torch.randint(0, 40, (2, 2), generator=g), torch.tensor([3, 5, 7]),
        torch.tensor([1009, 1013, 1019, 1021]), torch.tensor([0, 1009, 2022, 3041]), 7, 2)
got = ple.ple_ngram_ids(*args, new_flag=True)
print(json.dumps({
    "warnings": [r.getMessage() for r in records if r.levelno >= logging.WARNING],
    "swapped": plugin.swapped(),
    "equal": bool(torch.equal(got, reference.ngram_ids(*args))),
}))
"""
    )
    import json

    found = json.loads(out.strip().splitlines()[-1])
    assert found["warnings"] == []
    assert "ple_ngram_ids" in found["swapped"] and found["equal"] is True
