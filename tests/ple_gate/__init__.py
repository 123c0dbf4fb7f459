"""ple_gate's tests (SPEC §5): kernels csrc/cpu/ple_gate.cpp and csrc/hip/ple_gate.hip, oracle
reference.ple_gate, bench python/qwen4exp_ext/bench/ple_gate.py."""
