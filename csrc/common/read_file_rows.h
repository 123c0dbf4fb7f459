// read_file_rows: table rows read from a file (issue #39, the "direct" reader), the params struct
// and the torch-free host entry point (csrc/cpu/read_file_rows.cpp). Host code only: no kernel of
// any GPU or of the SIMT emulator reads a file.
//
// The file holds a table of fixed-size rows from global row 0: row `id` is the row_bytes bytes at
// data_offset + id·row_bytes. A call reads the rows of the ids this reader owns, [vocab_start,
// vocab_end), into output rows; every other id (-1, another shard's) gives an all-zero row and no
// read.
#pragma once

#include <cstdint>
#include <string>

#include "platform.h"

namespace qwen4exp {

// Every O_DIRECT read is aligned to this (offset, length and buffer address): a multiple of every
// common logical block size. Rows whose aligned spans share or touch a block of this size are
// read together.
constexpr int64_t kFileRowsBlock = 4096;
// A group of neighbouring rows is read in one pread of at most this many bytes (one row larger
// than this is still one read of its whole span).
constexpr int64_t kFileRowsMaxRead = int64_t{128} << 10;
// io_threads <= 0: this many reads in flight (the queue depth that random 4 KiB reads on NVMe
// need), never more than there are reads.
constexpr int64_t kFileRowsDefaultThreads = 32;

struct ReadFileRowsParams {
  // An open file descriptor, readable, with or without O_DIRECT (fcntl(F_GETFL) says which). The
  // caller owns it: it is never closed here.
  int fd;
  // num_ids ids, int32 or int64, id k at element k·ids_stride.
  const void* ids;
  int64_t ids_stride;
  bool ids_int64;
  int64_t num_ids;
  // Row `id` is the bytes [data_offset + id·row_bytes, + row_bytes) of the file. With O_DIRECT,
  // data_offset must be a multiple of kFileRowsBlock.
  int64_t data_offset;
  int64_t row_bytes;  // > 0
  // The ids read: vocab_start <= id < vocab_end (0 <= vocab_start <= vocab_end).
  int64_t vocab_start;
  int64_t vocab_end;
  // num_ids rows of row_bytes bytes, row k at byte k·output_row_stride (>= row_bytes: rows do
  // not overlap).
  uint8_t* output;
  int64_t output_row_stride;
  // Threads issuing preads at once; <= 0: kFileRowsDefaultThreads. Capped by the number of
  // reads; 1 reads on the calling thread.
  int64_t io_threads;
  // The file's name for messages (nullptr or "": "fd <fd>").
  const char* path;
};

// What a call ends with: ok(), or the first error, a message that starts "read_file_rows: ", and
// the errno behind it (0 when it is no system call's: a bad argument, a file that ends too soon).
struct ReadFileRowsStatus {
  std::string error;
  int errno_value = 0;
  bool ok() const { return error.empty(); }
};

// Reads the rows (see ReadFileRowsParams) and returns when every thread it started has ended.
// Checks the arguments, the fd (open, readable; with O_DIRECT the alignment of data_offset) and
// every owned id's offset (it must fit in int64) before reading anything; zeroes the rows of the
// ids it does not own; then sorts the owned rows by offset and reads each group of rows whose
// blocks share or touch in one pread (a row wanted twice is read once): without O_DIRECT those
// the page cache holds on the calling thread (RWF_NOWAIT), the rest from io_threads threads.
// A failed pread (EINTR is retried) or a file that ends before an owned row's end is an error;
// then the output rows are unspecified. Never throws for I/O; std::bad_alloc may escape.
QWEN4EXP_API ReadFileRowsStatus run_read_file_rows_cpu(const ReadFileRowsParams& p);

}  // namespace qwen4exp
