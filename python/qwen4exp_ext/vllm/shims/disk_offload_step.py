"""vLLM 0.34.0's PLE ``disk_offload``, a step at a time: the step's reads started early, and
FP8/NVFP4 rows decoded on the host where that measured faster (:mod:`.disk_offload` has the
read itself).

**Starting early.** vLLM's ``stage_checkpoint_rows(modules, input_ids, query_start_loc,
ngram_context)`` (``nvidia/ngram_embedding.py``, called from ``prepare_inputs``) hashes every
layer's ids, syncs the stream once, then reads each layer's rows in turn before it returns: the
model starts only after the last layer's read. Ours hashes and syncs as vLLM does, checks every
id (vLLM's ``IndexError``, where vLLM raises it), hands every layer's reads, in layer order, to
one worker thread and returns; the forward's ``staged_rows`` (swapped too) waits for its own
layer only, then copies its rows to vLLM's staging buffer as vLLM did, so that layer 0's
compute overlaps the reads of every later layer. A read that failed raises its error there.

What must stay true, and how:

- *The pinned host buffer is not rewritten while a copy from it is in flight.* vLLM writes it
  only after the step's stream sync (so after the previous step's H2D). Ours writes a step's rows
  into one of two host buffer sets (vLLM's and a twin), alternating, and before a worker writes
  a set it waits for the event recorded after the last copy out of it; the next step's worker
  starts only after this step's has finished (the ids buffer, vLLM's, is reused per step).
- *CUDA-graph replay.* The wait and the copy are Python in the forward; a replayed graph runs
  no Python. So the early start is taken only where the forward runs eagerly every step (the
  current vLLM config compiles nothing and captures no graph, as ``enforce_eager`` makes it;
  on the CPU the same); anywhere else every layer is staged before ``stage_checkpoint_rows``
  returns, as vLLM does, into vLLM's own buffers (fixed addresses), through our reader.

**Decoding on the host.** vLLM stages raw rows (FP8 bytes; NVFP4 packed bytes and block scales)
and decodes them on the device (FP8: the method's ``dequantize``; NVFP4: ``decode_rows``, its
Triton kernel). Where :mod:`..choice` chose ours for the class (op ``disk_offload_rows``: the
table format, width and token bucket; on the CPU always ours), the worker decodes the rows
with our CPU gather into activation-dtype rows (vLLM's values: FP8 ``row.to(out) *
scale.to(out)``, NVFP4 with its kernel's rounding), and the forward copies those into a
device buffer of the activation dtype; FP8's ``dequantize`` then only casts them (lookup.py).
Host decoding, like the early start, needs the eager forward. A class not yet chosen stages
raw rows that step and is measured in the forward, on the step's own rows: our decode and
copy against vLLM's copy and device decode.

This module imports neither vLLM nor anything that does: the plugin hands it vLLM's objects.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ... import ops
from .. import choice
from ..choice import OURS, token_bucket
from .base import PLE_OPS_MODULE
from .disk_offload import _stage_plane
from .ple import step_context

# The choice op of a disk-offloaded layer's FP8/NVFP4 rows: decoded on the host (ours) or on
# the device (vLLM's).
DECODE_OP = "disk_offload_rows"
# The attribute of vLLM's disk-offloaded layer that holds its step state (:class:`_Staging`).
_STATE_ATTR = "_qwen4exp_staging"

_FP8 = torch.float8_e4m3fn


@dataclass
class _Job:
    """One layer's reads of one step, run by the step's worker."""

    staging: _Staging
    num_tokens: int
    buffer: int  # which host buffer set
    decode: bool  # decoded on the host into the set's decoded rows
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class _Staging:
    """The step state of one disk-offloaded layer: two host buffer sets (set 0 is vLLM's own
    pinned buffers), the event of the last copy out of each, the decoded rows' buffers (made
    at the first host decode), and the job whose rows the forward takes next."""

    def __init__(self, layer: Any) -> None:
        self.layer = layer
        pin = any(host.is_pinned() for _, host, _ in layer._planes.values())
        self.pin = pin
        twin = {
            name: torch.empty_like(host, pin_memory=pin)
            for name, (_, host, _) in layer._planes.items()
        }
        self.hosts: list[dict[str, torch.Tensor]] = [
            {name: host for name, (_, host, _) in layer._planes.items()},
            twin,
        ]
        self.copied: list[Any] = [None, None]  # a CUDA event per set, or None (nothing pending)
        self.turn = 0
        self.pending: _Job | None = None
        self.decoded: list[torch.Tensor] | None = None  # host rows, per set
        self.decoded_device: torch.Tensor | None = None
        self.nvfp4 = "weight_scale" in layer._planes
        self.fp8 = layer._planes["weight"][0].dtype == _FP8
        self._scale: torch.Tensor | None = None

    # ---- host decoding ----

    @property
    def quantized(self) -> bool:
        return self.fp8 or self.nvfp4

    def decode_class(self, num_tokens: int) -> tuple:
        weight = self.layer._planes["weight"][0]
        fmt = "nvfp4" if self.nvfp4 else str(weight.dtype)
        return (fmt, self.layer.params_dtype, weight.shape[-1], token_bucket(num_tokens))

    def decoded_buffers(self) -> None:
        """The decoded rows' host buffers (one per set) and device buffer, made once, outside
        any graph (NVFP4's device buffer is vLLM's own ``_output``)."""
        if self.decoded is not None:
            return
        staging = self.layer._planes["weight"][0]
        width = self.layer.embedding_dim
        shape, dtype = (*staging.shape[:2], width), self.layer.params_dtype
        self.decoded = [torch.empty(shape, dtype=dtype, pin_memory=self.pin) for _ in range(2)]
        self.decoded_device = (
            self.layer._output
            if self.nvfp4
            else torch.zeros(shape, dtype=dtype, device=staging.device)
        )

    def host_scales(self) -> torch.Tensor:
        """The global scale (FP8's ``weight_scale``, NVFP4's ``weight_scale_2``) on the host,
        fp32 [1]; read once (vLLM binds the files after loading the scales, and refuses a
        reload)."""
        if self._scale is None:
            name = "weight_scale_2" if self.nvfp4 else "weight_scale"
            self._scale = getattr(self.layer, name).detach().to("cpu", torch.float32).reshape(1)
        return self._scale

    def decode_on_host(self, raw: dict[str, torch.Tensor], out: torch.Tensor, n: int) -> None:
        """The raw rows of the first ``n`` tokens in host planes ``raw`` decoded into ``out``
        (activation dtype, [tokens, heads, width]) by our CPU gather."""
        table = raw["weight"][:n].flatten(0, 1)
        ids = torch.arange(table.shape[0], dtype=torch.int64).reshape(-1, 1)
        kwargs: dict[str, Any] = {"scale": self.host_scales()}
        if self.nvfp4:
            kwargs["block_scales"] = raw["weight_scale"][:n].flatten(0, 1)
        ops.gather_rows(table, ids, output=out[:n].flatten(0, 1), **kwargs)


def _staging(layer: Any) -> _Staging:
    state = layer.__dict__.get(_STATE_ATTR)
    if state is None:
        state = _Staging(layer)
        layer.__dict__[_STATE_ATTR] = state
    return state


def _wait_copied(staging: _Staging, buffer: int) -> None:
    """Blocks until the last copy out of host set ``buffer`` has read it."""
    event = staging.copied[buffer]
    if event is not None:
        event.synchronize()
        staging.copied[buffer] = None


def _read_job(job: _Job) -> None:
    """One layer's rows of the step into its host set (and decoded, where chosen)."""
    staging, n = job.staging, job.num_tokens
    layer = staging.layer
    _wait_copied(staging, job.buffer)
    ids = layer._host_ids[:n].flatten()
    for name, (_, _, rows) in layer._planes.items():
        out = staging.hosts[job.buffer][name][:n].flatten(0, 1).view(torch.uint8)
        _stage_plane(layer, name, ids, out, rows)
    if job.decode:
        assert staging.decoded is not None
        staging.decode_on_host(staging.hosts[job.buffer], staging.decoded[job.buffer], n)


def _run_jobs(jobs: Sequence[_Job]) -> None:
    for job in jobs:
        try:
            _read_job(job)
        except BaseException as exc:  # noqa: BLE001 - raised again where the rows are taken
            job.error = exc
        finally:
            job.done.set()


# The worker of the last early-started step (joined before the next step reuses vLLM's ids
# buffer, and by :func:`join_worker`).
_worker: threading.Thread | None = None
_worker_lock = threading.Lock()


def join_worker() -> None:
    """Waits for the last step's reads to finish (they write buffers the next step reuses)."""
    global _worker
    with _worker_lock:
        worker, _worker = _worker, None
    if worker is not None:
        worker.join()


def _forward_runs_eagerly(config: Any = None) -> bool:
    """Whether vLLM's ``config`` (None: the current one) runs the model's forward as eager
    Python every step (no torch.compile, no CUDA graph): only then do the forward's waits and
    copies run. No config known: not eager."""
    if config is None:
        try:
            config = importlib.import_module("vllm.config").get_current_vllm_config_or_none()
        except (ImportError, AttributeError):
            return False
    compilation = getattr(config, "compilation_config", None)
    if compilation is None:
        return False
    mode = getattr(compilation, "mode", None)
    graphs = getattr(compilation, "cudagraph_mode", None)
    return int(mode or 0) == 0 and (graphs is None or getattr(graphs, "name", "") == "NONE")


def _check_ids(layer: Any, num_tokens: int) -> None:
    ids = layer._host_ids[:num_tokens]
    if ids.numel():
        low, high = torch.aminmax(ids)
        if not 0 <= int(low) <= int(high) < layer.org_vocab_size:
            raise IndexError(f"PLE id out of range for {layer.org_vocab_size} rows")


def _decode_choice(staging: _Staging, num_tokens: int) -> bool | None:
    """Whether this step's rows of ``staging`` are decoded on the host: True or False where
    the choice is made, None where it is still to be measured (raw rows, measured in the
    forward)."""
    if not staging.quantized or not staging.layer._fds:
        return False
    device = staging.layer._planes["weight"][0].device
    which = choice.choose(DECODE_OP, staging.decode_class(num_tokens), device)
    return None if which is None else which == OURS


def stage_step(
    modules: Sequence[tuple[Any, Any]],
    input_ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    ngram_context: torch.Tensor,
    ngram_ids: Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    config: Any = None,
) -> None:
    """One step's rows of every ``(module, disk-offloaded layer)``: the ids hashed by
    ``ngram_ids(module, input_ids, query_start_loc, ngram_context)`` and copied to the host,
    one stream sync, then (the forward of vLLM's ``config`` eager, :func:`_forward_runs_eagerly`)
    the reads handed to a worker, or (else) every layer staged now, as vLLM does."""
    global _worker
    join_worker()  # the last step's worker reads vLLM's ids buffer, rewritten below
    num_tokens = input_ids.shape[0]
    for module, layer in modules:
        layer.copy_ids_to_host(ngram_ids(module, input_ids, query_start_loc, ngram_context))
    if input_ids.device.type != "cpu":
        _sync_stream()
    if not _forward_runs_eagerly(config):
        for _, layer in modules:
            state = layer.__dict__.get(_STATE_ATTR)
            if state is not None:
                state.pending = None
            layer.stage_rows(num_tokens)
        return
    jobs: list[_Job] = []
    for _, layer in modules:
        _check_ids(layer, num_tokens)
    for _, layer in modules:
        if not layer._fds:  # nothing bound (load_format="dummy"): vLLM's zero rows, now
            layer.stage_rows(num_tokens)
            continue
        staging = _staging(layer)
        decode = bool(_decode_choice(staging, num_tokens))
        if decode:
            staging.decoded_buffers()
            staging.host_scales()
        job = _Job(staging, num_tokens, staging.turn, decode)
        staging.turn ^= 1
        staging.pending = job
        jobs.append(job)
    if jobs:
        worker = threading.Thread(target=_run_jobs, args=(jobs,), name="qwen4exp-disk-offload")
        with _worker_lock:
            _worker = worker
        worker.start()


def _sync_stream() -> None:
    """vLLM's one sync of the step (under its ``gpu_sync_allowed``, which its sync debugging
    checks)."""
    try:
        allowed = importlib.import_module("vllm.utils.gpu_sync_debug").gpu_sync_allowed
    except (ImportError, AttributeError):
        torch.accelerator.current_stream().synchronize()
        return
    with allowed():
        torch.accelerator.current_stream().synchronize()


def _copy_to_device(staging: _Staging, job: _Job) -> torch.Tensor | None:
    """The job's rows into vLLM's staging buffers (raw) or our decoded device buffer, on the
    current stream; the event after it guards the host set. Returns the decoded rows, or None
    (raw: vLLM's ``staged_rows`` takes them from its staging buffers)."""
    n, layer = job.num_tokens, staging.layer
    if job.decode:
        assert staging.decoded is not None and staging.decoded_device is not None
        staging.decoded_device[:n].copy_(staging.decoded[job.buffer][:n], non_blocking=True)
    else:
        for name, (device_rows, _, _) in layer._planes.items():
            device_rows[:n].copy_(staging.hosts[job.buffer][name][:n], non_blocking=True)
    device = layer._planes["weight"][0].device
    if device.type == "cuda":
        event = torch.cuda.Event()
        event.record()
        staging.copied[job.buffer] = event
    return staging.decoded_device if job.decode else None


def _measure(staging: _Staging, job: _Job, original: Callable[..., torch.Tensor]) -> None:
    """The first step of a class (raw rows staged): our host decode and copy timed against
    vLLM's copy and device decode, on this step's rows, into scratch outputs."""
    n, layer = job.num_tokens, staging.layer
    staging.decoded_buffers()
    spare = job.buffer ^ 1
    _wait_copied(staging, spare)  # the spare set's decoded rows are scratch now

    def ours(_: Any) -> None:
        assert staging.decoded is not None and staging.decoded_device is not None
        out = staging.decoded[spare]
        staging.decode_on_host(staging.hosts[job.buffer], out, n)
        staging.decoded_device[:n].copy_(out[:n], non_blocking=True)

    def vllms(_: Any) -> None:
        original(layer, n)

    choice.decide(
        DECODE_OP,
        staging.decode_class(n),
        layer._planes["weight"][0].device,
        lambda: None,
        ours,
        vllms,
    )


def _make_staged_rows(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``Qwen4ExpPLEDiskOffloadEmbedding.staged_rows(self, num_tokens)``: waits for this
    layer's early-started read (if any), copies its rows to the device, then returns vLLM's
    staged rows, or ours decoded on the host."""

    def staged_rows(self: Any, num_tokens: int) -> torch.Tensor:
        staging = self.__dict__.get(_STATE_ATTR)
        job = staging.pending if staging is not None else None
        if job is None or torch.compiler.is_compiling():
            return original(self, num_tokens)
        staging.pending = None
        job.done.wait()
        if job.error is not None:
            raise job.error
        decoded = _copy_to_device(staging, job)
        if decoded is not None:
            return decoded[:num_tokens].flatten(-2)
        if staging.quantized and _decode_choice(staging, job.num_tokens) is None:
            _measure(staging, job, original)
        return original(self, num_tokens)

    return staged_rows


def _make_stage_checkpoint_rows(original: Callable[..., None]) -> Callable[..., None]:
    """``stage_checkpoint_rows(modules, input_ids, query_start_loc, ngram_context)`` of
    vLLM's NVIDIA n-gram embedding: :func:`stage_step`, the ids hashed by each module's own
    ``compute_ngram_ids`` as vLLM does."""
    del original

    def stage_checkpoint_rows(
        modules: list[tuple[Any, Any]],
        input_ids: torch.Tensor,
        query_start_loc: torch.Tensor,
        ngram_context: torch.Tensor,
    ) -> None:
        stage_step(
            modules,
            input_ids,
            query_start_loc,
            ngram_context,
            lambda module, *args: module.compute_ngram_ids(*args),
        )

    return stage_checkpoint_rows


def amd_ngram_ids(
    module: Any, input_ids: torch.Tensor, query_start_loc: torch.Tensor, ngram_context: Any
) -> torch.Tensor:
    """The ids of vLLM's AMD ``Qwen4ExpNGramEmbedding`` (which has no ``compute_ngram_ids``):
    ``ple_ngram_ids`` of vLLM's PLE ops (ours through the plugin) over the module's buffers,
    as its ``qwen4_exp_amd_ple_ngram_ids`` op hashes them in the forward. vLLM's model state
    hands over its whole context buffer (a row per possible request): :func:`.ple.step_context`
    keeps the rows of this step's requests."""
    ple_ops = importlib.import_module(PLE_OPS_MODULE)
    input_ids = input_ids.reshape(-1)
    ngram_context = step_context(query_start_loc, ngram_context)
    output = input_ids.new_empty((input_ids.shape[0], module.ngram_heads), dtype=torch.int64)
    ple_ops.ple_ngram_ids(
        input_ids=input_ids,
        query_start_loc=query_start_loc,
        ngram_context=ngram_context,
        layer_multipliers=module.layer_multipliers,
        ngram_heads_vocab_sizes=module.ngram_heads_vocab_sizes,
        ngram_heads_offsets=module.ngram_heads_offsets,
        eos_token_id=module.eos_token_id,
        heads_per_ngram=module.heads_per_ngram,
        output=output,
    )
    return output
