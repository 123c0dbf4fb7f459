"""gather_rows (SPEC §4): kernels csrc/cpu/gather_rows*.cpp, csrc/cpu/row_convert.cpp and
csrc/hip/gather_rows.hip; oracle reference.gather_rows; bench
python/qwen4exp_ext/bench/gather_rows.py."""
