// The streaming path of the CPU gather_rows (gather_rows_stream.cpp), which run_gather_rows_cpu
// (gather_rows.cpp) takes where the timing or a setting picks it (those switches are declared in
// csrc/common/gather_rows.h with the op's other entry points).
#pragma once

#include <cstdint>

#include "../common/gather_rows.h"

namespace qwen4exp::cpu {

// Gathers `p` (T·NH·d > 0, a dtype pair run_gather_rows_cpu has a kernel for) on the streaming
// path (has_streaming_path() must hold); cache_bytes is what this process's threads together
// keep in cache (a block whose distinct rows fit in a thread's share is copied unsorted).
void gather_rows_streaming(const GatherRowsParams& p, int64_t cache_bytes);

// Whether this CPU and build have the streaming path (x86-64 with AVX: streaming stores).
bool has_streaming_path();
// set_cpu_gather_stream_bytes's setting: a threshold >= 0, or -1 (none: the timed default).
int64_t stream_bytes_setting_now();
// What this process's threads can keep in cache: per thread its core's L2 and its share of the
// L3 (cache_share). Outputs of at least this size are the large gathers whose path is timed.
int64_t cached_output_bytes();

}  // namespace qwen4exp::cpu
