// Compiled by the test LockstepHeader.NeedsNoC10dHeaders
// (tests/header_deps_check.cmake): a program that includes only
// <lockstep/lockstep.h>, and so must compile with none of c10d's headers
// (torch/csrc/distributed), which only <lockstep/c10d.h> brings.

#include <lockstep/lockstep.h>

int lockstep_header_alone() {
  lockstep::DistributedOptions ddp;
  lockstep::ShardingOptions fsdp;
  lockstep::DataParallelOptions dp;
  return static_cast<int>(ddp.bucket_bytes() > 0) + static_cast<int>(fsdp.reshard_after_forward()) +
         static_cast<int>(dp.dim());
}
