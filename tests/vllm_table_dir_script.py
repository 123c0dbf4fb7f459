"""The vLLM side of tests/test_vllm_table_dir.py, run in a fresh interpreter (vLLM's distributed
state and the plugin are process-global): ``python vllm_table_dir_script.py CASE_JSON OUT``.

It builds vLLM's own Qwen4Exp n-gram embeddings (the NVIDIA ``Qwen4ExpNGramEmbedding`` and the
AMD one of ``amd.ple_layer``, device placement, on the CPU) for one PLE layer of a model
directory written by ``model_checkpoint.write_model``, loads the layer's checkpoint tensors
through vLLM's own safetensors iterator, and looks up every row of the table. Modes (the case's
``mode``):

- ``lookup``: one run per case ``runs`` entry (``table_dir`` or not, which checkpoint files);
  writes each run's rows, where the table lives (/proc/self/maps), and what the loader skipped.
- ``etp``: ``world`` gloo ranks (torch.multiprocessing, forked), tensor (= ETP) parallel; each
  rank maps its shard of the table file and writes its all-reduced rows and its mapping.
- ``bad``: each bad case built inside ``leak_support.nothing_left_behind``; writes the messages.
- ``share``: one process of a node: builds and loads the table-directory embedding, looks every
  row up (every page of its rows mapped here), prints ``ready <weight address> <bytes> <the
  file mapped there>`` and waits for a line on stdin (the test reads this process's smaps
  meanwhile), then prints ``closed``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import traceback
from types import SimpleNamespace

os.environ["VLLM_PLUGINS"] = "qwen4exp"
import torch  # noqa: E402
import vllm.plugins  # noqa: E402

vllm.plugins.load_general_plugins()  # as every vLLM process does: only our plugin

from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import init_distributed_environment, initialize_model_parallel  # noqa: E402
from vllm.model_executor.model_loader.weight_utils import (  # noqa: E402
    filter_safetensors_files_by_weight_name,
    safetensors_weights_iterator,
)
from vllm.models.qwen4_exp.amd.model import Qwen4ExpForCausalLM  # noqa: E402
from vllm.models.qwen4_exp.amd.ple_layer import (  # noqa: E402
    Qwen4ExpNGramEmbedding as AmdNGramEmbedding,
)
from vllm.models.qwen4_exp.nvidia.ngram_embedding import (  # noqa: E402
    Qwen4ExpNGramEmbedding as NvidiaNGramEmbedding,
)

from qwen4exp_ext.vllm import table_dir  # noqa: E402

ENV = "QWEN4EXP_VLLM_TABLE_DIR"


def vllm_config(directory: str | None, tp: int = 1) -> VllmConfig:
    additional = {} if directory is None else {table_dir.ADDITIONAL_CONFIG_KEY: directory}
    config = VllmConfig(device_config=DeviceConfig("cpu"), additional_config=additional)
    config.parallel_config.tensor_parallel_size = tp
    return config


def init_dist(store: str, rank: int = 0, world: int = 1) -> None:
    with set_current_vllm_config(vllm_config(None, world)):
        init_distributed_environment(world, rank, "file://" + store, rank, "gloo")
        initialize_model_parallel(world, 1)


def text_config(case: dict) -> SimpleNamespace:
    return SimpleNamespace(**case["config"])


def build(case: dict, cls: str, directory: str | None, tp: int = 1, disk_offload: bool = False):
    """vLLM's n-gram embedding of the case's layer, built as vLLM builds it (``disk_offload``:
    vLLM 0.34's disk-offloaded table, as its EngramConfig would choose it)."""
    config = text_config(case)
    prefix = case["prefix"].removesuffix(".")
    current = vllm_config(directory, tp)
    if disk_offload:  # vLLM's own check of the setting wants CUDA; its class builds on the CPU
        engram = SimpleNamespace(disk_offload=True, cpu_offload=False)
        object.__setattr__(current, "engram_config", engram)
    with set_current_vllm_config(current), torch.device("cpu"):
        if cls == "nvidia":
            return NvidiaNGramEmbedding(
                config,
                config.ple_embed_dim,
                case["layer"],
                64,
                data_parallel_rank=0,
                prefix=prefix,
                params_dtype=torch.bfloat16,
            )
        return AmdNGramEmbedding(
            config,
            config.ple_embed_dim,
            case["layer"],
            64,
            prefix,
            prefix,
            params_dtype=torch.bfloat16,
        )


def checkpoint(case: dict, files: list[str]):
    """The layer's tensors (names after its prefix) from vLLM's own safetensors iterator."""
    prefix = case["prefix"]
    for name, tensor in safetensors_weights_iterator(files, False):
        if name.startswith(prefix):
            yield name[len(prefix) :], tensor


def mapping_of(address: int) -> dict:
    """The /proc/self/maps line holding ``address``: its file, size and permissions."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                path = fields[5].strip() if len(fields) == 6 else ""
                return {"path": path, "bytes": high - low, "perms": fields[1]}
    return {"path": None, "bytes": 0, "perms": ""}


def lookup(embedding, case: dict) -> torch.Tensor:
    """Every row of the table, each once, through vLLM's embedding (its forward: the lookup,
    the vocabulary masking and the ETP all-reduce)."""
    heads = embedding.ngram_heads
    ids = torch.randperm(case["rows"], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return embedding.ngram_embedding(ids.view(-1, heads)).clone()


def where_table_lives(embedding) -> dict:
    layer = embedding.ngram_embedding
    found = {"weight": mapping_of(layer.weight.data_ptr())}
    if layer.weight.dtype == torch.uint8:  # NVFP4: the block scales too
        found["weight_scale"] = mapping_of(layer.weight_scale.data_ptr())
    return found


class WarningLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run_lookup(case: dict, out: str) -> None:
    init_dist(case["store"])
    warnings = WarningLog()
    logging.getLogger("vllm.qwen4exp_ext").addHandler(warnings)
    results = []
    for run in case["runs"]:
        os.environ.pop(ENV, None)
        if "env" in run:
            os.environ[ENV] = run["env"]
        embedding = build(case, run["cls"], run["table_dir"])
        if "env" in run:  # a second build: a bad value is still said once only
            build(case, run["cls"], run["table_dir"])
        loaded = embedding.load_weights(checkpoint(case, run["files"]))
        table = table_dir.layer_table(embedding)
        result = {
            "cls": run["cls"],
            "table_dir": run["table_dir"],
            "rows": lookup(embedding, case),
            "loaded": sorted(loaded),
            "where": where_table_lives(embedding),
            "skipped": [] if table is None else list(table.skipped),
            "warnings": list(warnings.messages),
        }
        if "env" in run:
            result["env"] = run["env"]
        if table is not None:  # vLLM's file filter, given the skip hook the plugin added
            model = torch.nn.ModuleDict({"ple": embedding})  # the hook looks through modules()
            hook = functools.partial(Qwen4ExpForCausalLM.is_unused_checkpoint_weight, model)
            result["files_kept"] = filter_safetensors_files_by_weight_name(run["files"], hook)
            del model, hook
        results.append(result)
        del embedding, table
    torch.save(results, out)


def etp_rank(rank: int, case: dict, out: str) -> None:
    world = case["world"]
    init_dist(case["store"], rank, world)
    embedding = build(case, case["cls"], case["table_dir"], tp=world)
    embedding.load_weights(checkpoint(case, case["files"]))
    layer = embedding.ngram_embedding
    shard = layer.shard_indices
    torch.save(
        {
            "rows": lookup(embedding, case),
            "where": where_table_lives(embedding),
            "shard": [shard.org_vocab_start_index, shard.org_vocab_end_index],
            "table_rows": layer.weight.shape[0],
        },
        f"{out}.{rank}",
    )


def run_etp(case: dict, out: str) -> None:
    import torch.multiprocessing as mp

    # Forked, as vLLM starts its own workers where CUDA is not initialised (its default): each
    # rank starts with this process's imports instead of importing torch and vLLM afresh.
    mp.start_processes(etp_rank, args=(case, out), nprocs=case["world"], start_method="fork")


def run_bad(case: dict, out: str) -> None:
    sys.path.insert(0, case["tests"])
    from leak_support import nothing_left_behind

    init_dist(case["store"])
    # vLLM's iterator starts tqdm's monitor thread and lock once per process: not ours to count.
    for _ in checkpoint(case, case["bad"][0]["files"]):
        pass

    def attempt(bad: dict) -> str | None:
        """The error of building and loading the bad case (the model freed when it returns)."""
        try:
            embedding = build(
                {**case, "config": bad["config"]},
                bad["cls"],
                bad["table_dir"],
                disk_offload=bad.get("disk_offload", False),
            )
            embedding.load_weights(checkpoint(case, bad["files"]))
        except Exception as error:  # noqa: BLE001 - what the test checks
            return f"{type(error).__name__}: {error}"
        return None

    messages = {}
    for bad in case["bad"]:
        try:
            with nothing_left_behind(bad["table_dir"]):
                messages[bad["name"]] = attempt(bad)
        except AssertionError as leak:
            messages[bad["name"]] = f"LEAK {leak}"
    torch.save(messages, out)


def run_share(case: dict, out: str) -> None:
    init_dist(case["store"])
    embedding = build(case, case["cls"], case["table_dir"])
    embedding.load_weights(checkpoint(case, case["files"]))
    rows = lookup(embedding, case)
    torch.save(rows, out)
    weight = embedding.ngram_embedding.weight
    nbytes = weight.numel() * weight.element_size()
    where = mapping_of(weight.data_ptr())["path"]
    print(f"ready {weight.data_ptr()} {nbytes} {where}", flush=True)
    sys.stdin.readline()  # until the test has read this process's smaps (or closes stdin)
    del embedding, weight
    print("closed", flush=True)


if __name__ == "__main__":
    case = json.loads(open(sys.argv[1]).read())
    modes = {"lookup": run_lookup, "etp": run_etp, "bad": run_bad, "share": run_share}
    try:
        modes[case["mode"]](case, sys.argv[2])
    except BaseException:
        traceback.print_exc()
        raise
    print("ok")
