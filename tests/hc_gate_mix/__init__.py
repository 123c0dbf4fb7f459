"""hc_gate_mix's tests (issue #50): kernels csrc/cpu/hc_mix.cpp and csrc/hip/hc_mix.hip, oracle
reference.hc_gate_mix."""
