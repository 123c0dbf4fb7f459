"""grouped_gemma_rmsnorm's tests (issue #50): kernels csrc/cpu/hc_norm.cpp and
csrc/hip/hc_norm.hip, oracle reference.grouped_gemma_rmsnorm."""
