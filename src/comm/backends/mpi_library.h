#pragma once

// Internal, for mpi.cpp: the MPI library, initialised once per process and
// finalised at exit, and the mapping of tensors, reductions and return codes
// onto MPI's. Compiled only where the build found an MPI library.

#include <lockstep/backend.h>

#include <torch/types.h>

#include <mpi.h>

#include <string>
#include <vector>

namespace lockstep {
namespace detail {

/// Initialises MPI once per process (MPI_THREAD_SERIALIZED), or checks the
/// level that a caller's own MPI_Init_thread got; returns MPI's world size,
/// read then (later calls call no MPI).
int init_mpi();

/// Says that this process is ending the job with MPI_Abort: from then on,
/// nothing calls MPI_Finalize or frees a communicator (either would hang).
void begin_mpi_abort();
bool mpi_aborting();

/// `t`'s element count as MPI's int; an error naming `what` and `rank` past
/// INT_MAX, where a cast would cut the collective short without a word.
int mpi_count(const torch::Tensor& t, const std::string& what, int rank);
/// `t`'s element type as MPI's; an error naming `what` and `rank` for a
/// type MPI has none for (16-bit floats).
MPI_Datatype mpi_type(const torch::Tensor& t, const std::string& what, int rank);
/// Sum, max and min as MPI's; Avg never reaches MPI itself.
MPI_Op mpi_op(ReduceOp op);
/// MPI's text for a return code; empty for MPI_SUCCESS.
std::string mpi_error(int rc);

/// Every rank's string in `comm`, in rank order.
std::vector<std::string> all_gather_strings(MPI_Comm comm, int size, const std::string& mine);

} // namespace detail
} // namespace lockstep
