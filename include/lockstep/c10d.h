#pragma once

/// \file
/// A lockstep::ProcessGroup over a c10d process group you made yourself.

#include <lockstep/detail/c10d_group.h>
#include <lockstep/process_group.h>

#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>

#include <utility>

namespace lockstep {

/// Wraps a c10d process group the caller made: a c10d::ProcessGroupGloo or
/// ProcessGroupNCCL over their own store (a c10d::Backend in PyTorch 2.x, a
/// c10d::ProcessGroup in 1.13), or a c10d::ProcessGroup. Any c10d type with
/// c10d's allreduce, broadcast, allgather and barrier will do. Its
/// collectives time out as the c10d group was told to; lockstep's errors
/// quote kDefaultTimeout.
template <typename C10dType>
ProcessGroup from_c10d(c10::intrusive_ptr<C10dType> group) {
  TORCH_CHECK(group, "lockstep::from_c10d: the c10d process group is null.");
  const auto name = group->getBackendName();
  return ProcessGroup(std::make_shared<detail::C10dGroup<C10dType>>(std::move(group), name, kDefaultTimeout));
}

} // namespace lockstep
