"""ple_conv's tests (SPEC §6): kernels csrc/cpu/ple_conv.cpp and csrc/hip/ple_conv.hip, oracle
reference.ple_conv, bench python/qwen4exp_ext/bench/ple_conv.py; support.py (batch builders),
test_kernel.py, test_properties.py, test_oracle.py, test_fuzz.py, bad_inputs.py and
test_bad_inputs.py."""
