"""``qwen4exp-bench``: time our kernels against the eager reference, side by side.

Each op contributes a module that builds its cases (``registry.OP_MODULES``); the CLI checks every
case against the reference, times ours, the reference and a same-size copy in one interleaved loop,
and reports quantiles, speedup and the fraction of copy bandwidth reached, tagged with the device.
"""
