"""ngram_ids' tests (SPEC §3): kernels csrc/cpu/ngram_ids.cpp and csrc/hip/ngram_ids.hip, oracle
reference.ngram_ids, bench python/qwen4exp_ext/bench/ngram_ids.py; support.py (layouts, batch
builders), test_kernel.py, test_properties.py, test_oracle.py, test_fuzz.py, bad_inputs.py and
test_bad_inputs.py."""
