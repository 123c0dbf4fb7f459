"""hc_silu's tests (issue #50): kernels csrc/cpu/hc_mix.cpp and csrc/hip/hc_mix.hip, oracle
reference.hc_silu."""
