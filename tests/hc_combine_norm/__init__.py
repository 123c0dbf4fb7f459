"""hc_combine_norm's tests (issue #50): kernels csrc/cpu/hc_norm.cpp and csrc/hip/hc_norm.hip,
oracle reference.hc_combine_norm."""
