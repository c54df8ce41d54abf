// Compiled with gloo.cpp, when LibTorch has c10d's Gloo process group.

#include "comm/backends/gloo_rings.h"

#include "util/mapped_memory.h"

#include <utility>

namespace lockstep {
namespace detail {
namespace {

// Note [Gloo's reduce-scatter]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// c10d's Gloo has no reduce-scatter in LibTorch 1.13, and in 2.x emulates one
// with an allreduce of the whole input: twice a ring's traffic, which would
// make a sharded model's gradients cost more than DDP's. So the Gloo group
// runs a ring over c10d's send and recv. With W ranks and n elements per
// shard, at step s (0 .. W-2) rank r sends its partial sum of chunk
// (r-s-1) mod W to rank r+1 and adds what rank r-1 sends of chunk
// (r-s-2) mod W; after W-1 steps chunk r holds every rank's sum. Each rank
// sends (W-1)*n elements, as a ring allreduce's first half does. The steps
// run on a thread of the group's own, one ring after another in the order
// the ranks start them (the same on every rank, Note [Ranks agree before
// they send]); tags count the rings, so that two never pair up wrongly.
// All-gathers of CPU tensors run as a ring on the same thread: c10d's
// gathers into a flat tensor of its own and copies out of it.
// CUDA tensors go through a CPU copy, as Gloo's own collectives take them.
//
// Note [Receive before sending]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each ring step posts its receive before its send. A Gloo TCP pair sends
// an unbound buffer only once the peer has said it is ready to receive, and
// that notice travels in the same queue as the pair's data. Posted the
// other way round, a rank whose peer's notice came first starts writing
// its whole chunk, and its own notice waits behind it: with two ranks (one
// pair, both directions) each direction then ran only while the other was
// idle, and an all-gather took as long as the allreduce that moves twice
// its bytes (0.48 against 0.93 Gb/s bus bandwidth on a 1 Gb/s link,
// docs/performance.md).

void combine(torch::Tensor& into, const torch::Tensor& from, ReduceOp op) {
  switch (op) {
    case ReduceOp::Max:
      torch::maximum_out(into, into, from);
      return;
    case ReduceOp::Min:
      torch::minimum_out(into, into, from);
      return;
    default:
      into.add_(from);
  }
}

// What c10d's send and recv return, whichever LibTorch names its Work.
using GlooWork = decltype(std::declval<c10d::ProcessGroupGloo&>().barrier());

// Note [Planned rings]: step `step` of a ring that carries a planned
// collective's words passes on rank r-step's and receives rank r-step-1's,
// on a tag of their own, posted beside the step's data; `posted` collects
// the works to wait on. None where `words` is undefined.
void post_words(c10d::ProcessGroupGloo& group, const torch::Tensor& words, int step, int tag,
                std::vector<GlooWork>& posted) {
  if (!words.defined()) {
    return;
  }
  const int size = group.getSize();
  const int rank = group.getRank();
  const int64_t per_rank = words.numel() / size;
  auto slot = [&](int i) { return words.narrow(0, ((i % size + size) % size) * per_rank, per_rank); };
  std::vector<torch::Tensor> into{slot(rank - step - 1)};
  std::vector<torch::Tensor> sent{slot(rank - step)};
  posted.push_back(group.recv(into, (rank - 1 + size) % size, tag));
  posted.push_back(group.send(sent, (rank + 1) % size, tag));
}

// A ring's tags: size()-1 for its steps' data, from first_tag, and as many
// for their words after them.
int words_tag(int first_tag, int size, int step) {
  return first_tag + size + step;
}

} // namespace

// At step s rank r sends its partial sum of chunk (r-s-1) mod W and adds
// its own input's chunk (r-s-2) mod W to the partial that rank r-1 sends.
// Step 0 sends the input's chunk as it is and the last step receives
// straight into `output`, so two ranks copy nothing; more ranks pass the
// partials on through two buffers (one sent while the next arrives).
void ring_reduce_scatter(c10d::ProcessGroupGloo& group, torch::Tensor output, const torch::Tensor& input, ReduceOp op,
                         int first_tag, const torch::Tensor& words) {
  if (!input.is_cpu() || !output.is_cpu()) {
    auto on_cpu = torch::empty({output.numel()}, output.options().device(torch::kCPU));
    ring_reduce_scatter(group, on_cpu, input.to(torch::kCPU), op, first_tag, words);
    output.copy_(on_cpu.view_as(output));
    return;
  }
  const int size = group.getSize();
  const int rank = group.getRank();
  const int64_t n = output.numel();
  const auto flat = input.reshape({-1});
  auto chunk = [&](int i) { return flat.narrow(0, ((i % size + size) % size) * n, n); };
  torch::Tensor partial = chunk(rank - 1);
  torch::Tensor spare[2];
  for (int step = 0; step < size - 1; ++step) {
    auto& buffer = spare[step % 2];
    if (step < size - 2 && !buffer.defined()) {
      buffer = empty_mapped(n, flat.options()); // Note [Pages for transient buffers]: this thread frees it
    }
    auto received = step == size - 2 ? output.view({-1}) : buffer;
    std::vector<torch::Tensor> sent{partial};
    std::vector<torch::Tensor> into{received};
    // Note [Receive before sending].
    std::vector<GlooWork> posted{group.recv(into, (rank - 1 + size) % size, first_tag + step),
                                                       group.send(sent, (rank + 1) % size, first_tag + step)};
    post_words(group, words, step, words_tag(first_tag, size, step), posted);
    for (auto& work : posted) {
      work->wait();
    }
    combine(received, chunk(rank - step - 2), op);
    partial = received;
  }
}

// The all-gather ring: at step s rank r passes on the shard of rank
// (r-s) mod W that it holds and receives that of rank (r-s-1) mod W, each
// straight into its place in `outputs`: no flat copy on a Gloo thread, whose
// allocations glibc keeps in that thread's arena.
void ring_all_gather(c10d::ProcessGroupGloo& group, std::vector<torch::Tensor> outputs, const torch::Tensor& input,
                     int first_tag, const torch::Tensor& words) {
  const int size = group.getSize();
  const int rank = group.getRank();
  if (outputs[rank].data_ptr() != input.data_ptr()) { // else in place: this rank's part is there
    outputs[rank].copy_(input.view_as(outputs[rank]));
  }
  auto slot = [&](int i) { return outputs[(i % size + size) % size]; };
  for (int step = 0; step < size - 1; ++step) {
    std::vector<torch::Tensor> sent{slot(rank - step)};
    std::vector<torch::Tensor> received{slot(rank - step - 1)};
    // Note [Receive before sending].
    std::vector<GlooWork> posted{group.recv(received, (rank - 1 + size) % size, first_tag + step),
                                                       group.send(sent, (rank + 1) % size, first_tag + step)};
    post_words(group, words, step, words_tag(first_tag, size, step), posted);
    for (auto& work : posted) {
      work->wait();
    }
  }
}

} // namespace detail
} // namespace lockstep
