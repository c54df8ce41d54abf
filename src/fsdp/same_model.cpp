// FullyShardedDataParallel's check at construction that every rank wraps
// the same model with the same options: the flat buffers that
// src/fsdp/construct.cpp plans must line up across the ranks
// (src/fsdp/flat_param.h).

#include <lockstep/sharding_options.h>

#include "comm/collective_fingerprint.h"
#include "comm/rank0_text.h"
#include "fsdp/flat_param.h"

#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <sstream>

namespace lockstep {
namespace detail {

namespace {

// The first parameter on each device, named: "'0.weight' on cpu, ...".
std::string devices_of(const std::vector<std::string>& names, const std::vector<torch::Tensor>& params,
                       int64_t& count) {
  std::vector<torch::Device> seen;
  std::string text;
  for (size_t i = 0; i < params.size(); ++i) {
    if (std::find(seen.begin(), seen.end(), params[i].device()) == seen.end()) {
      seen.push_back(params[i].device());
      text += (text.empty() ? "'" : ", '") + names[i] + "' on " + params[i].device().str();
    }
  }
  count = static_cast<int64_t>(seen.size());
  return text;
}


// What every rank's wrapper must agree on: the units and strategy set the
// collectives, the dtypes their sizes, and in deterministic mode the seed
// each micro-batch's random numbers (a seed of base + rank would give each
// rank other dropout masks, and other bits at another world size).
std::string describe(const ShardingOptions& options) {
  std::ostringstream out;
  const char* strategies[] = {"FullShard", "ShardGradOp", "NoShard"};
  out << "strategy=" << strategies[static_cast<int>(options.strategy())] << ", units=[";
  for (const auto& unit : options.units()) {
    out << unit << ";";
  }
  const auto dtype = [](const std::optional<torch::ScalarType>& t) {
    return t ? std::string(c10::toString(*t)) : std::string("none");
  };
  out << "], reshard_after_forward=" << options.reshard_after_forward()
      << ", activation_checkpointing=" << options.activation_checkpointing()
      << ", param_dtype=" << dtype(options.param_dtype()) << ", reduce_dtype=" << dtype(options.reduce_dtype())
      << ", deterministic=" << options.deterministic() << ", micro_batches=" << options.micro_batches()
      << ", micro_batch_size=" << options.micro_batch_size() << ", seed=" << options.seed();
  return out.str();
}

// Each parameter in words, a line each, as the ranks compare them.
std::vector<std::string> describe_params(const std::vector<std::string>& names, const std::vector<torch::Tensor>& params) {
  std::vector<std::string> lines;
  for (size_t i = 0; i < names.size(); ++i) {
    std::ostringstream line;
    line << "'" << names[i] << "' " << params[i].sizes() << " " << c10::toString(params[i].scalar_type())
         << (params[i].requires_grad() ? "" : " (frozen)");
    lines.push_back(line.str());
  }
  return lines;
}

// Called on every rank once some rank's model differs from rank 0's: each
// compares its parameters with rank 0's words, and the ranks that differ
// name the first difference (the others name the rank whose error does).
[[noreturn]] void refuse_other_model(const ProcessGroup& group, const std::vector<std::string>& mine, int other,
                                     torch::Device device, const std::string& where) {
  std::string text;
  for (const auto& line : mine) {
    text += line + "\n";
  }
  const auto reference = split_lines(rank0_text(group, text, device, "the check that every rank has rank 0's model"));
  for (size_t i = 0; i < std::max(mine.size(), reference.size()); ++i) {
    if (i < mine.size() && i < reference.size() && mine[i] == reference[i]) {
      continue;
    }
    const auto at = [i](const std::vector<std::string>& lines) {
      return i < lines.size() ? lines[i] : "no more parameters (" + std::to_string(lines.size()) + " in all)";
    };
    TORCH_CHECK(false, where, "this rank built a different model than rank 0: rank 0 has ", at(reference),
                " where this rank has ", at(mine), ". Every rank must construct the same module, with the same "
                "parameters in the same order, before wrapping it.");
  }
  TORCH_CHECK(false, where, "rank ", other, " built a different model than rank 0 (its own error names the first "
              "parameter that differs). Every rank must construct the same module before wrapping it.");
}

} // namespace

torch::Device control_device(const ProcessGroup& group, torch::Device device) {
  return group.supports(Collective::AllGather, torch::kLong, torch::kCPU) ? torch::Device(torch::kCPU) : device;
}

// Every rank must shard the same parameters, or the flat buffers would not
// line up: the names, shapes and dtypes, hashed, and compared; and with the
// same options (describe). Each rank's must be on one device, as FSDP1
// requires: with two, two of autograd's device threads would run the
// gradient hooks, which share the reduce state.
int64_t check_same_model(const ProcessGroup& group, const std::vector<std::string>& names,
                         const std::vector<torch::Tensor>& params, const ShardingOptions& options,
                         const std::string& where) {
  std::string text;
  for (const auto& line : describe_params(names, params)) {
    text += line + ";";
  }
  const auto hash = static_cast<int64_t>(std::hash<std::string>()(text) >> 1);
  const std::string described = describe(options);
  const auto options_hash = static_cast<int64_t>(std::hash<std::string>()(described) >> 1);
  int64_t devices = 0;
  const std::string on = devices_of(names, params, devices);
  const auto mine = torch::tensor(
      {static_cast<int64_t>(names.size()), hash, devices, propose_model_number(), options_hash}, torch::kLong);
  const auto device = control_device(group, params.empty() ? torch::Device(torch::kCPU) : params[0].device());
  std::vector<torch::Tensor> all;
  for (const auto& theirs : group.all_gather(mine.to(device))) {
    all.push_back(theirs.cpu());
  }
  for (int r = 1; r < group.size(); ++r) {
    const auto* theirs = all[r].data_ptr<int64_t>();
    const auto* first = all[0].data_ptr<int64_t>();
    if (theirs[0] != first[0] || theirs[1] != first[1]) {
      refuse_other_model(group, describe_params(names, params), r, device, where); // every rank sees r
    }
  }
  for (int r = 1; r < group.size(); ++r) {
    TORCH_CHECK(all[r].data_ptr<int64_t>()[4] == all[0].data_ptr<int64_t>()[4], where, "rank ", r, "'s "
                "ShardingOptions differ from rank 0's. This rank (", group.rank(), ") has: ", described, ". Every rank "
                "must pass the same ShardingOptions: they set the units and the collectives, and in deterministic "
                "mode the seed of each micro-batch's random numbers.");
  }
  int several = devices > 1 ? group.rank() : -1; // this rank's own first: it can name them
  for (int r = 0; r < group.size() && several < 0; ++r) {
    several = all[r].data_ptr<int64_t>()[2] > 1 ? r : -1;
  }
  TORCH_CHECK(several < 0, where, "rank ", several, "'s parameters are on ", all[several].data_ptr<int64_t>()[2],
              " devices", several == group.rank() ? " (" + on + ")" : std::string(), ", but FullyShardedDataParallel "
              "shards the parameters of one device per rank. Move the module to one device (module->to(device)) "
              "before wrapping it.");
  return all[0].data_ptr<int64_t>()[3];
}

} // namespace detail
} // namespace lockstep
