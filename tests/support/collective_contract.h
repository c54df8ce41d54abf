#pragma once

// What process_group.h promises of every backend, as checks that run the
// same on ranks as threads (test_collectives.cpp, Gloo) and on ranks as
// processes under mpirun (collectives_worker.cpp, MPI): distinct values per
// rank, and every result computed by hand from the rank count.

#include <lockstep/process_group.h>

#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

namespace lockstep {
namespace testing {

/// Reports one check: ok, and what was checked.
using Check = std::function<void(bool ok, const std::string& what)>;

/// The message of the c10::Error that fn throws, or "" if it throws none.
inline std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

/// Whether `message` holds every one of `needles`; the check names what is missing.
inline void check_says(const Check& check, const std::string& message, const std::vector<std::string>& needles,
                       const std::string& what) {
  check(!message.empty(), what + ": expected an error, got none");
  for (const auto& needle : needles) {
    check(message.find(needle) != std::string::npos, what + ": expected '" + needle + "' in: " + message);
  }
}

// Item 1: a list of several tensors is reduced, or broadcast, tensor by
// tensor, whatever their sizes, contiguous or not.
inline void check_several_tensors(const ProcessGroup& group, const Check& check) {
  const int r = group.rank();
  const int n = group.size();
  auto a = torch::full({1}, static_cast<float>(r + 1));
  auto b = torch::full({1}, static_cast<float>((r + 1) * (r + 1)));
  group.allreduce_async({a, b}, ReduceOp::Sum, "several tensors")->wait(); // 4 ranks: [10], [30]
  check(a.item<float>() == n * (n + 1) / 2.0f, "sum of [r+1]: " + std::to_string(a.item<float>()));
  check(b.item<float>() == n * (n + 1) * (2 * n + 1) / 6.0f, "sum of [(r+1)^2]: " + std::to_string(b.item<float>()));

  auto one = torch::full({1}, static_cast<float>(r));
  auto c = (torch::arange(6, torch::kFloat) + r).view({2, 3}).t(); // not contiguous
  group.allreduce_async({one, c}, ReduceOp::Sum, "tensors of several shapes")->wait();
  check(one.item<float>() == n * (n - 1) / 2.0f, "sum of [r] beside a [3, 2] tensor");
  check(torch::equal(c, torch::arange(6, torch::kFloat).view({2, 3}).t() * n + n * (n - 1) / 2.0f),
        "sum of a transposed [3, 2] tensor");

  auto high = torch::full({2}, static_cast<float>(r));
  auto low = torch::full({3}, static_cast<float>(-r));
  group.allreduce_async({high, low}, ReduceOp::Max, "several tensors")->wait();
  check(torch::equal(high, torch::full({2}, static_cast<float>(n - 1))), "max of [r, r]");
  check(torch::equal(low, torch::zeros({3})), "max of [-r, -r, -r]");

  auto mean = torch::full({1}, static_cast<float>(r + 1));
  auto twice = torch::full({2}, static_cast<float>(2 * (r + 1)));
  group.allreduce_async({mean, twice}, ReduceOp::Avg, "several tensors")->wait();
  check(mean.item<float>() == (n + 1) / 2.0f, "avg of [r+1]: " + std::to_string(mean.item<float>()));
  check(torch::equal(twice, torch::full({2}, static_cast<float>(n + 1))), "avg of [2(r+1), 2(r+1)]");

  auto t0 = torch::full({2}, static_cast<float>(10 * r));
  auto t1 = torch::full({3}, static_cast<double>(100 * r + 1)).to(torch::kFloat);
  group.broadcast_async({t0, t1}, n - 1, "several tensors")->wait();
  check(torch::equal(t0, torch::full({2}, static_cast<float>(10 * (n - 1)))), "broadcast of t0 from the last rank");
  check(torch::equal(t1, torch::full({3}, static_cast<float>(100 * (n - 1) + 1))), "broadcast of t1 from the last rank");
}

inline int64_t floor_div(int64_t a, int64_t b) {
  return static_cast<int64_t>(std::floor(static_cast<double>(a) / static_cast<double>(b)));
}

// Item 2: Avg of integers is the sum divided by the rank count, rounded
// down; of bools, refused at the call.
inline void check_integer_average(const ProcessGroup& group, const Check& check) {
  const int r = group.rank();
  const int64_t n = group.size();
  auto longs = torch::full({3}, static_cast<int64_t>(r - 2), torch::kLong); // sums are negative: floor, not truncation
  auto ints = torch::arange(4, torch::kInt) + 3 * r;
  group.allreduce_async({longs}, ReduceOp::Avg, "integer average")->wait();
  group.allreduce_async({ints}, ReduceOp::Avg, "integer average")->wait();
  const int64_t long_sum = n * (n - 1) / 2 - 2 * n;
  check(torch::equal(longs, torch::full({3}, floor_div(long_sum, n), torch::kLong)),
        "avg of Long r-2 over " + std::to_string(n) + " ranks is floor(" + std::to_string(long_sum) + "/n), got " +
            std::to_string(longs[0].item<int64_t>()));
  check(ints.scalar_type() == torch::kInt, "avg keeps the Int dtype");
  for (int64_t k = 0; k < 4; ++k) {
    const int64_t sum = k * n + 3 * n * (n - 1) / 2;
    check(ints[k].item<int64_t>() == floor_div(sum, n), "avg of Int element " + std::to_string(k));
  }
  // Narrow integers: the sum overflows their type, the average does not.
  auto bytes = torch::full({5}, 200, torch::kByte);
  auto chars = torch::full({5}, static_cast<int64_t>(100 + r), torch::kChar);
  group.allreduce_async({bytes}, ReduceOp::Avg, "uint8 average")->wait();
  group.allreduce_async({chars}, ReduceOp::Avg, "int8 average")->wait();
  check(bytes.scalar_type() == torch::kByte && torch::equal(bytes, torch::full({5}, 200, torch::kByte)),
        "avg of uint8 200 is 200, got " + std::to_string(bytes[0].item<int64_t>()));
  const int64_t char_average = floor_div(100 * n + n * (n - 1) / 2, n);
  check(torch::equal(chars, torch::full({5}, char_average, torch::kChar)),
        "avg of int8 100+r is " + std::to_string(char_average) + ", got " + std::to_string(chars[0].item<int64_t>()));
  const auto whole = torch::full({2 * n, 3}, static_cast<int64_t>(120 + r), torch::kChar);
  auto part = torch::empty({2, 3}, torch::kChar);
  group.reduce_scatter_async(part, whole, ReduceOp::Avg, "int8 reduce_scatter average")->wait();
  check(torch::equal(part, torch::full({2, 3}, floor_div(120 * n + n * (n - 1) / 2, n), torch::kChar)),
        "reduce_scatter avg of int8 120+r, got " + std::to_string(part[0][0].item<int64_t>()));
  // An inference tensor (an accuracy counted under InferenceMode) is averaged in place.
  torch::Tensor counted;
  {
    c10::InferenceMode inference;
    counted = torch::full({1}, static_cast<float>(r + 1));
  }
  group.allreduce_async({counted}, ReduceOp::Avg, "inference average")->wait();
  check(counted.item<float>() == (n + 1) / 2.0f, "avg of an inference tensor");
  auto flags = torch::ones({2}, torch::kBool);
  check_says(check, message_of([&] { group.allreduce_async({flags}, ReduceOp::Avg, "bool average")->wait(); }),
             {"bool average", "Avg", "Bool", "before anything was sent"}, "Avg of Bool");
}

// Item 3: an empty list is refused at the call, on every backend.
inline void check_empty_list(const ProcessGroup& group, const Check& check) {
  check_says(check, message_of([&] { group.allreduce_async({}, ReduceOp::Sum, "empty allreduce"); }),
             {"empty allreduce", "no tensors", "before anything was sent"}, "allreduce of an empty list");
  check_says(check, message_of([&] { group.broadcast_async({}, 0, "empty broadcast"); }),
             {"empty broadcast", "no tensors", "before anything was sent"}, "broadcast of an empty list");
}

// Item 5: an argument this rank gets wrong reads as a local refusal, not as
// a timeout or another rank's failure.
inline void check_local_refusal(const ProcessGroup& group, const Check& check) {
  const std::string message = message_of([&] {
    group.allreduce_async({torch::ones({2}), torch::ones({2}, torch::kDouble)}, ReduceOp::Sum, "mixed dtypes")->wait();
  });
  check_says(check, message, {"mixed dtypes", "before anything was sent", "tensors[1] is Double but tensors[0] is Float"},
             "mixed dtypes");
  check(message.find("timeout") == std::string::npos && message.find("Another rank") == std::string::npos,
        "a local refusal does not read as a timeout: " + message);
}

// Runs `fn`; a c10::Error fails the check named `what` and the next part
// of the test runs, so that one run shows every part that fails.
inline void attempt(const Check& check, const std::string& what, const std::function<void()>& fn) {
  const std::string message = message_of(fn);
  check(message.empty(), what + ": " + message);
}

// Item 6: bfloat16 and bool travel exactly, whatever the backend carries; a
// backend that cannot reduce bfloat16 says so at the call.
inline void check_bfloat16_and_bool(const ProcessGroup& group, const Check& check) {
  const int r = group.rank();
  const int n = group.size();
  attempt(check, "bfloat16 broadcast", [&] {
    // 1 + 2^-7 and -3.5 are exact in bfloat16; rank r's own values differ.
    auto bf16 = torch::tensor({1.0f + 1.0f / 128, -3.5f, static_cast<float>(r)}).to(torch::kBFloat16);
    group.broadcast_async({bf16}, 0, "bfloat16 broadcast")->wait();
    check(torch::equal(bf16, torch::tensor({1.0f + 1.0f / 128, -3.5f, 0.0f}).to(torch::kBFloat16)), "bfloat16 broadcast");
  });
  attempt(check, "bool broadcast", [&] {
    auto flags = torch::tensor({r == 0, r != 0, true}, torch::kBool);
    group.broadcast_async({flags}, 0, "bool broadcast")->wait();
    check(torch::equal(flags, torch::tensor({true, false, true}, torch::kBool)), "bool broadcast");
  });
  attempt(check, "bool max and min", [&] {
    auto any = torch::tensor({r == n - 1, false}, torch::kBool);
    auto every = torch::tensor({r != 0 || n == 1, true}, torch::kBool);
    group.allreduce_async({any}, ReduceOp::Max, "bool max")->wait();
    group.allreduce_async({every}, ReduceOp::Min, "bool min")->wait();
    check(torch::equal(any, torch::tensor({true, false}, torch::kBool)), "bool max: true where any rank has true");
    check(torch::equal(every, torch::tensor({n == 1, true}, torch::kBool)), "bool min: true where every rank has true");
  });
  attempt(check, "bfloat16 and bool all_gather", [&] {
    auto gathered = group.all_gather(torch::full({2}, static_cast<float>(r)).to(torch::kBFloat16));
    auto bools = group.all_gather(torch::full({2}, r % 2 == 1, torch::kBool));
    for (int k = 0; k < n; ++k) {
      check(torch::equal(gathered[k], torch::full({2}, static_cast<float>(k)).to(torch::kBFloat16)), "bfloat16 all_gather");
      check(torch::equal(bools[k], torch::full({2}, k % 2 == 1, torch::kBool)), "bool all_gather");
    }
  });
  // A backend that reduces bfloat16 gives the sum; one that cannot says so at the call.
  auto sum = torch::full({2}, static_cast<float>(r + 1)).to(torch::kBFloat16);
  const std::string refused = message_of([&] { group.allreduce_async({sum}, ReduceOp::Sum, "bfloat16 sum")->wait(); });
  if (refused.empty()) {
    check(torch::equal(sum, torch::full({2}, n * (n + 1) / 2.0f).to(torch::kBFloat16)), "bfloat16 sum");
  } else {
    check_says(check, refused, {"bfloat16 sum", "BFloat16", group.backend(), "before anything was sent"},
               "bfloat16 allreduce refused");
  }
}

// Collectives called under InferenceMode, whose tensors are then inference
// tensors, which only an in-place op under that mode may write: all_gather
// into a list, and the flat reduce-scatter and all-gather, each large enough
// for Gloo's rings, which run on a thread of the group's own.
inline void check_collectives_in_inference_mode(const ProcessGroup& group, const Check& check) {
  const int r = group.rank();
  const int n = group.size();
  c10::InferenceMode inference;
  attempt(check, "all_gather in inference mode", [&] {
    auto all = group.all_gather(torch::full({3}, static_cast<float>(r)));
    check(static_cast<int>(all.size()) == n, "all_gather in inference mode gives one tensor per rank");
    for (int k = 0; k < n && k < static_cast<int>(all.size()); ++k) {
      check(torch::equal(all[k], torch::full({3}, static_cast<float>(k))), "all_gather in inference mode, slot " + std::to_string(k));
    }
  });
  const int64_t k = 128 * 1024; // 512 KiB of floats a rank
  attempt(check, "reduce_scatter in inference mode", [&] {
    auto output = torch::empty({k});
    group.reduce_scatter_async(output, torch::full({n * k}, static_cast<float>(r + 1)), ReduceOp::Sum,
                               "reduce_scatter in inference mode")->wait();
    check(torch::equal(output, torch::full({k}, n * (n + 1) / 2.0f)), "reduce_scatter in inference mode sums");
  });
  attempt(check, "all_gather_into in inference mode", [&] {
    auto output = torch::empty({n * k});
    group.all_gather_into_async(output, torch::full({k}, static_cast<float>(r)), "all_gather_into in inference mode")
        ->wait();
    for (int i = 0; i < n; ++i) {
      check(torch::equal(output.narrow(0, i * k, k), torch::full({k}, static_cast<float>(i))),
            "all_gather_into in inference mode, rank " + std::to_string(i) + "'s part");
    }
  });
}

// A reduce-scatter whose output is this rank's slice of its input
// (NCCL's in-place form) gives the reduction, not the slice added to itself;
// and collectives over parameters that require a gradient write into them,
// as an optimizer does, instead of raising autograd's in-place error.
inline void check_in_place_and_parameters(const ProcessGroup& group, const Check& check) {
  const int r = group.rank();
  const int n = group.size();
  const int64_t k = 3;
  for (auto op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg}) {
    auto input = torch::arange(n * k, torch::kFloat) + 100.0f * r;
    auto output = input.narrow(0, r * k, k);
    group.reduce_scatter_async(output, input, op, "in-place reduce-scatter")->wait();
    const auto mine = torch::arange(r * k, (r + 1) * k, torch::kFloat);
    const auto expected = op == ReduceOp::Sum ? mine * n + 100.0f * n * (n - 1) / 2
        : op == ReduceOp::Max                 ? mine + 100.0f * (n - 1)
                                              : mine + 100.0f * (n - 1) / 2;
    check(torch::allclose(output, expected), "in-place reduce-scatter (op " + std::to_string(static_cast<int>(op)) +
          ") on rank " + std::to_string(r));
  }
  // The input in rank 0's place of the output on every rank: in place on
  // rank 0, and on the others a part another rank's overwrites.
  auto gathered = torch::full({n * k}, static_cast<float>(r));
  group.all_gather_into_async(gathered, gathered.narrow(0, 0, k), "an all-gather from rank 0's place")->wait();
  for (int i = 0; i < n; ++i) {
    check(torch::equal(gathered.narrow(0, i * k, k), torch::full({k}, static_cast<float>(i))),
          "an all-gather whose input is in rank 0's place of the output, rank " + std::to_string(i) + "'s part on rank " +
              std::to_string(r));
  }
  auto weight = torch::full({2, 3}, static_cast<float>(r + 1)).requires_grad_(true);
  auto bias = torch::full({3}, static_cast<float>(r)).requires_grad_(true);
  group.allreduce_async({weight}, ReduceOp::Avg, "a parameter's average")->wait();
  check(torch::equal(weight.detach(), torch::full({2, 3}, (n + 1) / 2.0f)), "the average of a parameter");
  group.broadcast_async({weight, bias}, n - 1, "parameters from the last rank")->wait();
  check(torch::equal(bias.detach(), torch::full({3}, static_cast<float>(n - 1))) && weight.requires_grad(),
        "a list of parameters broadcast from the last rank");
}

// Item 4: rank 0 reduces 4 elements, the others 1000. Every rank ends with
// an error naming the collective and both sizes, none dies; the group then
// goes on working.
inline void check_size_mismatch(const ProcessGroup& group, const Check& check) {
  const int r = group.rank();
  auto t = torch::ones({r == 0 ? 4 : 1000});
  const std::string message = message_of([&] { group.allreduce_async({t}, ReduceOp::Sum, "the mismatched allreduce")->wait(); });
  check_says(check, message,
             {"the mismatched allreduce", "ranks disagree",
              "rank 0 runs allreduce (sum) of 4 Float elements but rank 1 runs allreduce (sum) of 1000 Float elements"},
             "rank " + std::to_string(r) + "'s error");
  auto after = torch::full({3}, static_cast<float>(r));
  group.allreduce(after);
  const int n = group.size();
  check(torch::equal(after, torch::full({3}, n * (n - 1) / 2.0f)), "an allreduce after the mismatch");
}

// Ranks whose calls agree in their element count but not in what they
// mean: a list split differently, a tensor reshaped, Avg against Sum, half
// against bfloat16 (which a backend may carry as one 16-bit type). Each
// would have gone through, matching elements by position; every rank now
// ends with an error naming both calls, and the group goes on working.
inline void check_meaning_mismatch(const ProcessGroup& group, const Check& check) {
  const int r = group.rank();
  const bool odd = r % 2 == 1;
  const std::string who = "rank " + std::to_string(r) + ": ";
  auto a = torch::ones({odd ? 3 : 2});
  auto b = torch::ones({odd ? 2 : 3});
  check_says(check, message_of([&] { group.allreduce_async({a, b}, ReduceOp::Sum, "the split list")->wait(); }),
             {"the split list", "ranks disagree", "of 5 Float elements in 2 tensors", "in tensors of other shapes"},
             who + "a list split differently");
  auto grid = odd ? torch::ones({3, 2}) : torch::ones({2, 3});
  check_says(check, message_of([&] { group.all_gather(grid); }), {"ranks disagree", "in tensors of other shapes"},
             who + "an all_gather of a reshaped tensor");
  auto t = torch::ones({4});
  check_says(check, message_of([&] {
               group.allreduce_async({t}, odd ? ReduceOp::Sum : ReduceOp::Avg, "the average")->wait();
             }),
             {"ranks disagree", "rank 0 runs allreduce (avg) of 4 Float elements but rank 1 runs allreduce (sum)"},
             who + "Avg against Sum");
  auto h = torch::ones({4}, odd ? torch::kBFloat16 : torch::kHalf);
  check_says(check, message_of([&] { group.broadcast_async({h}, 0, "the 16-bit broadcast")->wait(); }),
             {"ranks disagree", "of 4 Half elements", "of 4 BFloat16 elements"}, who + "half against bfloat16");
  auto after = torch::full({3}, static_cast<float>(r));
  group.allreduce(after);
  const int n = group.size();
  check(torch::equal(after, torch::full({3}, n * (n - 1) / 2.0f)), who + "an allreduce after the mismatches");
}

} // namespace testing
} // namespace lockstep
