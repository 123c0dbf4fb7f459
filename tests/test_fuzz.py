"""Fuzzing of every op against the reference oracle (SPEC §9.8), with the time-bounded kit of
tests/fuzz_support.py (what is drawn, the budget, how to replay a failure).

Findings: reference.gather_rows failed on an empty table and ops.gather_rows on ids that are not
2-D when NH·d == 0 (both fixed; their regression tests are below). Pinned as a strict xfail
(remove the mark once fixed): ple_gate's "vllm" rounding exceeds test_ple_gate's stated
tolerance where a stream's dot nearly cancels (the fuzz test keeps that tolerance for every
well-conditioned stream and bounds the others).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import strategies as st

from fuzz_support import (
    BACKENDS,
    FLOATS,
    FP8,
    INT32_MAX,
    INT32_MIN,
    INT64_MAX,
    INT64_MIN,
    Recorder,
    assert_outside_untouched,
    assert_unchanged,
    draw_layout_1d,
    draw_layout_2d,
    dtype_range,
    fuzz,
    generator,
    place,
    random_ints,
    sizes,
)

# make_table: every finite fp8 byte, wide-range other values; CPU_PATHS: cached and streaming.
from gather_support import CPU_PATHS, cpu_gather_path, make_table
from qwen4exp_ext import ops, reference
from qwen4exp_ext.testing import assert_exact, assert_within, tolerance

# --- ngram_ids (SPEC §3): bit-exact, as tests/test_ngram_ids.py -----------------------------------


def draw_request_lengths(draw, *, longest: int, many: int) -> list[int]:
    """A varlen batch's chunk lengths: mixed (empty, single-token and longer requests), many
    single-token requests (a decode batch), one long chunk, or only empty requests."""
    kind = draw(st.sampled_from(["mixed", "many_single", "one_long", "all_empty"]), label="batch")
    if kind == "mixed":
        lengths = draw(
            st.lists(sizes([0, 1, 1, 2, 3], 0, longest // 3), max_size=8), label="lengths"
        )
    elif kind == "many_single":
        lengths = [1] * draw(st.integers(1, many), label="requests")
    elif kind == "one_long":
        lengths = [draw(st.integers(0, longest), label="length")]
    else:
        lengths = [0] * draw(st.integers(0, 4), label="requests")
    return lengths


def ngram_body(backend, draw: Recorder) -> None:
    ops, device = backend.ops, backend.device
    ngram_size = draw(st.integers(2, 8), label="ngram_size")
    per = draw(sizes([1, 2, 8], 1, 5), label="heads_per_ngram")
    ctx_len, nh = ngram_size - 1, (ngram_size - 1) * per
    out_kind = draw(st.sampled_from(["none", "int64", "int32"]), label="output")
    cap = INT32_MAX // nh if out_kind == "int32" else 2**62 // nh  # offsets' prefix sums fit
    multipliers = draw(
        st.lists(st.integers(INT64_MIN, INT64_MAX), min_size=ngram_size, max_size=ngram_size),
        label="multipliers",
    )
    head_sizes = draw(
        st.lists(
            sizes([1, 2, 3, 1009, 2**31 - 1, 2**32 + 15, 2**62], 1, 2**40),
            min_size=nh,
            max_size=nh,
        ),
        label="head sizes",
    )
    head_sizes = [min(s, cap) for s in head_sizes]
    offsets, total = [], 0
    for s in head_sizes:
        offsets.append(total)
        total += s
    eos = draw(sizes([0, 7, 248044, INT32_MAX], 0, 20), label="eos")
    id_dtype = draw(st.sampled_from([torch.int32, torch.int64]), label="input_ids dtype")
    ctx_dtype = draw(st.sampled_from([torch.int32, torch.int64]), label="context dtype")
    qsl_dtype = draw(st.sampled_from([torch.int32, torch.int64]), label="qsl dtype")
    lengths = draw_request_lengths(draw, longest=96, many=64)
    tail = draw(st.sampled_from([0, 0, 1, 3]), label="tokens past qsl[R]")
    vocab = draw(st.sampled_from([12, 1000, 248320, INT32_MAX, None]), label="vocab (None: any)")
    eos_rate = draw(st.sampled_from([0.0, 0.05, 0.2, 0.6]), label="eos rate")
    gen = generator(draw)

    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    num_tokens, num_reqs = qsl[-1] + tail, len(lengths)

    def tokens(shape, dtype):
        low, high = (0, vocab - 1) if vocab is not None else dtype_range(dtype)
        values = random_ints(gen, shape, low, high, torch.int64)
        values = torch.where(torch.rand(shape, generator=gen) < eos_rate, eos, values)
        return values.to(dtype)

    input_ids = tokens((num_tokens,), id_dtype)
    context = tokens((num_reqs, ctx_len), ctx_dtype)
    qsl_t = torch.tensor(qsl, dtype=qsl_dtype)
    consts = (
        torch.tensor(multipliers, dtype=torch.int64),
        torch.tensor(head_sizes, dtype=torch.int64),
        torch.tensor(offsets, dtype=torch.int64),
    )
    expected = reference.ngram_ids(input_ids, qsl_t, context, *consts, eos, per)

    ids_laid = draw_layout_1d(draw, input_ids, "input_ids")
    qsl_laid = draw_layout_1d(draw, qsl_t, "query_start_loc")
    ctx_laid = draw_layout_2d(draw, context, "ngram_context", any_strides=True)
    as_row = draw(st.booleans(), label="input_ids as [1, T]") and ids_laid.kind == "contiguous"
    ids_base, ids_dev = ids_laid.on(device)
    qsl_base, qsl_dev = qsl_laid.on(device)
    ctx_base, ctx_dev = ctx_laid.on(device)
    out_laid = out_base = out_dev = None
    if out_kind != "none":
        out_dtype = torch.int32 if out_kind == "int32" else torch.int64
        out_laid = draw_layout_2d(
            draw, torch.full((num_tokens, nh), -7, dtype=out_dtype), "output", any_strides=True
        )
        out_base, out_dev = out_laid.on(device)
    got = ops.ngram_ids(
        ids_dev.reshape(1, -1) if as_row else ids_dev,
        qsl_dev,
        ctx_dev,
        *(c.to(device) for c in consts),
        eos,
        per,
        output=out_dev,
    )
    if out_laid is None:
        assert got.dtype == torch.int64
        assert_exact(got, expected, "ngram_ids", bitwise=True)
    else:
        assert got.data_ptr() == out_dev.data_ptr()
        assert_exact(got, expected.to(out_dev.dtype), "ngram_ids", bitwise=True)
        assert_outside_untouched(out_laid, out_base, "ngram_ids output buffer")
    for laid, base, name in (
        (ids_laid, ids_base, "input_ids"),
        (qsl_laid, qsl_base, "query_start_loc"),
        (ctx_laid, ctx_base, "ngram_context"),
    ):
        assert_unchanged(laid, base, name)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_fuzz_ngram_ids(backend, record_property):
    fuzz(f"ngram_ids on {backend}", lambda draw: ngram_body(backend, draw), record_property)


# --- gather_rows (SPEC §4): bit-exact, as tests/test_gather_rows.py -------------------------------


def gather_body(backend, draw: Recorder) -> None:
    ops, device = backend.ops, backend.device
    table_dtype = draw(st.sampled_from([*FLOATS, *FP8]), label="table dtype")
    rows = draw(sizes([0, 1, 2, 3, 5, 7, 31, 97], 0, 300), label="rows")
    width = draw(sizes([0, 1, 2, 3, 7, 16, 24, 31, 160, 700], 1, 48), label="d")
    num_tokens = draw(sizes([0, 1, 2, 3, 5, 13], 0, 40), label="T")
    num_heads = draw(sizes([0, 1, 2, 3, 16], 1, 12), label="NH")
    id_dtype = draw(st.sampled_from([torch.int32, torch.int64]), label="ids dtype")
    lead = draw(st.sampled_from(["[T, NH]", "[NH]", "[a, T, NH]"]), label="ids shape")
    shard = draw(st.sampled_from(["none", "start", "range", "empty"]), label="shard")
    start = 0
    if shard != "none":
        start = draw(sizes([0, 1, rows, 2**31 - 5, 2**40], 0, 500), label="vocab_start")
    end = None
    if shard == "range":
        end = start + draw(st.integers(0, rows), label="shard rows")
    elif shard == "empty":
        end = start
    out_dtype = draw(st.sampled_from([None, *FLOATS]), label="out_dtype")
    special_rate = draw(st.sampled_from([0.0, 0.1, 0.5]), label="out-of-range id rate")
    gen = generator(draw)

    table = make_table(rows, width, table_dtype, gen=gen)
    scale = scale_arg = None
    if table_dtype in FP8:
        value = draw(
            st.one_of(
                st.sampled_from([1.0, -0.5, 3.0e-5, 700.0, 1.0e30, 0.0, -0.0, 2.0**-24, 6.0e-8]),
                st.floats(-1.0e4, 1.0e4, allow_nan=False, width=32),
            ),
            label="scale",
        )
        scale_kind = draw(st.sampled_from(["[1]", "[]", "float"]), label="scale as")
        scale = torch.tensor([value], dtype=torch.float32)
        scale_arg = {"[1]": scale, "[]": scale.reshape(()), "float": value}[scale_kind]

    # Ids around this shard's range, plus values just outside it and far away.
    span = (end if end is not None else start + rows) - start
    low, high = dtype_range(id_dtype)
    ids = start + torch.randint(-2, span + 3, (num_tokens, num_heads), generator=gen)
    specials = [-1, start - 1, start, start + span - 1, start + span, start + span + 1]
    specials += [INT32_MIN, INT32_MAX, 0, rows, 2**40, INT64_MIN, INT64_MAX]
    picks = torch.tensor(specials)[
        torch.randint(0, len(specials), (num_tokens, num_heads), generator=gen)
    ]
    ids = torch.where(torch.rand(num_tokens, num_heads, generator=gen) < special_rate, picks, ids)
    ids = ids.clamp(low, high).to(id_dtype)
    expected = reference.gather_rows(
        table, ids, scale=scale, vocab_start=start, vocab_end=end, out_dtype=out_dtype
    )

    table_laid = draw_layout_2d(draw, table, "table", any_strides=False)
    ids_laid = draw_layout_2d(draw, ids, "ids", any_strides=True)
    table_base, table_dev = table_laid.on(device)
    ids_base, ids_dev = ids_laid.on(device)
    call_ids = ids_dev
    if lead == "[NH]" and num_tokens == 1:
        call_ids = ids_dev[0]
    elif lead == "[a, T, NH]" and num_tokens % 2 == 0:
        call_ids = ids_dev.reshape(2, num_tokens // 2, num_heads)
    resolved = out_dtype or (torch.bfloat16 if table_dtype in FP8 else table_dtype)
    out_laid = out_base = out_dev = None
    if call_ids.dim() == 2 and draw(st.booleans(), label="output= given"):
        out_laid = draw_layout_2d(
            draw,
            torch.zeros(num_tokens, num_heads * width, dtype=resolved),
            "output",
            any_strides=False,
        )
        out_base, out_dev = out_laid.on(device)
    cpu_path = draw(st.sampled_from(CPU_PATHS), label="CPU gather path")
    # The HIP kernels' grid cap (none on the CPU): every cap gives the same output.
    max_blocks = draw(st.sampled_from([0, 0, 1, 2, 3]), label="max_blocks")
    with cpu_gather_path(cpu_path):
        got = ops.gather_rows(
            table_dev,
            call_ids,
            scale=scale_arg.to(device) if isinstance(scale_arg, torch.Tensor) else scale_arg,
            vocab_start=start,
            vocab_end=end,
            out_dtype=out_dtype,
            output=out_dev,
            max_blocks=max_blocks,
        )
    assert got.shape == (*call_ids.shape[:-1], num_heads * width)
    assert_exact(got.reshape(expected.shape), expected, "gather_rows", bitwise=True)
    if out_laid is not None:
        assert got.data_ptr() == out_dev.data_ptr()
        assert_outside_untouched(out_laid, out_base, "gather_rows output buffer")
    assert_unchanged(table_laid, table_base, "table")
    assert_unchanged(ids_laid, ids_base, "ids")


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_fuzz_gather_rows(backend, record_property):
    fuzz(f"gather_rows on {backend}", lambda draw: gather_body(backend, draw), record_property)


@pytest.mark.parametrize("ids_shape,width", [((2, 3, 0), 4), ((0,), 4), ((3,), 0), ((2, 3, 1), 0)])
def test_gather_rows_door_empty_rows(ids_shape, width):
    table = torch.zeros(5, width)
    ids = torch.zeros(ids_shape, dtype=torch.int64)
    expected = reference.gather_rows(table, ids)
    assert_exact(ops.gather_rows(table, ids), expected, "gather_rows", bitwise=True)


def test_reference_gather_rows_empty_table():
    expected = torch.zeros(1, 4)
    assert_exact(
        ops.gather_rows(torch.empty(0, 4), torch.tensor([[2]])), expected, "ops", bitwise=True
    )
    assert_exact(
        reference.gather_rows(torch.empty(0, 4), torch.tensor([[2]])),
        expected,
        "reference",
        bitwise=True,
    )


# --- ple_gate (SPEC §5): the tolerances of tests/test_ple_gate.py ---------------------------------

GATE_STREAMS = {"streams": 0, "ill-conditioned": 0}  # counted over a test, for its summary


def gate_sensitivity(key, value, hidden, weights, eps, rounding, flips: float) -> torch.Tensor:
    """[T, M] float64: how far g = sigmoid(sign(d)·sqrt(max(|d|, 1e-6))) moves when a stream's
    dot moves by `flips` units in the last place of its largest product (plus fp32 summation
    noise). The kernel and the reference may round one normalised element differently (1/sqrt
    vs rsqrt, another summation order), which moves one product, and so the dot, by a unit; where
    the dot nearly cancels, sqrt(|d|) and sign(d) amplify that into several units of g."""
    tokens, channels = hidden.shape
    width = value.shape[1]
    streams = channels // width
    dtype = hidden.dtype
    vllm = rounding == "vllm"

    def rnd(x):
        return x.to(dtype).float() if vllm else x

    def norm(x, w):
        x = x.float().reshape(tokens, streams, width)
        w = w.float().reshape(streams, width)
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) / width + eps) * (1.0 + w)

    products = rnd(rnd(norm(key, weights[0])) * rnd(norm(hidden, weights[1]))).double()
    dot = products.sum(-1)
    mantissa = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23}[dtype] if vllm else 23
    largest = products.abs().amax(-1) if width else torch.zeros(tokens, streams)
    ulp = torch.exp2(torch.floor(torch.log2(largest.clamp(min=1e-30))) - mantissa)
    delta = flips * ulp + 2.0**-22 * math.sqrt(width) * largest  # + fp32 summation noise
    delta = torch.where(largest > 0, delta, 0.0)  # an all-zero stream has d = 0 exactly

    def gate(x):
        d = x / math.sqrt(width)
        return torch.sigmoid(torch.sign(d) * torch.sqrt(d.abs().clamp(min=1e-6)))

    g = gate(dot)
    return torch.maximum((gate(dot + delta) - g).abs(), (gate(dot - delta) - g).abs())


def assert_gate_close(got, expected, key, value, hidden, weights, eps, rounding) -> None:
    """The tolerance of tests/test_ple_gate.py on every stream whose gate is well-conditioned
    (two units more or less in the dot move g by less than a quarter of that tolerance), which
    is nearly all of them. On the others (the dot nearly cancels: see
    test_ple_gate_tolerance_where_the_dot_nearly_cancels, a finding) gated may differ by how far
    g can move, times |value|; conv_input = GN(gated) hardly depends on g and keeps the tolerance.
    """
    dtype = hidden.dtype
    tol = tolerance("ple_gate", dtype, rounding=rounding)
    atol, rtol = tol
    tokens, channels = hidden.shape
    width = value.shape[1]
    ill = gate_sensitivity(key, value, hidden, weights, eps, rounding, 2) > rtol / 4
    GATE_STREAMS["streams"] += ill.numel()
    GATE_STREAMS["ill-conditioned"] += int(ill.sum())
    ill_columns = ill.repeat_interleave(width, dim=1)  # [T, C]
    for g, e, name in zip(got, expected, ("gated", "conv_input"), strict=True):
        assert g.shape == e.shape and g.dtype == dtype, name
        g, e = g.cpu().double(), e.double()
        well = ~ill_columns if name == "gated" else torch.ones_like(ill_columns)
        assert_within(g[well], e[well], tol, f"ple_gate {name} ({rounding}, {dtype})")
    if bool(ill.any()):
        moves = gate_sensitivity(key, value, hidden, weights, eps, rounding, 8 + width / 256)
        moves = moves.repeat_interleave(width, dim=1)
        allowed = (moves + 2 * rtol) * value.double().repeat(1, channels // width).abs() + atol
        err = (got[0].cpu().double() - expected[0].double()).abs()
        bad = ill_columns & (err > allowed)
        assert not bool(bad.any()), (
            f"ple_gate gated ({rounding}, {dtype}), ill-conditioned stream: {int(bad.sum())} "
            f"elements beyond the bound, first at {tuple(bad.nonzero()[0].tolist())}"
        )


def gate_body(backend, draw: Recorder) -> None:
    ops, device = backend.ops, backend.device
    dtype = draw(st.sampled_from(FLOATS), label="dtype")
    weight_dtype = draw(st.sampled_from([dtype, torch.float32]), label="weight dtype")
    rounding = draw(st.sampled_from(["vllm", "fp32"]), label="rounding")
    tokens = draw(sizes([0, 1, 2, 3, 17], 0, 48), label="T")
    width = draw(sizes([1, 2, 3, 5, 7, 16, 31, 64, 100, 127, 160, 256], 1, 300), label="H")
    streams = draw(st.integers(1, 5), label="M")
    eps = draw(st.sampled_from([1e-6, 1e-5, 1e-3]), label="eps")
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0]), label="hidden scale")
    zero_rows = draw(st.booleans(), label="some all-zero key rows (d = 0)")
    channels = width * streams
    gen = generator(draw)

    key = torch.randn(tokens, channels, generator=gen).to(dtype)
    value = torch.randn(tokens, width, generator=gen).to(dtype)
    hidden = (torch.randn(tokens, channels, generator=gen) * scale).to(dtype)
    if zero_rows and tokens:
        key[torch.rand(tokens, generator=gen) < 0.3] = 0
    weights = [(torch.randn(channels, generator=gen) * 0.2).to(weight_dtype) for _ in range(3)]
    expected = reference.ple_gate(key, value, hidden, *weights, eps, rounding=rounding)

    kv_kind = draw(
        st.sampled_from(["key|value", "value|key", "separate", "row_step key|value"]),
        label="key/value layout",
    )
    laids = {}
    if kv_kind == "separate":
        laids["key"] = draw_layout_2d(draw, key, "key", any_strides=False)
        laids["value"] = draw_layout_2d(draw, value, "value", any_strides=False)
        key_base, key_dev = laids["key"].on(device)
        value_base, value_dev = laids["value"].on(device)
        kv_bases = [(laids["key"], key_base, "key"), (laids["value"], value_base, "value")]
    else:
        # One [T, C+H] projection (padded, or every 2nd row of a taller one), split by columns.
        key_first = kv_kind != "value|key"
        kv = torch.cat([key, value] if key_first else [value, key], dim=1)
        if kv_kind.startswith("row_step"):
            laid = place(kv, (2 * tokens, channels + width), lambda b: b[::2], "row_step")
        else:
            pad = draw(st.integers(0, 3), label="projection pad")
            laid = place(kv, (tokens, channels + width + pad), lambda b: b[:, : kv.shape[1]], "kv")
        kv_base, kv_dev = laid.on(device)
        if key_first:
            key_dev, value_dev = kv_dev[:, :channels], kv_dev[:, channels:]
        else:
            value_dev, key_dev = kv_dev[:, :width], kv_dev[:, width:]
        kv_bases = [(laid, kv_base, "kv projection")]
    hidden_laid = draw_layout_2d(draw, hidden, "hidden", any_strides=False)
    hidden_base, hidden_dev = hidden_laid.on(device)
    out_kind = draw(st.sampled_from(["returned", "out="]), label="outputs")
    out = outs = None
    if out_kind == "out=":
        outs = [
            draw_layout_2d(
                draw, torch.zeros(tokens, channels, dtype=dtype), name, any_strides=False
            )
            for name in ("gated", "conv_input")
        ]
        outs = [(laid, *laid.on(device)) for laid in outs]
        out = (outs[0][2], outs[1][2])
    got = ops.ple_gate(
        key_dev,
        value_dev,
        hidden_dev,
        *(w.to(device) for w in weights),
        eps,
        rounding=rounding,
        out=out,
    )
    assert_gate_close(got, expected, key, value, hidden, weights, eps, rounding)
    if outs is not None:
        for (laid, base, view), g, name in zip(outs, got, ("gated", "conv_input"), strict=True):
            assert g.data_ptr() == view.data_ptr(), name
            assert_outside_untouched(laid, base, f"ple_gate {name} buffer")
    for laid, base, name in [*kv_bases, (hidden_laid, hidden_base, "hidden")]:
        assert_unchanged(laid, base, name)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_fuzz_ple_gate(backend, record_property):
    GATE_STREAMS.update(streams=0, **{"ill-conditioned": 0})
    fuzz(f"ple_gate on {backend}", lambda draw: gate_body(backend, draw), record_property)
    print(f"  ple_gate streams compared: {GATE_STREAMS}")


def _gate_h240_case():
    """Token 1, stream 2 of the fuzz case (fp16, T=35, H=240, M=5, generator seed 61): its dot
    0.00094 flips sign in the kernel (a product rounds one fp16 unit differently)."""
    gen = torch.Generator().manual_seed(61)
    key = torch.randn(35, 1200, generator=gen).to(torch.float16)
    torch.randn(35, 240, generator=gen)  # value (not needed: value = 1 below)
    hidden = (torch.randn(35, 1200, generator=gen) * 30).to(torch.float16)
    key[torch.rand(35, generator=gen) < 0.3] = 0
    weights = [(torch.randn(1200, generator=gen) * 0.2).to(torch.float16) for _ in range(3)]
    cols = slice(480, 720)
    return key[1:2, cols], hidden[1:2, cols], [w[cols] for w in weights]


def _gate_h8_case():
    """One token, one stream of H=8 (found by a random search of 4.2 million tokens)."""
    f16 = torch.float16
    key = torch.tensor(
        [[-0.066650390625, 0.73876953125, -0.83984375, -2.365234375, 0.190673828125,
          -0.03582763671875, -0.744140625, -0.66943359375]], dtype=f16)  # fmt: skip
    hidden = torch.tensor(
        [[37.78125, 38.0625, -21.859375, 19.421875, -14.8671875, -16.03125, -3.630859375,
          -16.421875]], dtype=f16)  # fmt: skip
    w_k = torch.tensor(
        [-0.24951171875, 0.054351806640625, 0.1903076171875, 0.238525390625, -0.30908203125,
         0.256591796875, -0.08197021484375, -0.1329345703125], dtype=f16)  # fmt: skip
    w_q = torch.tensor(
        [-0.25, 0.2362060546875, 0.1990966796875, 0.29931640625, -0.26318359375,
         -0.04583740234375, -0.3583984375, -0.07745361328125], dtype=f16)  # fmt: skip
    return key, hidden, [w_k, w_q, torch.zeros(8, dtype=f16)]


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="finding of test_fuzz_ple_gate: with rounding='vllm' in fp16, where a stream's dot "
    "nearly cancels, one normalised element rounding one unit differently (the kernel's 1/sqrt "
    "vs the reference's rsqrt) moves g by more than test_ple_gate's stated 2 units: H=8 case "
    "g = 0.448975 (kernel) vs 0.447998 (reference), 4 units; H=240 case: the dot 0.00094 flips "
    "sign, g = 0.499756 vs 0.501953, 9 units",
)
@pytest.mark.parametrize("case", [_gate_h8_case, _gate_h240_case], ids=["H=8", "H=240"])
def test_ple_gate_tolerance_where_the_dot_nearly_cancels(case):
    key, hidden, weights = case()
    value = torch.ones(1, key.shape[1], dtype=torch.float16)  # gated = g
    got = ops.ple_gate(key, value, hidden, *weights, 1e-6)[0]
    expected = reference.ple_gate(key, value, hidden, *weights, 1e-6)[0]
    tol = tolerance("ple_gate", torch.float16, rounding="vllm")
    assert_within(got.double(), expected.double(), tol)
