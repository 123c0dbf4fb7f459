"""hc_down_silu_inject's tests (issue #50 item 3): kernels csrc/cpu/hc_fused.cpp and
csrc/hip/hc_fused.hip, oracle reference_hc.hc_down_silu_inject (hc_silu of F.linear, F.linear)."""
