"""The CPU-staged lookup pipeline (python/qwen4exp_ext/layers/staged.py): rows equal each
layer's ``forward`` bit for bit (every format, odd and empty batches, several layers, shards);
the double buffer never refills a slot that a slow consumer still reads; a slow worker is waited
for, layer by layer; a failed lookup raises for its layer and the later ones and leaves the
previous step's rows intact; no thread outlives the pipeline; a step run inline on the
submitting thread gives the worker's rows and errors, and "auto" picks the way by its cost."""

from __future__ import annotations

import gc
import re
import statistics
import threading
import time

import pytest
import torch

from conftest import devices
from leak_support import nothing_left_behind
from lookup_support import (
    BATCHES,
    FORMATS,
    make_batch,
    make_embedding,
    ple_layers,
    same_bits,
    slow_layers,
)
from qwen4exp_ext.layers import StagedLookupPipeline
from qwen4exp_ext.layers.staged import SAMPLES

STEPS = ([5, 0, 13, 1], [1], [], [32], [2, 7])


def _workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "qwen4exp-staged-lookups"]


@pytest.mark.parametrize("table_format", FORMATS)
@pytest.mark.parametrize("lengths", list(BATCHES.values()), ids=list(BATCHES))
def test_staged_rows_equal_forward(table_format, lengths):
    module = make_embedding(table_format, "cpu")
    batch = make_batch(lengths, "cpu")
    want = module(*batch)
    with StagedLookupPipeline([module], max_tokens=32) as pipeline, pipeline.submit(*batch) as step:
        same_bits(step.rows(0), want)
        same_bits(step.rows(module), want)


@pytest.mark.parametrize("table_format", FORMATS)
@pytest.mark.parametrize("lengths", list(BATCHES.values()), ids=list(BATCHES))
def test_rows_decoded_by_the_device_equal_forward(table_format, lengths):
    """decode="device": the raw rows and local ids staged, then the device's gather decodes
    them (here the CPU's, the same code path as a GPU's but for the copies)."""
    module = make_embedding(table_format, "cpu")
    batch = make_batch(lengths, "cpu")
    want = module(*batch)
    pipeline = StagedLookupPipeline([module], max_tokens=32, decode="device")
    quantized = table_format in ("float8_e4m3fn", "float8_e4m3fnuz", "nvfp4")
    assert pipeline.decode_on_device == [quantized]
    with pipeline, pipeline.submit(*batch) as step:
        same_bits(step.rows(0), want)


@pytest.mark.parametrize("table_format", ["float8_e4m3fn", "nvfp4"])
def test_shards_decoded_by_the_device_read_their_own_rows(one_process_group, table_format):
    for rank in range(3):
        module = make_embedding(table_format, "cpu", shard=(rank, 3), seed=rank)
        batch = make_batch([5, 0, 13, 1], "cpu")
        with StagedLookupPipeline([module], max_tokens=32, decode="device") as pipeline:
            with pipeline.submit(*batch) as step:
                same_bits(step.rows(0), module(*batch))


def test_decode_is_checked_and_auto_decodes_on_the_host_of_a_cpu():
    module = make_embedding("nvfp4", "cpu")
    with StagedLookupPipeline([module], max_tokens=8) as pipeline:
        assert pipeline.decode_on_device == [False]
    with pytest.raises(ValueError, match="decode must be one of"):
        StagedLookupPipeline([module], max_tokens=8, decode="gpu")


def test_several_layers_over_many_steps_each_equal_forward():
    """Three layers of different formats; five steps of different sizes, one consumed while the
    next is prepared; layers read out of order."""
    layers = [
        make_embedding("bfloat16", "cpu", layer_index=0, seed=1),
        make_embedding("nvfp4", "cpu", layer_index=2, seed=2),
        make_embedding("float8_e4m3fnuz", "cpu", layer_index=3, seed=3),
    ]
    batches = [make_batch(lengths, "cpu", seed=s) for s, lengths in enumerate(STEPS)]
    wants = [[layer(*batch) for layer in layers] for batch in batches]
    with StagedLookupPipeline(layers, max_tokens=32) as pipeline:
        step = pipeline.submit(*batches[0])
        for number in range(len(batches)):
            following = pipeline.submit(*batches[number + 1]) if number + 1 < len(batches) else None
            for index in (2, 0, 1):
                same_bits(step.rows(index), wants[number][index])
            step.release()
            step = following


def test_inputs_are_copied_at_submit():
    """The caller may overwrite its ids right after submit."""
    module = make_embedding("bfloat16", "cpu")
    batch = make_batch([5, 0, 13, 1], "cpu")
    want = module(*batch)
    with StagedLookupPipeline([module], max_tokens=32) as pipeline:
        step = pipeline.submit(*batch)
        batch[0].fill_(3)
        batch[2].fill_(1)
        same_bits(step.rows(0), want)


@pytest.mark.parametrize("table_format", ["bfloat16", "float8_e4m3fn", "nvfp4"])
def test_vocabulary_shards_stage_their_own_rows(one_process_group, table_format):
    for rank in range(3):
        module = make_embedding(table_format, "cpu", shard=(rank, 3), seed=rank)
        batch = make_batch([5, 0, 13, 1], "cpu")
        with StagedLookupPipeline([module], max_tokens=32) as pipeline:
            with pipeline.submit(*batch) as step:
                same_bits(step.rows(0), module(*batch))


def test_a_slow_consumer_keeps_its_rows_until_it_releases_them():
    """Step 0 is held while steps 1 and 2 are submitted: step 2 needs step 0's slot, so its
    submit waits until step 0 is released, and step 0's rows stay as they were meanwhile."""
    module = make_embedding("bfloat16", "cpu")
    batches = [make_batch([13, 2], "cpu", seed=s) for s in range(3)]
    wants = [module(*batch) for batch in batches]
    with StagedLookupPipeline([module], max_tokens=32) as pipeline:
        first = pipeline.submit(*batches[0])
        held = first.rows(0)
        same_bits(held, wants[0])
        second = pipeline.submit(*batches[1])
        third: list = []
        submitter = threading.Thread(target=lambda: third.append(pipeline.submit(*batches[2])))
        submitter.start()
        time.sleep(0.3)  # the consumer is slow
        assert not third, "step 2 was submitted into the slot step 0 still holds"
        same_bits(held, wants[0])
        same_bits(second.rows(0), wants[1])
        first.release()
        submitter.join(timeout=10)
        assert third
        same_bits(third[0].rows(0), wants[2])
        with pytest.raises(RuntimeError, match="was released"):
            first.rows(0)
        second.release()
        third[0].release()


def test_submit_times_out_while_the_slot_is_held():
    module = make_embedding("bfloat16", "cpu")
    batch = make_batch([3], "cpu")
    with StagedLookupPipeline([module], max_tokens=8) as pipeline:
        held = pipeline.submit(*batch)
        pipeline.submit(*batch)
        with pytest.raises(TimeoutError, match="step 0's buffers are still held"):
            pipeline.submit(*batch, timeout=0.05)
        held.release()
        pipeline.submit(*batch, timeout=5)


def test_a_slow_worker_is_waited_for_layer_by_layer(monkeypatch):
    """The second layer's lookup is slow: its rows are waited for (and are right), while the
    first layer's rows are handed out before the second layer is done."""
    layers = [
        make_embedding("bfloat16", "cpu", layer_index=0),
        make_embedding("float32", "cpu", seed=4),
    ]
    batch = make_batch([5, 0, 13, 1], "cpu")
    wants = [layer(*batch) for layer in layers]
    gate = threading.Event()
    lookup = layers[1]._lookup_local

    def slow_lookup(*args, **kwargs):
        assert gate.wait(timeout=10)
        time.sleep(0.1)
        return lookup(*args, **kwargs)

    monkeypatch.setattr(layers[1], "_lookup_local", slow_lookup)
    with StagedLookupPipeline(layers, max_tokens=32) as pipeline:
        step = pipeline.submit(*batch)
        same_bits(step.rows(0), wants[0])  # not blocked behind layer 1
        with pytest.raises(TimeoutError, match="layer 1's rows not ready"):
            step.rows(1, timeout=0.05)
        gate.set()
        same_bits(step.rows(1), wants[1])
        step.release()


def test_a_failed_lookup_raises_for_its_layer_and_the_later_ones(monkeypatch):
    """Layer 1 fails in step 1: step 1's layer 0 rows are fine, layers 1 and 2 raise (no partial
    rows), and step 0's rows, in the other slot, are untouched; the next step works again."""
    layers = [make_embedding("bfloat16", "cpu", layer_index=i, seed=i) for i in range(3)]
    batches = [make_batch([5, 0, 13, 1], "cpu", seed=s) for s in range(3)]
    wants = [[layer(*batch) for layer in layers] for batch in batches]
    lookup = layers[1]._lookup_local
    fail = threading.Event()

    def failing(*args, **kwargs):
        if fail.is_set():
            raise OSError("/data/ple/layer1.table: pread failed: Input/output error")
        return lookup(*args, **kwargs)

    monkeypatch.setattr(layers[1], "_lookup_local", failing)
    with StagedLookupPipeline(layers, max_tokens=32) as pipeline:
        step0 = pipeline.submit(*batches[0])
        step0.wait()
        fail.set()
        step1 = pipeline.submit(*batches[1])
        same_bits(step1.rows(0), wants[1][0])
        for index in (1, 2):
            with pytest.raises(
                RuntimeError, match="lookup of layer 1 failed.*layer1.table: pread failed"
            ):
                step1.rows(index)
        for index in range(3):
            same_bits(step0.rows(index), wants[0][index])
        step0.release()
        step1.release()
        fail.clear()
        with pipeline.submit(*batches[2]) as step2:
            for index in range(3):
                same_bits(step2.rows(index), wants[2][index])


def test_misuse_raises_and_starts_nothing():
    module = make_embedding("bfloat16", "cpu", max_tokens=8)
    with pytest.raises(ValueError, match="at least one layer"):
        StagedLookupPipeline([], max_tokens=8)
    with pytest.raises(ValueError, match="max_tokens must be positive"):
        StagedLookupPipeline([module], max_tokens=0)
    with pytest.raises(TypeError, match="takes NGramEmbedding or PLELayer"):
        StagedLookupPipeline([torch.nn.Linear(2, 2)], max_tokens=8)
    pipeline = StagedLookupPipeline([module], max_tokens=8)
    with pytest.raises(ValueError, match="9 tokens but the buffers hold 8"):
        pipeline.submit(*make_batch([9], "cpu"))
    with pytest.raises(IndexError, match="layer 3 out of range"):
        pipeline.submit(*make_batch([2], "cpu")).rows(3)
    with pytest.raises(ValueError, match="not part of this pipeline"):
        pipeline.submit(*make_batch([2], "cpu")).rows(make_embedding("bfloat16", "cpu"))
    pipeline.close()
    with pytest.raises(RuntimeError, match="the pipeline is closed"):
        pipeline.submit(*make_batch([2], "cpu"))


def test_no_worker_outlives_its_pipeline():
    module = make_embedding("bfloat16", "cpu")
    pipeline = StagedLookupPipeline([module], max_tokens=8)
    worker = pipeline._worker
    assert worker.is_alive() and worker in _workers()
    pipeline.close()
    pipeline.close()  # idempotent
    assert not worker.is_alive()
    # Dropped without close(): the finalizer stops and joins the worker.
    pipeline = StagedLookupPipeline([module], max_tokens=8)
    worker = pipeline._worker
    step = pipeline.submit(*make_batch([3], "cpu"))
    step.wait()
    del pipeline, step
    # The pipeline and its unreleased step form a cycle, freed by the cyclic collector once the
    # worker has dropped its own reference (after it marked the step ready): collect until then.
    deadline = time.monotonic() + 30
    while worker.is_alive() and time.monotonic() < deadline:
        gc.collect()
        worker.join(timeout=0.05)
    assert not worker.is_alive()


def test_a_ple_layer_takes_staged_rows():
    """PLELayer.forward(embeddings=step.rows(i)) equals the layer's own lookup."""
    _, _, (layer, _) = ple_layers("cpu", "float8_e4m3fn", None)
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(19, layer.hc_hidden_size, generator=gen).to(layer.dtype)
    input_ids = torch.randint(0, 97, (19,), generator=gen)
    want = layer(hidden, input_ids)
    qsl, context = layer._one_sequence(input_ids.numel(), input_ids.device)
    with StagedLookupPipeline([layer], max_tokens=64) as pipeline:
        with pipeline.submit(input_ids, qsl, context) as step:
            same_bits(layer(hidden, input_ids, embeddings=step.rows(0)), want)
    with pytest.raises(ValueError, match="embeddings must be"):
        layer(hidden, input_ids, embeddings=torch.zeros(1, 1))


# --- on a GPU: pinned staging, one copy per layer, events --------------------------------------

needs_gpu = pytest.mark.skipif("cuda" not in devices(), reason="needs a GPU and a GPU build")
SPIN_CYCLES = 200_000_000  # ~0.1 s at 2 GHz: far longer than any lookup here


@needs_gpu
@pytest.mark.parametrize("decode", ["auto", "device"])
@pytest.mark.parametrize("table_format", ["bfloat16", "float8_e4m3fn", "nvfp4"])
def test_gpu_staged_rows_reach_the_device_exact(table_format, decode):
    layers = [
        make_embedding(table_format, "cpu", layer_index=0, seed=1),
        make_embedding("bfloat16", "cpu", layer_index=2, seed=2),
    ]
    pipeline = StagedLookupPipeline(layers, max_tokens=32, device="cuda", decode=decode)
    assert pipeline.decode_on_device[0] == (decode == "device" and table_format != "bfloat16")
    with pipeline:
        for seed, lengths in enumerate(STEPS):
            batch = make_batch(lengths, "cpu", seed=seed)
            with pipeline.submit(*batch) as step:
                for index in (1, 0):
                    rows = step.rows(index)
                    assert rows.device.type == "cuda"
                    same_bits(rows.cpu(), layers[index](*batch))


@needs_gpu
def test_gpu_a_slow_consumer_stream_keeps_its_rows():
    """The consumer's stream is busy (a spin) when it releases step 0, then reads step 0's rows:
    step 2, which reuses step 0's device buffers, must wait for that read (the release event)."""
    module = make_embedding("bfloat16", "cpu")
    batches = [make_batch([13, 2], "cpu", seed=s) for s in range(3)]
    wants = [module(*batch) for batch in batches]
    with StagedLookupPipeline([module], max_tokens=32, device="cuda") as pipeline:
        first = pipeline.submit(*batches[0])
        rows = first.rows(0)
        torch.cuda._sleep(SPIN_CYCLES)  # the consumer is slow
        seen = rows.clone()  # queued behind the spin
        first.release()
        second = pipeline.submit(*batches[1])
        third = pipeline.submit(*batches[2])  # reuses step 0's buffers
        got_third = third.rows(0).clone()
        torch.cuda.synchronize()
        same_bits(seen.cpu(), wants[0])
        same_bits(got_third.cpu(), wants[2])
        second.release()
        third.release()


def test_the_worker_uses_the_submitters_thread_count_or_its_own():
    """torch's intra-op thread count is per thread: each step's lookups run with the count of
    the thread that submitted it, or the pipeline's ``threads``."""
    module = make_embedding("bfloat16", "cpu")
    seen = []
    lookup = module._lookup_local

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return lookup(*args, **kwargs)

    module._lookup_local = spy
    batch = make_batch([3], "cpu")
    before = torch.get_num_threads()
    try:
        with StagedLookupPipeline([module], max_tokens=8) as pipeline:
            for count in (1, 2, 1):
                torch.set_num_threads(count)
                with pipeline.submit(*batch) as step:
                    step.wait()
        with StagedLookupPipeline([module], max_tokens=8, threads=2) as pipeline:
            torch.set_num_threads(1)
            with pipeline.submit(*batch) as step:
                step.wait()
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 2, 1, 2]
    with pytest.raises(ValueError, match="threads must be positive"):
        StagedLookupPipeline([module], max_tokens=8, threads=0)


# --- the other side slow, a worker that raises: nothing hangs (every wait has a timeout) ------

WAIT = 30  # seconds: any wait in these tests that takes longer is a hang


def test_a_slow_producer_is_waited_for_and_bounded_by_timeouts():
    """Each layer's lookup takes 0.3 s for real: rows(i) waits for layer i's rows (a shorter
    timeout raises TimeoutError, never partial rows), and the rows are forward's."""
    layers = slow_layers(2)
    batch = make_batch([5, 0, 13, 1], "cpu")
    wants = [layer(*batch) for layer in layers]
    for layer in layers:
        layer.delay = 0.3
    with StagedLookupPipeline(layers, max_tokens=32) as pipeline:
        step = pipeline.submit(*batch, timeout=WAIT)
        with pytest.raises(TimeoutError, match="layer 1's rows not ready after 0.01 s"):
            step.rows(1, timeout=0.01)
        for index in (0, 1):
            same_bits(step.rows(index, timeout=WAIT), wants[index])
        step.release()
        pipeline.close(timeout=WAIT)


def test_a_slow_consumer_holds_its_slot_and_the_submit_waits_with_a_timeout():
    """The consumer sits on step 0's rows: step 2 (step 0's slot) waits in submit, a bounded
    wait, and step 0's rows are untouched until it releases them."""
    (layer,) = slow_layers(1)
    batches = [make_batch([13, 2], "cpu", seed=s) for s in range(3)]
    wants = [layer(*batch) for batch in batches]
    with StagedLookupPipeline([layer], max_tokens=32) as pipeline:
        first = pipeline.submit(*batches[0], timeout=WAIT)
        held = first.rows(0, timeout=WAIT)
        second = pipeline.submit(*batches[1], timeout=WAIT)
        with pytest.raises(TimeoutError, match="step 0's buffers are still held after 0.2 s"):
            pipeline.submit(*batches[2], timeout=0.2)
        time.sleep(0.2)  # the consumer is slow
        same_bits(held, wants[0])
        first.release()
        third = pipeline.submit(*batches[2], timeout=WAIT)
        same_bits(second.rows(0, timeout=WAIT), wants[1])
        same_bits(third.rows(0, timeout=WAIT), wants[2])
        second.release()
        third.release()
        pipeline.close(timeout=WAIT)


def _refusal_of_set_num_threads() -> str:
    """What torch raises for set_num_threads(2**40), as the step's error reports it."""
    try:
        torch.set_num_threads(2**40)
    except Exception as error:  # noqa: BLE001 - whichever torch raises
        return f"{type(error).__name__}: {error}"
    raise AssertionError("torch accepted 2**40 threads")


@pytest.mark.parametrize("where", ["set_num_threads", "first layer", "middle layer"])
def test_a_worker_that_raises_fails_its_step_and_serves_the_next(where):
    """The worker raises while running step 1 (in torch.set_num_threads, outside any layer;
    in the first layer's lookup; in the middle one of three): every layer of step 1 from the
    failed one on raises the error in rows() (no wait blocks), the layers before it have their
    rows, and steps 2 and 3 are served."""
    layers = slow_layers(3)
    batches = [make_batch([5, 0, 13, 1], "cpu", seed=s) for s in range(3)]
    wants = [[layer(*batch) for layer in layers] for batch in batches]
    failed = {"set_num_threads": 0, "first layer": 0, "middle layer": 1}[where]
    with nothing_left_behind(), StagedLookupPipeline(layers, max_tokens=32) as pipeline:
        step0 = pipeline.submit(*batches[0], timeout=WAIT)
        step0.wait(timeout=WAIT)
        if where == "set_num_threads":
            pipeline.threads = 2**40  # past the constructor's check: torch refuses it
        else:
            layers[failed].failure = OSError("layer.table: pread failed: Input/output error")
        step1 = pipeline.submit(*batches[1], timeout=WAIT)
        if where == "set_num_threads":
            message = re.escape(_refusal_of_set_num_threads())
        else:
            message = "OSError: layer.table: pread failed"
        for index in range(failed, 3):
            with pytest.raises(
                RuntimeError,
                match=f"StagedStep 1: no rows for layer {index}: the lookup of layer {failed} "
                f"failed \\({message}",
            ):
                step1.rows(index, timeout=WAIT)
        with pytest.raises(RuntimeError, match=f"the lookup of layer {failed} failed \\({message}"):
            step1.wait(timeout=WAIT)
        for index in range(failed):
            same_bits(step1.rows(index, timeout=WAIT), wants[1][index])
        pipeline.threads = None
        layers[failed].failure = None
        step0.release()
        step1.release()
        for number in (2, 0):
            with pipeline.submit(*batches[number], timeout=WAIT) as step:
                for index in range(3):
                    same_bits(step.rows(index, timeout=WAIT), wants[number][index])
        pipeline.close(timeout=WAIT)


# --- vocabulary shards over two real ranks: one reduction per layer and step -------------------

RANKS = 2


def _rank_rows(rank: int, init_file: str, result_dir: str) -> None:
    """One gloo rank: the rows of its vocabulary shard of two layers, staged and reduced, read
    as a caller does (wait(), then rows(-1) twice, then rows(0) twice)."""
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=RANKS,
        timeout=datetime.timedelta(seconds=WAIT),
    )
    try:
        layers = []
        for index in range(2):
            full = make_embedding("bfloat16", "cpu", layer_index=index, seed=index)
            layer = make_embedding("bfloat16", "cpu", layer_index=index, shard=(rank, RANKS))
            with torch.no_grad():
                layer.weight.copy_(full.weight[layer.vocab_start : layer.vocab_end])
            layers.append(layer)
        with StagedLookupPipeline(layers, max_tokens=32) as pipeline:
            with pipeline.submit(*make_batch([5, 0, 13, 1], "cpu"), timeout=WAIT) as step:
                step.wait(timeout=WAIT)
                seen = [step.rows(-1, timeout=WAIT).clone(), step.rows(-1, timeout=WAIT).clone()]
                seen += [step.rows(0, timeout=WAIT).clone(), step.rows(0, timeout=WAIT).clone()]
        torch.save(seen, f"{result_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_ranks_reduce_each_layer_once_per_step(tmp_path):
    """Two gloo ranks, each with its shard of two layers: wait() then rows(-1) twice, then
    rows(0) twice give every rank the unsharded rows each time (an all-reduce per call would
    sum them twice over, and wait() must run no collective of its own)."""
    import torch.multiprocessing as mp

    context = mp.spawn(
        _rank_rows, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=RANKS, join=False
    )
    deadline = time.monotonic() + 4 * WAIT
    try:
        while not context.join(timeout=1):
            assert time.monotonic() < deadline, "the ranks did not finish (a hang)"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    batch = make_batch([5, 0, 13, 1], "cpu")
    wants = [make_embedding("bfloat16", "cpu", layer_index=i, seed=i)(*batch) for i in range(2)]
    for rank in range(RANKS):
        seen = torch.load(tmp_path / f"rank{rank}.pt")
        for got, want in zip(seen, [wants[1], wants[1], wants[0], wants[0]], strict=True):
            same_bits(got, want)


# --- small steps inline on the submitting thread (issue #51 item 4) ----------------------------


def _where_each_step_ran(layers) -> list[str]:
    """Records, for every lookup of ``layers``, which thread ran it ("worker" or "submitter")."""
    seen: list[str] = []
    for layer in layers:
        lookup = layer._lookup_local

        def spy(*args, _lookup=lookup, **kwargs):
            worker = threading.current_thread().name == "qwen4exp-staged-lookups"
            seen.append("worker" if worker else "submitter")
            return _lookup(*args, **kwargs)

        layer._lookup_local = spy
    return seen


@pytest.mark.parametrize("table_format", FORMATS)
def test_inline_steps_equal_the_workers_bit_for_bit(table_format):
    """The same steps (odd and empty batches, several layers) run inline on the submitting
    thread and on the worker give the same rows bit for bit, forward's."""
    layers = [make_embedding(table_format, "cpu", layer_index=i, seed=i) for i in range(2)]
    batches = [make_batch(lengths, "cpu", seed=n) for n, lengths in enumerate(STEPS)]
    wants = [[layer(*batch) for layer in layers] for batch in batches]
    seen = _where_each_step_ran(layers)
    rows = {}
    with nothing_left_behind():
        for inline in ("always", "never"):
            del seen[:]
            with StagedLookupPipeline(layers, max_tokens=32, inline=inline) as pipeline:
                rows[inline] = []
                for batch in batches:
                    with pipeline.submit(*batch, timeout=WAIT) as step:
                        assert step._inline == (inline == "always")
                        rows[inline].append([step.rows(i, timeout=WAIT).clone() for i in (0, 1)])
                pipeline.close(timeout=WAIT)
            where = "submitter" if inline == "always" else "worker"
            assert seen == [where] * (2 * len(batches))
    for n in range(len(batches)):
        for index in (0, 1):
            same_bits(rows["always"][n][index], wants[n][index])
            same_bits(rows["never"][n][index], rows["always"][n][index])


def test_inline_steps_read_the_callers_tensors_of_any_index_dtype_and_stride():
    """An inline step reads the caller's tensors as they are (not copied into the slot, as a
    worker's step is): int32 or int64, strided views, each way gives forward's rows."""
    layers = [make_embedding("bfloat16", "cpu", layer_index=i, seed=i) for i in range(2)]
    input_ids, qsl, context = make_batch([5, 0, 13, 1], "cpu", seed=7)
    strided_ids = torch.stack([input_ids, input_ids], dim=1)[:, 0]  # every other element
    strided_context = torch.stack([context, context], dim=2)[:, :, 0]
    assert not strided_ids.is_contiguous() and not strided_context.is_contiguous()
    batches = [
        (input_ids.to(torch.int32), qsl.to(torch.int64), context),
        (strided_ids, qsl, strided_context.to(torch.int32)),
    ]
    for inline in ("always", "never"):
        with StagedLookupPipeline(layers, max_tokens=32, inline=inline) as pipeline:
            for batch in batches:
                wants = [layer(*batch) for layer in layers]
                with pipeline.submit(*batch, timeout=WAIT) as step:
                    assert step._inline == (inline == "always")
                    for index in (0, 1):
                        same_bits(step.rows(index, timeout=WAIT), wants[index])


def test_a_batch_is_checked_against_every_ngram_size_of_the_pipeline():
    """submit checks the batch once per n-gram size, not per layer, yet against every size: a
    context too narrow for any one layer is refused, naming that layer's size, and nothing is
    started."""
    from types import SimpleNamespace

    from lookup_support import CONFIG
    from qwen4exp_ext.layers import NGramEmbedding

    four = SimpleNamespace(**{**vars(CONFIG), "ngram_size": 4})  # 6 heads of 4
    configs = {3: CONFIG, 4: four}
    batch = make_batch([5, 0, 13, 1], "cpu")  # a context [4, 2]: ngram_size 3's
    for order in ((3, 3, 4), (4, 3)):
        layers = [
            NGramEmbedding(configs[n], i, placement="cpu", dtype="bfloat16", max_tokens=32)
            for i, n in enumerate(order)
        ]
        with StagedLookupPipeline(layers, max_tokens=32) as pipeline:
            with pytest.raises(ValueError, match=r"\[4, 3\] .*ngram_size is 4\)"):
                pipeline.submit(*batch, timeout=WAIT)
            assert pipeline._submitted == 0 and pipeline._last is None


@pytest.mark.parametrize("failed", [0, 1])
def test_an_inline_step_that_raises_fails_its_rows_and_serves_the_next(failed):
    """A lookup that raises on the submitting thread fails its step as on the worker: submit
    returns, rows() of the failed layer and every later one raise it, the earlier layers have
    their rows, the next step is served, and nothing is left behind."""
    layers = slow_layers(2)
    batches = [make_batch([5, 0, 13, 1], "cpu", seed=s) for s in range(2)]
    wants = [[layer(*batch) for layer in layers] for batch in batches]
    with nothing_left_behind():
        with StagedLookupPipeline(layers, max_tokens=32, inline="always") as pipeline:
            layers[failed].failure = OSError("layer.table: pread failed: Input/output error")
            step = pipeline.submit(*batches[0], timeout=WAIT)
            assert step._inline
            for index in range(failed, 2):
                with pytest.raises(
                    RuntimeError,
                    match=f"StagedStep 0: no rows for layer {index}: the lookup of layer "
                    f"{failed} failed \\(OSError: layer.table: pread failed",
                ):
                    step.rows(index, timeout=WAIT)
            for index in range(failed):
                same_bits(step.rows(index, timeout=WAIT), wants[0][index])
            step.release()
            layers[failed].failure = None
            with pipeline.submit(*batches[1], timeout=WAIT) as step:
                for index in (0, 1):
                    same_bits(step.rows(index, timeout=WAIT), wants[1][index])
            pipeline.close(timeout=WAIT)
        assert not _workers()


def test_inline_waits_for_a_busy_worker_and_the_thread_count():
    """A step goes inline only while the worker is idle (the step before done) and with the
    submitter's own thread count: otherwise the worker runs it, in order."""
    layers = slow_layers(1)
    batches = [make_batch([13, 2], "cpu", seed=s) for s in range(3)]
    wants = [layers[0](*batch) for batch in batches]
    with StagedLookupPipeline(layers, max_tokens=32, inline="always") as pipeline:
        first = pipeline.submit(*batches[0], timeout=WAIT)
        first.release()
        layers[0].delay = 0.3
        pipeline.inline = "never"
        second = pipeline.submit(*batches[1], timeout=WAIT)  # the worker, busy for 0.3 s
        pipeline.inline = "always"
        third = pipeline.submit(*batches[2], timeout=WAIT)
        assert (first._inline, second._inline, third._inline) == (True, False, False)
        same_bits(second.rows(0, timeout=WAIT), wants[1])
        same_bits(third.rows(0, timeout=WAIT), wants[2])
        second.release()
        third.release()
        pipeline.close(timeout=WAIT)
    with StagedLookupPipeline(layers, max_tokens=32, inline="always", threads=1) as pipeline:
        before = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            with pipeline.submit(*batches[0], timeout=WAIT) as step:
                assert not step._inline  # the pipeline's own count: its worker's
                same_bits(step.rows(0, timeout=WAIT), wants[0])
        finally:
            torch.set_num_threads(before)
        pipeline.close(timeout=WAIT)


def _context_switches(thread: threading.Thread) -> int:
    """How often ``thread`` has given up its CPU to wait (/proc: voluntary context switches)."""
    with open(f"/proc/self/task/{thread.native_id}/status") as status:
        for line in status:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches in /proc")


def test_inline_steps_leave_the_idle_worker_asleep():
    """An inline step's layers and its release notify the consumers, not the worker: waking the
    idle worker for nothing cost each step ~100-200 us of futex wakes and GIL hand-offs (a
    T = 64 step of two small layers, submit to release: 159-294 us before, 67 us after, 2-core
    Zen 4 VM). Seen failing before: the worker woke at every layer and release."""
    layers = [make_embedding(torch.bfloat16, "cpu", seed=s) for s in range(2)]
    batch = make_batch([5, 3], "cpu")
    with StagedLookupPipeline(layers, max_tokens=32, inline="always") as pipeline:
        (worker,) = _workers()
        with pipeline.submit(*batch, timeout=WAIT) as step:
            assert step._inline
        time.sleep(0.05)  # the worker back in its wait, if anything woke it
        before = _context_switches(worker)
        for _ in range(50):
            with pipeline.submit(*batch, timeout=WAIT) as step:
                for index in (0, 1):
                    step.rows(index, timeout=WAIT)
        woken = _context_switches(worker) - before
        assert woken <= 2, f"the idle worker woke {woken} times for 50 inline steps"
        pipeline.close(timeout=WAIT)


def test_auto_runs_waited_for_steps_inline_and_overlapped_ones_on_the_worker():
    """``inline="auto"`` measures both ways per step size, then takes the cheaper for the
    consumer: for one that reads its rows at once the two differ by the hand-off only, a few
    microseconds either way on a loaded machine, so that this test checks the rule (measured
    first, then the lower median of the last costs, whichever it is); for one that works while
    the lookup runs (here: sleeps longer than the lookup) the worker costs nothing, so its
    steps stay there."""
    layers = slow_layers(2)
    batch = make_batch([5, 0, 13, 1], "cpu")
    wants = [layer(*batch) for layer in layers]
    with StagedLookupPipeline(layers, max_tokens=32) as pipeline:
        assert pipeline.inline == "auto"
        ways, expected = [], []
        for _ in range(20):
            costs = pipeline._costs.get(batch[0].numel().bit_length())
            worker, inline = (list(costs[0]), list(costs[1])) if costs else ([], [])
            if len(worker) < SAMPLES:
                expected.append(False)
            elif len(inline) < SAMPLES:
                expected.append(True)
            else:
                expected.append(statistics.median(inline) < statistics.median(worker))
            with pipeline.submit(*batch, timeout=WAIT) as step:
                ways.append(step._inline)
                for index in (0, 1):
                    same_bits(step.rows(index, timeout=WAIT), wants[index])
        assert ways[: 2 * SAMPLES] == [False] * SAMPLES + [True] * SAMPLES, ways
        assert ways == expected, (ways, expected)
        for layer in layers:
            layer.delay = 0.01
        ways = []
        tokens = make_batch([5, 0, 13, 1, 10], "cpu")  # another size: measured apart
        wants = [layer(*tokens) for layer in layers]
        for _ in range(12):
            with pipeline.submit(*tokens, timeout=WAIT) as step:
                ways.append(step._inline)
                time.sleep(0.1)  # the consumer's own work, while the worker looks up
                for index in (0, 1):
                    same_bits(step.rows(index, timeout=WAIT), wants[index])
        assert sum(ways) <= 3, ways  # at most the three steps that measure inline
        pipeline.close(timeout=WAIT)


def test_inline_is_checked():
    module = make_embedding("bfloat16", "cpu", max_tokens=8)
    with nothing_left_behind():
        with pytest.raises(ValueError, match="inline must be one of"):
            StagedLookupPipeline([module], max_tokens=8, inline="sometimes")
