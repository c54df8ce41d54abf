#pragma once

/// \file
/// Options of init_process_group: the rank, world size, store address,
/// timeout and backend, each from torchrun's environment when unset.

#include <lockstep/backend.h>

#include <torch/arg.h>

#include <chrono>
#include <cstdint>
#include <string>

namespace lockstep {

/// Options of init_process_group. Unset fields come from torchrun's
/// environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
struct ProcessGroupOptions {
  /// This process's rank; -1: $RANK.
  TORCH_ARG(int64_t, rank) = -1;
  /// Number of processes; -1: $WORLD_SIZE.
  TORCH_ARG(int64_t, world_size) = -1;
  /// Address of rank 0's store; "": $MASTER_ADDR.
  TORCH_ARG(std::string, master_addr) = "";
  /// Port of rank 0's store; 0: $MASTER_PORT.
  TORCH_ARG(int64_t, master_port) = 0;
  /// Timeout of the store, of connecting, and of every collective; 0:
  /// $LOCKSTEP_TIMEOUT (seconds) when set, else kDefaultTimeout.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::milliseconds(0);
  /// "gloo", "nccl", "mpi", or "auto": NCCL when the build has it and a GPU
  /// is visible, else MPI when an MPI launcher started the process, else Gloo.
  TORCH_ARG(std::string, backend) = "auto";
};

} // namespace lockstep
