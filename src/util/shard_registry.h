#pragma once

// Internal: which tensors are shards of a FullyShardedDataParallel split
// over more than one rank, so that GradScaler can refuse to unscale them
// without the ranks' agreement (Note [Mixed precision] in src/amp.cpp).

#include <c10/core/TensorImpl.h>

namespace lockstep {
namespace detail {

void note_shard(const c10::TensorImpl* shard, int world);
void forget_shard(const c10::TensorImpl* shard);
/// The number of ranks `tensor` is a shard over; 1 for any other tensor.
int shard_world(const c10::TensorImpl* tensor);

} // namespace detail
} // namespace lockstep
