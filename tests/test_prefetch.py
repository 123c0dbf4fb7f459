"""The lookup pipeline (python/qwen4exp_ext/layers/prefetch.py): lookups started ahead of the
layers, on every device this machine has, equal ``forward`` bit for bit (every table format,
vocabulary shards, empty and odd batches, several layers per step); misuse raises and writes
nothing; a PLELayer with ``max_tokens`` allocates nothing large. On a GPU also: a side stream
delayed on purpose (a spin queued before the lookups) still gives exact rows, and a captured
step replays with changing ids."""

from __future__ import annotations

import time

import pytest
import torch

from conftest import devices
from lookup_support import (
    BATCHES,
    CONFIG,
    FORMATS,
    make_batch,
    make_embedding,
    ple_layers,
    same_bits,
    slow_layers,
)
from qwen4exp_ext.layers import LookupPipeline, NGramEmbedding, PLEState


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("table_format", FORMATS)
@pytest.mark.parametrize("lengths", list(BATCHES.values()), ids=list(BATCHES))
def test_prefetched_rows_equal_forward(device, table_format, lengths):
    """One embedding's start_prefetch / finalize_prefetch equals its forward, bit for bit."""
    module = make_embedding(table_format, device)
    batch = make_batch(lengths, device)
    want = module(*batch)
    module.start_prefetch(*batch)
    assert module.prefetch_pending
    got = module.finalize_prefetch()
    assert not module.prefetch_pending
    same_bits(got, want)


@pytest.mark.parametrize("device", devices())
def test_a_pipeline_of_several_layers_equals_each_forward(device):
    """Three layers of different formats and layer indices, started once per step, several
    steps of different sizes; finalized out of order."""
    layers = [
        make_embedding("bfloat16", device, layer_index=0, seed=1),
        make_embedding("float8_e4m3fn", device, layer_index=1, seed=2),
        make_embedding("float32", device, layer_index=3, seed=3),
    ]
    pipeline = LookupPipeline(layers)
    for step, lengths in enumerate(([5, 0, 13, 1], [1, 1, 1], [32], [2, 7])):
        batch = make_batch(lengths, device, seed=step)
        wants = [layer(*batch) for layer in layers]
        pipeline.start_prefetch(*batch)
        for index in (2, 0, 1):
            same_bits(pipeline.finalize_prefetch(index), wants[index])


def _repeating_batch(device):
    """Requests that repeat n-grams (a phrase three times, one token many times), and one
    token that is EOS: many ids of the batch are equal."""
    phrase = [11, 12, 13, 14]
    tokens = phrase * 3 + [7] * 9 + [CONFIG.eos_token_id, 3, 4] + phrase
    lengths = [12, 9, 7]
    input_ids = torch.tensor(tokens[: sum(lengths)])
    qsl = torch.tensor([0, 12, 21, 28], dtype=torch.int32)
    context = torch.tensor([[11, 12], [7, 7], [1, 2]])
    return input_ids.to(device), qsl.to(device), context.to(device)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("table_format", FORMATS)
@pytest.mark.parametrize("lengths", [*BATCHES.values(), "repeating"], ids=[*BATCHES, "repeating"])
def test_deduplicated_lookups_equal_forward(device, table_format, lengths):
    """``dedupe=True`` (each distinct row read once) gives forward's rows bit for bit, over
    steps of several sizes (the buffers are reused)."""
    layers = [make_embedding(table_format, device, layer_index=i, seed=i) for i in (0, 3)]
    pipeline = LookupPipeline(layers, dedupe=True)
    for seed in range(3):
        batch = (
            _repeating_batch(device)
            if lengths == "repeating"
            else make_batch(lengths, device, seed)
        )
        wants = [layer(*batch) for layer in layers]
        pipeline.start_prefetch(*batch)
        for index in (1, 0):
            same_bits(pipeline.finalize_prefetch(index), wants[index])


def test_deduplicated_lookups_read_each_distinct_row_once(monkeypatch):
    """The table gather asks for every distinct id of the batch once (the repeats ask for -1,
    a zero row), and for nothing else."""
    from qwen4exp_ext import ops

    layer = make_embedding("bfloat16", "cpu")
    batch = _repeating_batch("cpu")
    ids = layer._ngram_ids(*batch).reshape(-1)
    asked = []
    real = ops.gather_rows

    def spy(table, ids_, **kwargs):
        asked.append(ids_.reshape(-1).clone())
        return real(table, ids_, **kwargs)

    monkeypatch.setattr(ops, "gather_rows", spy)
    LookupPipeline([layer], dedupe=True).start_prefetch(*batch)
    (read,) = asked
    read = read[read >= 0]
    assert ids.unique().numel() < ids.numel() / 2  # the case repeats many ids
    assert sorted(read.tolist()) == sorted(ids.unique().tolist())


@pytest.mark.parametrize("table_format", ["bfloat16", "float8_e4m3fn", "nvfp4"])
@pytest.mark.parametrize("dedupe", [False, True])
def test_vocabulary_shards_prefetch_their_own_rows(one_process_group, table_format, dedupe):
    """Each rank's prefetched rows equal its forward (rows of other ranks read zero)."""
    for rank in range(3):
        module = make_embedding(table_format, "cpu", shard=(rank, 3), seed=rank)
        for batch in (make_batch([5, 0, 13, 1], "cpu"), _repeating_batch("cpu")):
            want = module(*batch)
            LookupPipeline([module], dedupe=dedupe).start_prefetch(*batch)
            same_bits(module.finalize_prefetch(), want)


def test_finalize_without_a_start_twice_or_too_large_raises_and_writes_nothing():
    module = make_embedding("bfloat16", "cpu", max_tokens=8)
    small = make_batch([3, 2], "cpu")
    with pytest.raises(RuntimeError, match="no lookup was started; call start_prefetch first"):
        module.finalize_prefetch()
    module.start_prefetch(*small)
    first = module.finalize_prefetch().clone()
    with pytest.raises(RuntimeError, match="already finalized; start_prefetch again"):
        module.finalize_prefetch()
    # A batch larger than the buffers: nothing is launched, the buffers keep the last rows.
    rows_before = module.prefetch_slot.rows.clone()
    with pytest.raises(ValueError, match="9 tokens but the prefetch buffers hold 8"):
        module.start_prefetch(*make_batch([9], "cpu"))
    assert torch.equal(module.prefetch_slot.rows, rows_before)
    with pytest.raises(RuntimeError, match="already finalized"):
        module.finalize_prefetch()
    module.start_prefetch(*small)
    same_bits(module.finalize_prefetch(), first)


def test_a_pipeline_checks_every_layer_before_launching_any():
    big = make_embedding("bfloat16", "cpu", max_tokens=16, layer_index=0)
    small = make_embedding("bfloat16", "cpu", max_tokens=4, layer_index=1)
    pipeline = LookupPipeline([big, small])
    before = big.prefetch_slot.rows.clone()
    with pytest.raises(ValueError, match="5 tokens but the prefetch buffers hold 4"):
        pipeline.start_prefetch(*make_batch([5], "cpu"))
    assert torch.equal(big.prefetch_slot.rows, before)
    assert not big.prefetch_pending and not small.prefetch_pending


def test_errors_name_what_is_missing():
    without = NGramEmbedding(CONFIG, 1, placement="cpu")
    with pytest.raises(RuntimeError, match="no prefetch buffers; build it .* with max_tokens"):
        without.start_prefetch(*make_batch([2], "cpu"))
    with pytest.raises(RuntimeError, match="no prefetch buffers"):
        LookupPipeline([without])
    with pytest.raises(TypeError, match="NGramEmbedding or PLELayer"):
        LookupPipeline([torch.nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="max_tokens must be positive"):
        NGramEmbedding(CONFIG, 1, placement="cpu", max_tokens=0)
    with pytest.raises(ValueError, match="max_blocks must be positive"):
        LookupPipeline([make_embedding("bfloat16", "cpu")], max_blocks=0)
    other = make_embedding("bfloat16", "cpu", layer_index=2)
    pipeline = LookupPipeline([make_embedding("bfloat16", "cpu")])
    with pytest.raises(ValueError, match="not part of this pipeline"):
        pipeline.finalize_prefetch(other)


# --- PLELayer ----------------------------------------------------------------------------------


def _state(config, device):
    return PLEState(
        max_requests=4,
        hc_hidden_size=config.hidden_size * config.hc_count,
        state_len=(config.ple_conv_kernel_size - 1) * config.ngram_size,
        ngram_size=config.ngram_size,
        eos_token_id=config.eos_token_id,
        num_layers=2,
        dtype=torch.bfloat16,
        device=device,
    )


SCHEDULE = [[("a", 5), ("b", 3)], [("a", 1), ("b", 1), ("c", 7)], [("c", 1)], [("b", 2)]]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("table_format", ["bfloat16", "float8_e4m3fn", "nvfp4"])
def test_ple_layers_with_a_pipeline_equal_layers_without(device, table_format):
    """Two PLE layers whose lookups start at step entry (and that write into their own buffers)
    give what layers without either give, bit for bit, over chunked prefills and decodes."""
    config, layers, twins = ple_layers(device, table_format, max_tokens=16)
    pipeline = LookupPipeline(layers)
    ours, theirs = _state(config, device), _state(config, device)
    gen = torch.Generator().manual_seed(9)
    for step in SCHEDULE:
        chunks = [(r, torch.randint(0, config.vocab_size, (n,), generator=gen)) for r, n in step]
        for state in (ours, theirs):
            for request, _ in step:
                if request not in state.request_ids:
                    state.add_request(request)
        batch, twin_batch = ours.prepare(chunks), theirs.prepare(chunks)
        c = layers[0].hc_hidden_size
        hidden = (torch.randn(batch.num_tokens, c, generator=gen) * 0.5).to(torch.bfloat16)
        got, want = hidden.to(device), hidden.to(device)
        pipeline.start_prefetch(batch.input_ids, batch.query_start_loc, batch.ngram_context)
        for layer, twin in zip(layers, twins, strict=True):
            assert layer.ple_embedding.prefetch_pending
            got = layer(got, batch.input_ids, batch).clone()
            assert not layer.ple_embedding.prefetch_pending
            want = twin(want, twin_batch.input_ids, twin_batch)
            same_bits(got, want)
        ours.commit(batch)
        theirs.commit(twin_batch)


@pytest.mark.parametrize("device", devices())
def test_ple_layer_buffers_keep_their_addresses(device):
    """With max_tokens, a forward writes its output and intermediates into the layer's own
    buffers, the same memory every call (as graphs need); without a prefetch, too."""
    config, (layer, _), (twin, _) = ple_layers(device, "bfloat16", max_tokens=16)
    gen = torch.Generator().manual_seed(3)
    addresses = set()
    for tokens in (16, 3, 9):
        ids = torch.randint(0, config.vocab_size, (tokens,), generator=gen).to(device)
        hidden = torch.randn(tokens, layer.hc_hidden_size, generator=gen).to(torch.bfloat16)
        hidden = hidden.to(device)
        out = layer(hidden, ids)
        addresses.add(out.data_ptr())
        same_bits(out, twin(hidden, ids))
        layer.start_prefetch(ids)
        same_bits(layer(hidden, ids), twin(hidden, ids))
    assert len(addresses) == 1
    with pytest.raises(ValueError, match="17 tokens, but the layer was built for max_tokens"):
        layer(
            torch.zeros(17, layer.hc_hidden_size, dtype=torch.bfloat16, device=device),
            torch.zeros(17, dtype=torch.int64, device=device),
        )


def test_a_forward_refuses_a_lookup_started_for_other_tokens():
    _, (layer, _), _ = ple_layers("cpu", "bfloat16", max_tokens=8)
    ids = torch.arange(4)
    layer.start_prefetch(ids)
    hidden = torch.zeros(4, layer.hc_hidden_size, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="started .* for other input_ids than this forward"):
        layer(hidden, ids.clone())
    assert layer.ple_embedding.prefetch_pending  # the started lookup is still there
    layer(hidden, ids)


# --- GPU: the side stream's ordering, and graphs -----------------------------------------------

needs_gpu = pytest.mark.skipif("cuda" not in devices(), reason="needs a GPU and a GPU build")
SPIN_CYCLES = 200_000_000  # ~0.1 s at 2 GHz: far longer than any lookup here


@needs_gpu
@pytest.mark.parametrize("dedupe", [False, True])
def test_gpu_a_delayed_side_stream_still_gives_exact_rows(dedupe):
    """A spin queued on the side stream before the lookups: finalize must wait for this
    layer's event, so the rows are exact (the buffer holds NaN until the lookup writes it)."""
    from qwen4exp_ext.layers.prefetch import side_stream

    layers = [make_embedding("bfloat16", "cuda", layer_index=i, seed=i) for i in range(3)]
    batch = make_batch([5, 0, 13, 1], "cuda")
    wants = [layer(*batch) for layer in layers]
    for layer in layers:
        layer.prefetch_slot.rows.fill_(float("nan"))
    torch.cuda.synchronize()
    with torch.cuda.stream(side_stream(torch.device("cuda", torch.cuda.current_device()))):
        torch.cuda._sleep(SPIN_CYCLES)
    pipeline = LookupPipeline(layers, dedupe=dedupe)
    pipeline.start_prefetch(*batch)
    for index in (1, 0, 2):
        same_bits(pipeline.finalize_prefetch(index).clone(), wants[index])


@needs_gpu
def test_gpu_the_side_stream_waits_for_ids_written_by_a_slow_main_stream():
    """The ids are written on the main stream after a spin: the side stream must wait for them
    (wait_stream), or it hashes the previous step's ids."""
    layer = make_embedding("float8_e4m3fn", "cuda")
    first, second = make_batch([7, 2], "cuda", seed=1), make_batch([7, 2], "cuda", seed=2)
    want = layer(*second)
    ids = first[0].clone()
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN_CYCLES)
    ids.copy_(second[0])
    layer.start_prefetch(ids, *second[1:])
    same_bits(layer.finalize_prefetch().clone(), want)


@needs_gpu
@pytest.mark.parametrize("dedupe", [False, True])
def test_gpu_a_captured_step_replays_with_changing_ids(dedupe):
    """Lookups captured with the step (a side branch of the graph): every replay reads the
    static ids and writes exact rows into the fixed buffers."""
    layers = [make_embedding(f, "cuda", layer_index=i, seed=i) for i, f in enumerate(FORMATS[:4])]
    pipeline = LookupPipeline(layers, dedupe=dedupe)
    static = [t.clone() for t in make_batch([9, 4, 3], "cuda", seed=0)]
    pipeline.start_prefetch(*static)  # eager warm-up: allocations, constants
    [pipeline.finalize_prefetch(i) for i in range(len(layers))]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pipeline.start_prefetch(*static)
        outs = [pipeline.finalize_prefetch(i) for i in range(len(layers))]
    for seed in (1, 2, 3):
        batch = make_batch([9, 4, 3], "cuda", seed=seed)
        for buffer, value in zip(static, batch, strict=True):
            buffer.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        for layer, out in zip(layers, outs, strict=True):
            same_bits(out, layer(*batch))


@pytest.mark.parametrize("refill", ["copy_", "numpy"])
def test_a_static_buffer_refilled_after_a_failed_step_never_gets_the_old_rows(refill):
    """Step 1's lookup is started from a static input buffer (as under CUDA graphs), then step
    1 fails before its forward; the buffer is refilled in place for step 2 (through torch, or
    behind its back through numpy, as vLLM's CPU buffers are), whose forward starts nothing:
    it must give step 2's rows, those of a layer without a prefetch, not step 1's."""
    config, (layer, _), (twin, _) = ple_layers("cpu", "bfloat16", max_tokens=8)
    gen = torch.Generator().manual_seed(4)
    steps = [torch.randint(0, config.vocab_size, (6,), generator=gen) for _ in range(2)]
    hidden = torch.randn(6, layer.hc_hidden_size, generator=gen).to(torch.bfloat16)
    static = steps[0].clone()
    layer.start_prefetch(static)  # step 1 ... fails before its forward
    if refill == "copy_":
        static.copy_(steps[1])
    else:
        static.numpy()[:] = steps[1].numpy()
    same_bits(layer(hidden, static).clone(), twin(hidden, steps[1]))
    assert not layer.ple_embedding.prefetch_pending  # the stale lookup was dropped
    # A lookup started for the buffer's current ids is still used.
    layer.start_prefetch(static)
    assert layer.ple_embedding.prefetch_pending
    same_bits(layer(hidden, static).clone(), twin(hidden, steps[1]))
    assert not layer.ple_embedding.prefetch_pending


# --- the other side slow, a lookup that raises ---------------------------------------------------


def test_a_slow_lookup_and_a_slow_consumer_still_get_their_rows():
    """Each lookup takes 0.2 s for real, and the consumer waits 0.2 s before it reads, over two
    steps: the rows handed out are each step's own."""
    layers = slow_layers(2)
    batches = [make_batch([5, 0, 13, 1], "cpu", seed=s) for s in range(2)]
    wants = [[layer(*batch) for layer in layers] for batch in batches]
    for layer in layers:
        layer.delay = 0.2
    pipeline = LookupPipeline(layers)
    for number, batch in enumerate(batches):
        pipeline.start_prefetch(*batch)
        time.sleep(0.2)  # the consumer is slow
        for index in (1, 0):
            same_bits(pipeline.finalize_prefetch(index), wants[number][index])


@pytest.mark.parametrize("failed", [0, 1])
def test_a_lookup_that_raises_fails_its_layers_and_the_next_step_is_served(failed):
    """Layer ``failed`` of three raises in step 1's start: start_prefetch raises it, the layers
    before keep step 1's rows, the failed one and those after say that their lookup failed (not
    "no lookup was started") and are not pending, and step 2 is served."""
    layers = slow_layers(3)
    batches = [make_batch([5, 0, 13, 1], "cpu", seed=s) for s in range(2)]
    wants = [[layer(*batch) for layer in layers] for batch in batches]
    pipeline = LookupPipeline(layers)
    layers[failed].failure = OSError("layer.table: pread failed: Input/output error")
    with pytest.raises(OSError, match="pread failed"):
        pipeline.start_prefetch(*batches[0])
    for index in range(failed):
        same_bits(pipeline.finalize_prefetch(index), wants[0][index])
    for index in range(failed, 3):
        assert not layers[index].prefetch_pending
        with pytest.raises(RuntimeError, match="lookup started for this step failed .*pread"):
            pipeline.finalize_prefetch(index)
    layers[failed].failure = None
    pipeline.start_prefetch(*batches[1])
    for index in (2, 0, 1):
        same_bits(pipeline.finalize_prefetch(index), wants[1][index])
