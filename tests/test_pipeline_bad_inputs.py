"""The bad-input tables of the lookup pipelines: StagedLookupPipeline (its constructor, submit,
a step's rows / wait / release, close) and LookupPipeline (its constructor, start_prefetch,
finalize_prefetch's layer), and the layers' own lookups fed a batch of the wrong shape.

Each case changes one argument of a valid baseline, in one kind of mistake, and names the
exception and the message it must give (the message names the argument and says what was
expected). Every case runs inside ``nothing_left_behind()`` (tests/leak_support.py): no
descriptor, mapping or thread outlives it (a refused constructor starts no worker thread), and
the pipeline still serves a valid step afterwards, with nothing of the refused call in it.
The op tables' style (tests/bad_inputs_support.py): overrides of one argument, ``put``/``set_``.
"""

from __future__ import annotations

import math

import pytest
import torch

from bad_inputs_support import put, set_
from leak_support import nothing_left_behind
from lookup_support import make_batch, make_embedding, ple_layers, same_bits
from ngram_support import CONFIG
from qwen4exp_ext.layers import LookupPipeline, NGramEmbedding, StagedLookupPipeline

WAIT = 30  # seconds: every wait of these tests is bounded
LENGTHS = [5, 0, 13, 1]  # 4 requests, 19 tokens; ngram_size 3: a context [4, 2]


def case(case_id, override, exc, match):
    return pytest.param(override, exc, match, id=case_id)


def _batch(seed: int = 0) -> dict:
    input_ids, qsl, context = make_batch(LENGTHS, "cpu", seed)
    return {"input_ids": input_ids, "query_start_loc": qsl, "ngram_context": context}


# Kinds of mistake shared by the tensors of a batch (input_ids, query_start_loc, ngram_context).
def _tensor_cases(name: str) -> list:
    return [
        case(
            f"{name}-list",
            set_(name, lambda t: t.tolist()),
            TypeError,
            f"{name} must be a torch.Tensor",
        ),
        case(f"{name}-none", put(name, None), TypeError, f"{name} must be a torch.Tensor"),
        case(
            f"{name}-float",
            set_(name, lambda t: t.float()),
            TypeError,
            f"{name} must be int32 or int64",
        ),
        case(
            f"{name}-int16",
            set_(name, lambda t: t.short()),
            TypeError,
            f"{name} must be int32 or int64",
        ),
    ]


CONTEXT_SHAPE = r"ngram_context must be \[R, N-1\] = \[4, 2\] .*ngram_size is 3\), got shape"
BATCH_CASES = [
    *_tensor_cases("input_ids"),
    *_tensor_cases("query_start_loc"),
    *_tensor_cases("ngram_context"),
    case(
        "query_start_loc-2d",
        set_("query_start_loc", lambda t: t.view(1, -1)),
        ValueError,
        r"query_start_loc must be 1-D \[R\+1\]",
    ),
    case(
        "query_start_loc-empty",
        set_("query_start_loc", lambda t: t[:0]),
        ValueError,
        r"query_start_loc must be 1-D \[R\+1\]",
    ),
    # Item 16: a context of the wrong width used to be blamed on the layer's layer_multipliers.
    case(
        "ngram_context-too-wide",
        set_("ngram_context", lambda t: torch.cat((t, t), 1)),
        ValueError,
        CONTEXT_SHAPE + r" \(4, 4\)",
    ),
    case(
        "ngram_context-too-narrow",
        set_("ngram_context", lambda t: t[:, :1]),
        ValueError,
        CONTEXT_SHAPE + r" \(4, 1\)",
    ),
    case(
        "ngram_context-too-few-rows",
        set_("ngram_context", lambda t: t[:3]),
        ValueError,
        CONTEXT_SHAPE + r" \(3, 2\)",
    ),
    case(
        "ngram_context-1d",
        set_("ngram_context", lambda t: t.reshape(-1)),
        ValueError,
        CONTEXT_SHAPE + r" \(8,\)",
    ),
]


# --- StagedLookupPipeline(...) ------------------------------------------------------------------


def _staged_args() -> dict:
    return {
        "modules": [make_embedding("bfloat16", "cpu", max_tokens=None)],
        "max_tokens": 32,
        "device": None,
        "decode": "auto",
        "threads": None,
    }


def _device_table():
    return NGramEmbedding(CONFIG, 1, placement="device", device="cpu")


STAGED_CONSTRUCTOR_CASES = [
    case(
        "modules-one-module",
        set_("modules", lambda m: m[0]),
        TypeError,
        "StagedLookupPipeline: modules must be an iterable of NGramEmbedding or PLELayer "
        "modules, got NGramEmbedding",
    ),
    case(
        "modules-none",
        put("modules", None),
        TypeError,
        "modules must be an iterable .* got NoneType",
    ),
    case("modules-empty", put("modules", []), ValueError, "needs at least one layer"),
    case(
        "modules-not-a-layer",
        put("modules", lambda: [torch.nn.Linear(2, 2)]),
        TypeError,
        "StagedLookupPipeline takes NGramEmbedding or PLELayer modules, got Linear",
    ),
    case(
        "modules-device-table",
        put("modules", lambda: [_device_table()]),
        ValueError,
        "reads host tables .* a 'device' table is read by its device: use LookupPipeline",
    ),
    case("max_tokens-zero", put("max_tokens", 0), ValueError, "max_tokens must be positive, got 0"),
    case(
        "max_tokens-negative",
        put("max_tokens", -8),
        ValueError,
        "max_tokens must be positive, got -8",
    ),
    case(
        "max_tokens-float",
        put("max_tokens", 8.0),
        TypeError,
        "max_tokens must be an integer, got float",
    ),
    case(
        "max_tokens-string",
        put("max_tokens", "8"),
        TypeError,
        "max_tokens must be an integer, got str",
    ),
    case(
        "max_tokens-bool",
        put("max_tokens", True),
        TypeError,
        "max_tokens must be an integer, got bool",
    ),
    case(
        "max_tokens-none",
        put("max_tokens", None),
        TypeError,
        "max_tokens must be an integer, got NoneType",
    ),
    case(
        "max_tokens-huge",
        put("max_tokens", 2**50),
        ValueError,
        r"max_tokens=1125899906842624 needs \d+ bytes .* more than this machine's memory",
    ),
    case("device-unknown", put("device", "bogus"), ValueError, "device 'bogus' is not a device"),
    case(
        "device-meta",
        put("device", "meta"),
        ValueError,
        "device must be the CPU or a CUDA/ROCm device, got meta",
    ),
    case(
        "device-int",
        put("device", 0),
        TypeError,
        "device must be a torch.device, a string or None, got int",
    ),
    case(
        "device-missing-gpu",
        put("device", "cuda:99"),
        ValueError,
        r"device cuda:99 does not exist here \(\d+ CUDA/ROCm devices\)",
    ),
    case(
        "decode-unknown",
        put("decode", "gpu"),
        ValueError,
        r"decode must be one of \('auto', 'host', 'device'\), got 'gpu'",
    ),
    case("decode-none", put("decode", None), ValueError, "decode must be one of .* got None"),
    case(
        "decode-list",
        put("decode", ["auto"]),
        ValueError,
        r"decode must be one of .* got \['auto'\]",
    ),
    case("threads-zero", put("threads", 0), ValueError, "threads must be positive, got 0"),
    case("threads-negative", put("threads", -1), ValueError, "threads must be positive, got -1"),
    case(
        "threads-huge",
        put("threads", 2**40),
        ValueError,
        r"threads must be at most \d+ \(this machine's CPUs; .*\), got 1099511627776",
    ),
    case("threads-float", put("threads", 2.0), TypeError, "threads must be an integer, got float"),
    case("threads-string", put("threads", "2"), TypeError, "threads must be an integer, got str"),
    case("threads-bool", put("threads", True), TypeError, "threads must be an integer, got bool"),
]


def test_staged_baseline_is_valid():
    with nothing_left_behind():
        args = _staged_args()
        with StagedLookupPipeline(**args) as pipeline:
            batch = _batch()
            with pipeline.submit(**batch, timeout=WAIT) as step:
                same_bits(step.rows(0, timeout=WAIT), args["modules"][0](**batch))
            pipeline.close(timeout=WAIT)


@pytest.mark.parametrize("override,exc,match", STAGED_CONSTRUCTOR_CASES)
def test_staged_constructor_refuses_and_starts_no_thread(override, exc, match):
    with nothing_left_behind():
        args = _staged_args()
        override(args)
        with pytest.raises(exc, match=match):
            StagedLookupPipeline(**args)


# --- StagedLookupPipeline.submit(...) -----------------------------------------------------------

SUBMIT_CASES = [
    *BATCH_CASES,
    case(
        "input_ids-too-many",
        put("input_ids", lambda: torch.zeros(33, dtype=torch.int64)),
        ValueError,
        "the batch has 33 tokens but the buffers hold 32 \\(max_tokens\\); nothing was started",
    ),
    case(
        "input_ids-meta",
        set_("input_ids", lambda t: t.to("meta")),
        ValueError,
        "input_ids must be on the host .* got meta",
    ),
    case(
        "query_start_loc-meta",
        set_("query_start_loc", lambda t: t.to("meta")),
        ValueError,
        "query_start_loc must be on the host .* got meta",
    ),
    case(
        "ngram_context-meta",
        set_("ngram_context", lambda t: t.to("meta")),
        ValueError,
        "ngram_context must be on the host .* got meta",
    ),
    case(
        "timeout-negative",
        put("timeout", -1),
        ValueError,
        "timeout must be a number of seconds >= 0, got -1",
    ),
    case(
        "timeout-nan",
        put("timeout", math.nan),
        ValueError,
        "timeout must be a number of seconds >= 0, got nan",
    ),
    case(
        "timeout-string",
        put("timeout", "1"),
        TypeError,
        "timeout must be a number of seconds or None, got str",
    ),
    case(
        "timeout-bool",
        put("timeout", True),
        TypeError,
        "timeout must be a number of seconds or None, got bool",
    ),
]


@pytest.mark.parametrize("override,exc,match", SUBMIT_CASES)
def test_staged_submit_refuses_and_starts_nothing(override, exc, match):
    """The refused submit starts no step: the next valid one is step 0, with its own rows."""
    with nothing_left_behind():
        layer = make_embedding("bfloat16", "cpu", max_tokens=None)
        with StagedLookupPipeline([layer], max_tokens=32) as pipeline:
            args = {**_batch(), "timeout": WAIT}
            override(args)
            with pytest.raises(exc, match=f"StagedLookupPipeline.submit: {match}"):
                pipeline.submit(**args)
            batch = _batch(seed=1)
            with pipeline.submit(**batch, timeout=WAIT) as step:
                assert step.number == 0
                same_bits(step.rows(0, timeout=WAIT), layer(**batch))
            pipeline.close(timeout=WAIT)


# Bad values of query_start_loc are seen by the worker's op (reading them is its job): the
# step's rows() raises the op's message, and the next step is served.
QSL_VALUE_CASES = [
    case(
        "query_start_loc-past-the-tokens",
        put("query_start_loc", lambda: torch.tensor([0, 5, 5, 18, 20], dtype=torch.int32)),
        RuntimeError,
        r"query_start_loc\[R\] = 20 is past the 19 tokens of input_ids",
    ),
    case(
        "query_start_loc-decreasing",
        put("query_start_loc", lambda: torch.tensor([0, 5, 3, 18, 19], dtype=torch.int32)),
        RuntimeError,
        "query_start_loc must be non-decreasing, got 5 then 3 at index 1",
    ),
    case(
        "query_start_loc-not-from-0",
        put("query_start_loc", lambda: torch.tensor([1, 5, 5, 18, 19], dtype=torch.int32)),
        RuntimeError,
        r"query_start_loc\[0\] must be 0, got 1",
    ),
]


@pytest.mark.parametrize("override,exc,match", QSL_VALUE_CASES)
def test_staged_bad_values_fail_their_step_only(override, exc, match):
    with nothing_left_behind():
        layer = make_embedding("bfloat16", "cpu", max_tokens=None)
        with StagedLookupPipeline([layer], max_tokens=32) as pipeline:
            args = _batch()
            override(args)
            with pipeline.submit(**args, timeout=WAIT) as step:
                with pytest.raises(exc, match=f"StagedStep 0: no rows for layer 0: .*{match}"):
                    step.rows(0, timeout=WAIT)
                with pytest.raises(exc, match=match):
                    step.wait(timeout=WAIT)
            batch = _batch(seed=1)
            with pipeline.submit(**batch, timeout=WAIT) as step:
                same_bits(step.rows(0, timeout=WAIT), layer(**batch))
            pipeline.close(timeout=WAIT)


# --- a step's rows(layer) / wait / release, and close -------------------------------------------


def _other_layer():
    return make_embedding("bfloat16", "cpu", layer_index=2, max_tokens=None)


ROWS_CASES = [
    case(
        "layer-past-the-end",
        put("layer", 2),
        IndexError,
        r"StagedStep.rows: layer 2 out of range \(2 layers\)",
    ),
    case(
        "layer-before-the-start",
        put("layer", -3),
        IndexError,
        r"StagedStep.rows: layer -3 out of range \(2 layers\)",
    ),
    case(
        "layer-string",
        put("layer", "0"),
        TypeError,
        "StagedStep.rows: layer must be an index into the pipeline's modules or one of them, "
        "got str '0'",
    ),
    case("layer-float", put("layer", 0.0), TypeError, "layer must be an index .* got float 0.0"),
    case("layer-bool", put("layer", True), TypeError, "layer must be an index .* got bool True"),
    case(
        "layer-none", put("layer", None), TypeError, "layer must be an index .* got NoneType None"
    ),
    case(
        "layer-not-in-the-pipeline",
        put("layer", _other_layer),
        ValueError,
        "StagedStep.rows: that layer is not part of this pipeline",
    ),
    case(
        "layer-not-a-layer",
        put("layer", lambda: torch.nn.Linear(2, 2)),
        TypeError,
        "StagedStep.rows takes NGramEmbedding or PLELayer modules, got Linear",
    ),
    case(
        "timeout-negative",
        put("timeout", -0.5),
        ValueError,
        "StagedStep.rows: timeout must be a number of seconds >= 0, got -0.5",
    ),
    case(
        "timeout-string",
        put("timeout", "1"),
        TypeError,
        "StagedStep.rows: timeout must be a number of seconds or None, got str",
    ),
]


@pytest.mark.parametrize("override,exc,match", ROWS_CASES)
def test_staged_rows_misuse_raises_and_the_step_still_serves(override, exc, match):
    with nothing_left_behind():
        layers = [make_embedding("bfloat16", "cpu", layer_index=i, max_tokens=None) for i in (0, 1)]
        with StagedLookupPipeline(layers, max_tokens=32) as pipeline:
            batch = _batch()
            with pipeline.submit(**batch, timeout=WAIT) as step:
                args = {"layer": 0, "timeout": WAIT}
                override(args)
                with pytest.raises(exc, match=match):
                    step.rows(args["layer"], timeout=args["timeout"])
                for index in (1, 0):
                    same_bits(step.rows(index, timeout=WAIT), layers[index](**batch))
            pipeline.close(timeout=WAIT)


def test_staged_step_and_pipeline_misuse():
    """rows / wait after release, wait's timeout, submit after close, close's timeout; release
    and close are idempotent."""
    with nothing_left_behind():
        layer = make_embedding("bfloat16", "cpu", max_tokens=None)
        pipeline = StagedLookupPipeline([layer], max_tokens=32)
        step = pipeline.submit(**_batch(), timeout=WAIT)
        with pytest.raises(TypeError, match="StagedStep.rows: timeout must be a number"):
            step.wait(timeout="soon")
        step.wait(timeout=WAIT)
        step.release()
        step.release()  # idempotent
        with pytest.raises(RuntimeError, match="StagedStep 0 was released; its rows are gone"):
            step.rows(0, timeout=WAIT)
        with pytest.raises(RuntimeError, match="StagedStep 0 was released; its rows are gone"):
            step.wait(timeout=WAIT)
        with pytest.raises(ValueError, match="StagedLookupPipeline.close: timeout must be"):
            pipeline.close(timeout=-1)
        pipeline.close(timeout=WAIT)
        pipeline.close(timeout=WAIT)  # idempotent
        with pytest.raises(
            RuntimeError, match="StagedLookupPipeline.submit: the pipeline is closed"
        ):
            pipeline.submit(**_batch(), timeout=WAIT)


# --- LookupPipeline(...) ----------------------------------------------------------------------


def _lookup_args() -> dict:
    layers = [make_embedding("bfloat16", "cpu", layer_index=i, seed=i) for i in (0, 1)]
    return {"modules": layers, "max_blocks": None, "stream": None, "dedupe": False}


def _without_buffers():
    return [NGramEmbedding(CONFIG, 1, placement="cpu")]


LOOKUP_CONSTRUCTOR_CASES = [
    case(
        "modules-one-module",
        set_("modules", lambda m: m[0]),
        TypeError,
        "LookupPipeline: modules must be an iterable of NGramEmbedding or PLELayer modules, "
        "got NGramEmbedding",
    ),
    case(
        "modules-none",
        put("modules", None),
        TypeError,
        "modules must be an iterable .* got NoneType",
    ),
    case(
        "modules-not-a-layer",
        put("modules", lambda: [torch.nn.Linear(2, 2)]),
        TypeError,
        "LookupPipeline takes NGramEmbedding or PLELayer modules, got Linear",
    ),
    case(
        "modules-without-buffers",
        put("modules", _without_buffers),
        RuntimeError,
        r"LookupPipeline: this NGramEmbedding has no prefetch buffers; build it .* with max_tokens",
    ),
    case("max_blocks-zero", put("max_blocks", 0), ValueError, "max_blocks must be positive, got 0"),
    case(
        "max_blocks-negative",
        put("max_blocks", -4),
        ValueError,
        "max_blocks must be positive, got -4",
    ),
    # Item 16: max_blocks="x" used to fail with a TypeError about '<='.
    case(
        "max_blocks-string",
        put("max_blocks", "x"),
        TypeError,
        "LookupPipeline: max_blocks must be an integer, got str 'x'",
    ),
    case(
        "max_blocks-float",
        put("max_blocks", 1.5),
        TypeError,
        "max_blocks must be an integer, got float",
    ),
    case(
        "max_blocks-bool",
        put("max_blocks", True),
        TypeError,
        "max_blocks must be an integer, got bool",
    ),
    case(
        "max_blocks-huge",
        put("max_blocks", 2**31),
        ValueError,
        r"max_blocks must be at most 2147483647 \(a grid's x dimension\), got 2147483648",
    ),
    case(
        "stream-string",
        put("stream", "side"),
        TypeError,
        "LookupPipeline: stream must be a torch.cuda.Stream or None, got str",
    ),
    case(
        "dedupe-string",
        put("dedupe", "no"),
        TypeError,
        "LookupPipeline: dedupe must be True or False, got 'no'",
    ),
    case("dedupe-int", put("dedupe", 1), TypeError, "dedupe must be True or False, got 1"),
]


def test_lookup_baseline_is_valid():
    with nothing_left_behind():
        args = _lookup_args()
        pipeline = LookupPipeline(**args)
        batch = _batch()
        pipeline.start_prefetch(**batch)
        for index in (1, 0):
            same_bits(pipeline.finalize_prefetch(index), args["modules"][index](**batch))


@pytest.mark.parametrize("override,exc,match", LOOKUP_CONSTRUCTOR_CASES)
def test_lookup_constructor_refuses(override, exc, match):
    with nothing_left_behind():
        args = _lookup_args()
        override(args)
        with pytest.raises(exc, match=match):
            LookupPipeline(**args)


START_CASES = [
    *BATCH_CASES,
    case(
        "input_ids-too-many",
        put("input_ids", lambda: torch.zeros(33, dtype=torch.int64)),
        ValueError,
        r"the batch has 33 tokens but the prefetch buffers hold 32 \(max_tokens\); nothing was "
        "started",
    ),
    case(
        "input_ids-meta",
        set_("input_ids", lambda t: t.to("meta")),
        ValueError,
        "input_ids are on meta but the layer looks up on cpu; nothing was started",
    ),
]


@pytest.mark.parametrize("override,exc,match", START_CASES)
def test_lookup_start_refuses_and_launches_nothing(override, exc, match):
    """The refused start launches no layer: none is pending, every buffer keeps its bytes, and
    the next valid step is served."""
    with nothing_left_behind():
        layers = _lookup_args()["modules"]
        pipeline = LookupPipeline(layers)
        before = [layer.prefetch_slot.rows.clone() for layer in layers]
        args = _batch()
        override(args)
        with pytest.raises(exc, match=f"LookupPipeline.start_prefetch: {match}"):
            pipeline.start_prefetch(**args)
        for layer, rows in zip(layers, before, strict=True):
            assert not layer.prefetch_pending
            same_bits(layer.prefetch_slot.rows, rows)
        batch = _batch(seed=1)
        pipeline.start_prefetch(**batch)
        for index in (1, 0):
            same_bits(pipeline.finalize_prefetch(index), layers[index](**batch))


FINALIZE_CASES = [
    # Item 16: finalize_prefetch(5) used to raise a bare IndexError.
    case(
        "layer-past-the-end",
        put("layer", 5),
        IndexError,
        r"LookupPipeline.finalize_prefetch: layer 5 out of range \(2 layers\)",
    ),
    case(
        "layer-before-the-start",
        put("layer", -3),
        IndexError,
        r"layer -3 out of range \(2 layers\)",
    ),
    case(
        "layer-string",
        put("layer", "1"),
        TypeError,
        "LookupPipeline.finalize_prefetch: layer must be an index into the pipeline's modules or "
        "one of them, got str '1'",
    ),
    case("layer-bool", put("layer", False), TypeError, "layer must be an index .* got bool False"),
    case("layer-float", put("layer", 1.0), TypeError, "layer must be an index .* got float 1.0"),
    case(
        "layer-not-in-the-pipeline",
        put("layer", lambda: make_embedding("bfloat16", "cpu", layer_index=3)),
        ValueError,
        "LookupPipeline.finalize_prefetch: that layer is not part of this pipeline",
    ),
    case(
        "layer-not-a-layer",
        put("layer", lambda: torch.nn.Linear(2, 2)),
        TypeError,
        "LookupPipeline.finalize_prefetch takes NGramEmbedding or PLELayer modules, got Linear",
    ),
]


@pytest.mark.parametrize("override,exc,match", FINALIZE_CASES)
def test_lookup_finalize_refuses_and_keeps_the_rows_pending(override, exc, match):
    with nothing_left_behind():
        layers = _lookup_args()["modules"]
        pipeline = LookupPipeline(layers)
        batch = _batch()
        pipeline.start_prefetch(**batch)
        args = {"layer": 0}
        override(args)
        with pytest.raises(exc, match=match):
            pipeline.finalize_prefetch(args["layer"])
        assert all(layer.prefetch_pending for layer in layers)
        for index in (1, 0):
            same_bits(pipeline.finalize_prefetch(index), layers[index](**batch))


def test_lookup_finalize_out_of_order_of_the_steps():
    with nothing_left_behind():
        pipeline = LookupPipeline(_lookup_args()["modules"])
        with pytest.raises(RuntimeError, match="no lookup was started; call start_prefetch"):
            pipeline.finalize_prefetch(0)
        pipeline.start_prefetch(**_batch())
        pipeline.finalize_prefetch(0)
        with pytest.raises(RuntimeError, match="already finalized; start_prefetch again"):
            pipeline.finalize_prefetch(0)


# --- the layers' own lookups: a batch of the wrong shape names the batch ------------------------


@pytest.mark.parametrize("override,exc,match", BATCH_CASES)
def test_a_layer_forward_names_the_bad_batch(override, exc, match):
    """NGramEmbedding.forward (CPU: the fused lookup) and its prefetch start refuse the batch
    by name, not the layer's hash constants."""
    module = make_embedding("bfloat16", "cpu")
    args = _batch()
    override(args)
    with pytest.raises(exc, match=f"NGramEmbedding: {match}"):
        module(**args)
    with pytest.raises(exc, match=f"start_prefetch: {match}"):
        module.start_prefetch(**args)
    assert not module.prefetch_pending


def test_a_ple_layer_with_a_context_of_the_wrong_width_names_it():
    _, (layer, _), _ = ple_layers("cpu", "bfloat16", max_tokens=8)
    ids = torch.arange(4)
    hidden = torch.zeros(4, layer.hc_hidden_size, dtype=torch.bfloat16)
    qsl = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"ngram_context must be \[R, N-1\] = \[1, 2\]"):
        layer.start_prefetch(ids, qsl, torch.zeros(1, 3, dtype=torch.int64))
    assert not layer.ple_embedding.prefetch_pending
    layer(hidden, ids)


def test_a_module_list_is_an_iterable_of_modules():
    layers = torch.nn.ModuleList(_lookup_args()["modules"])
    with nothing_left_behind():
        assert len(LookupPipeline(layers)) == 2
        with StagedLookupPipeline(layers, max_tokens=8) as pipeline:
            assert len(pipeline) == 2
            pipeline.close(timeout=WAIT)
