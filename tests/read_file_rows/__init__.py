"""read_file_rows (ops.read_file_rows, the O_DIRECT reader of tables in a file): kernel
csrc/cpu/read_file_rows.cpp, oracle numpy's read of the same file (no reference.py op); bench:
host_lookup's staged_direct cases (python/qwen4exp_ext/bench/staged_lookup.py)."""
