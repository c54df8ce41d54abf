#pragma once

// Internal: the flight recorder, as a GroupImpl that wraps a backend's (Note
// [Flight recorder] in src/comm/flight_recorder.cpp). It only records: the
// check before each collective is src/comm/collective_check.h's.

#include <lockstep/backend.h>

#include <memory>
#include <string>

namespace lockstep {
namespace detail {

/// `impl` with every collective recorded (the last $LOCKSTEP_TRACE_BUFFER_SIZE,
/// default kDefaultTraceBufferSize); `impl` itself where that is 0.
std::shared_ptr<GroupImpl> recorded(std::shared_ptr<GroupImpl> impl);

/// Writes every group's record of this process: a summary to stderr, and the
/// whole record as JSON to $LOCKSTEP_TRACE_DIR/lockstep_trace_rank<R>.json
/// when that is set, R being set_process_rank's rank (else the first live
/// group's). The summary shows the group whose collective failed. Written
/// anew at a failure after a collective has completed since the last
/// (Note [Every failure dumps] in src/comm/flight_recorder.cpp).
/// Installed as a before_abort hook (src/comm/before_abort.h) for paths that end
/// the process without throwing (MPI_Abort).
void dump_flight_records(const std::string& reason);

/// This process's rank in the job (init_process_group's), which names its
/// record: lockstep-run reads rank R's from lockstep_trace_rank<R>.json,
/// whatever its rank in the group that failed.
void set_process_rank(int rank);

constexpr size_t kDefaultTraceBufferSize = 256;

} // namespace detail
} // namespace lockstep
