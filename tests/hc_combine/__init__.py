"""hc_combine's tests (issue #50): kernels csrc/cpu/hc_norm.cpp (the combine without its norm) and
csrc/hip/hc_mix.hip, oracle reference.hc_combine."""
