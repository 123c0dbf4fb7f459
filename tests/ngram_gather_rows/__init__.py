"""ngram_gather_rows' tests (ngram_ids, SPEC §3, then gather_rows, SPEC §4, as one op): kernels
csrc/cpu/ngram_gather_rows.cpp and the fused HIP kernel in csrc/hip/gather_rows.hip (glue
csrc/common/ngram_gather_rows.h), oracle reference.ngram_ids then reference.gather_rows, bench
python/qwen4exp_ext/bench/ngram_gather_rows.py; support.py (batch builders), test_kernel.py,
bad_inputs.py (its cases, derived from ngram_ids') and test_bad_inputs.py."""
