"""``python -m qwen4exp_ext.bench``: the same entry point as the ``qwen4exp-bench`` script."""

from qwen4exp_ext.bench.cli import main

raise SystemExit(main())
