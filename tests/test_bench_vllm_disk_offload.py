"""The ``vllm_disk_offload`` bench row (``qwen4exp_ext.bench.vllm_disk_offload``), run at a tiny
size in a fresh interpreter (it imports vLLM and initialises its process groups): vLLM 0.34.0's
own disk_offload staging against ours. Its case names and selection are in test_bench.py's
tables, with every other op's."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_support import require_vllm, run_python, vllm_version

_DISK_OFFLOAD_RUN = r"""
import json, os, sys
from qwen4exp_ext.bench import vllm_disk_offload as bench
from qwen4exp_ext.bench.cli import main
bench.TABLE_ROWS, bench.PREFILL_TOKENS = 4090, 24  # tiny: 512 shards of 8 rows, the last 2
code = main(["vllm_disk_offload", "--quick", "--threads", "1", "--json", os.environ["REPORT"]])
print(json.dumps({"code": code}))
"""


@require_vllm()
def test_vllm_disk_offload_row_races_vllm_s_staging(tmp_path: Path) -> None:
    """The vllm_disk_offload row at a tiny size: vLLM 0.34.0's own disk_offload staging against
    ours (the plugin's stage_rows) from one safetensors checkpoint, warm and cold, each case
    checked (ours, vLLM's and the file's rows equal) and timed, naming the disk and vLLM's
    speedup; where vLLM has no disk_offload (0.33.0), no case, and the section says why."""
    report = tmp_path / "report.json"
    env = {"REPORT": str(report), "QWEN4EXP_BENCH_TABLE_DIR": str(tmp_path)}
    out = run_python(_DISK_OFFLOAD_RUN, env=env)
    code = json.loads(out.strip().splitlines()[-1])["code"]
    if vllm_version() == "0.33.0":
        assert code == 2 and "disk_offload is 0.34.0 on" in out, out
        return
    assert code == 0, out
    found = json.loads(report.read_text())
    assert found["complete"] is True and found["check_failures"] == []
    names = [r["case"] for r in found["results"]]
    assert names == [
        f"stage_{p}_bf16_{s}" for p in ("decode_T64", "prefill_T24") for s in ("warm", "cold")
    ]
    for result in found["results"]:
        assert result["check"] is True and result["vllm_baseline"] == "vllm_staging"
        assert result["speedup_vs_vllm"] > 0 and result["baseline"] == "vllm_staging"
        assert result["params"]["disk"] and result["params"]["checkpoint_shards"] == 512
    assert found["cpu"]["model_name"]  # the CPU, as every report names it
    (disk,) = [s for s in found["sections"] if s["name"] == "disk"]
    assert disk["rows"][0]["disk"] == result["params"]["disk"]
    assert list(tmp_path.iterdir()) == [report]  # the checkpoint went with its readers
