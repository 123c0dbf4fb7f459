"""``qwen4exp-bench``: time our kernels against what a user would run otherwise, side by side.

Each op contributes a module that builds its cases (``registry.OP_MODULES``, keyed by op name);
the CLI checks every case against the oracle (``reference.py``) and against its baselines (eager
transformers, ``torch.index_select``, ``F.conv1d``, vLLM's kernels), times ours, the baselines,
the oracle and a same-size copy in one interleaved loop at each requested thread count, and
reports quantiles, the speedup over the headline baseline and the fraction of copy bandwidth
reached, tagged with the device.
"""
