"""hc_up_gate_mix's tests (issue #50 item 3): kernels csrc/cpu/hc_fused.cpp and
csrc/hip/hc_fused.hip, oracle reference_hc.hc_up_gate_mix (hc_gate_mix of F.linear)."""
