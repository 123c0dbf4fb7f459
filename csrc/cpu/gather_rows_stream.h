// The streaming path of the CPU gather_rows (gather_rows_stream.cpp), which run_gather_rows_cpu
// (gather_rows.cpp) takes for outputs of at least cpu_gather_stream_bytes() bytes (that switch
// is declared in csrc/common/gather_rows.h with the op's other entry points).
#pragma once

#include <cstdint>

#include "../common/gather_rows.h"

namespace qwen4exp::cpu {

// Gathers `p` (T·NH·d > 0, a dtype pair run_gather_rows_cpu has a kernel for) on the streaming
// path; stream_bytes_from is cpu_gather_stream_bytes() (>= 0: this CPU has streaming stores).
void gather_rows_streaming(const GatherRowsParams& p, int64_t stream_bytes_from);

}  // namespace qwen4exp::cpu
