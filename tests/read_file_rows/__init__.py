"""read_file_rows (ops.read_file_rows, the O_DIRECT reader of tables in a file): kernel
csrc/cpu/read_file_rows.cpp, oracle numpy's read of the same file (no reference.py op, no bench)."""
