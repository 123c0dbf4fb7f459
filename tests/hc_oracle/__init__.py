"""The hyper-connection ops' oracle (SPEC §10, python/qwen4exp_ext/reference_hc.py) against
vLLM's Triton kernels, seed 004's module math and transformers' Qwen4ExpTextGatedResidual. The
shared batches and vLLM runner are tests/hc_support.py."""
