#include <lockstep/sync_batch_norm.h>

#include "comm/collective_check.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace lockstep {

// Note [SyncBatchNorm]
// ~~~~~~~~~~~~~~~~~~~~
// Forward gathers from every rank, in one all-gather of 2C+1 float64
// values, its n and, per channel, its mean and its sum of squares about that
// mean; every rank combines them in rank order (Chan, Golub and LeVeque's
// formula, as PyTorch's batch_norm_gather_stats_with_counts): the whole
// batch's squares about its mean are each rank's plus n (its mean - the
// whole mean)^2. No term cancels, so the variance stays right where the
// mean is far from zero beside the spread, float64 inputs included, where
// sums of squares about zero (E[x^2] - mean^2) would lose it. A rank with
// n = 0 adds zeros, so ranks may hold any N, 0 included. Backward needs, per channel,
// sum(dy) and sum(dy * (x - mean)) over every rank: one allreduce of 2C
// values. The input's gradient then equals the one BatchNorm computes on the
// concatenated batch; the weight and bias gradients are this rank's sums,
// which add up over ranks to the concatenated batch's, and which
// DistributedDataParallel's reduction combines. The collectives run on the
// group given at construction, which may be the one DDP uses, and every rank
// must call them in the same order. Two layers of equal width that one rank
// runs in another order (a branch on the rank or the data) would agree in
// size and silently swap statistics, so the wrappers number their layers
// (detail::label_sync_batch_norms) and each layer's collectives carry its
// number and its wrapper's as a tag (Note [Collective tags]): an error on
// every rank instead, also for two wrapped models run in another order.
//
// A 16-bit input is normalised with float statistics, as ATen's batch norm
// kernels do (their accumulate type), and the output and input gradient
// come back in the input's dtype. In the input's own dtype, fp16's
// invstd^2 overflows past 65504 for a channel of variance under about 5e-6
// (invstd reaches 316 with eps 1e-5): a constant channel's input gradient
// was inf * 0 = NaN, every step, and GradScaler backed off for ever; and a
// mean rounded to bf16 (spacing 1/64 near 3) shifted a narrow channel's
// whole output by a tenth of its deviation.

namespace {

struct GroupCapsule : torch::CustomClassHolder {
  GroupCapsule(ProcessGroup g, int64_t t, std::string l) : group(std::move(g)), tag(t), label(std::move(l)) {}
  ProcessGroup group;
  int64_t tag; // Note [Collective tags]
  std::string label; // the layer, for the collectives' names
};

// Sums over every dimension but the channel one.
std::vector<int64_t> reduced_dims(const torch::Tensor& input) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < input.dim(); ++d) {
    dims.push_back(d);
  }
  return dims;
}

// A per-channel vector shaped to broadcast against (N, C, *).
torch::Tensor per_channel(const torch::Tensor& v, const torch::Tensor& input) {
  std::vector<int64_t> shape(input.dim(), 1);
  shape[1] = input.size(1);
  return v.view(shape);
}

// The dtype the arithmetic runs in: float for 16-bit inputs.
torch::ScalarType accumulate_type(const torch::Tensor& x) {
  const auto type = x.scalar_type();
  return type == torch::kHalf || type == torch::kBFloat16 ? torch::kFloat : type;
}

// Where a layer's float64 statistics go through `op`: the input's device,
// or the CPU where the backend cannot run `op` there.
torch::Device statistics_device(const ProcessGroup& group, Collective op, const torch::Tensor& x) {
  return group.supports(op, torch::kDouble, x.device()) ? x.device() : torch::Device(torch::kCPU);
}

std::string where(const ProcessGroup& group) {
  return "lockstep::SyncBatchNorm: rank " + std::to_string(group.rank()) + " of " + std::to_string(group.size()) + ": ";
}

// This rank's n, then per channel its mean and its squares about that mean,
// in float64 (Note [SyncBatchNorm]); `xa` is `x` in the arithmetic's dtype.
torch::Tensor local_statistics(const torch::Tensor& x, const torch::Tensor& xa, const torch::TensorOptions& dbl) {
  const auto dims = reduced_dims(x);
  const int64_t channels = x.size(1);
  const int64_t n = x.numel() / std::max<int64_t>(channels, 1);
  auto stats = torch::zeros({2 * channels + 1}, dbl);
  if (n > 0) {
    const auto mean = x.sum(dims, false, torch::kDouble) / static_cast<double>(n);
    const auto rounded = mean.to(xa.scalar_type());
    // About the mean rounded to the arithmetic's dtype: less n (mean - rounded)^2, the squares about the mean.
    const auto squares = (xa - per_channel(rounded, x)).square().sum(dims, false, torch::kDouble) -
        (mean - rounded.to(torch::kDouble)).square() * static_cast<double>(n);
    stats[0].fill_(static_cast<double>(n));
    stats.narrow(0, 1, channels).copy_(mean);
    stats.narrow(0, 1 + channels, channels).copy_(squares);
  }
  return stats;
}

struct Statistics {
  torch::Tensor mean, var; // per channel, float64, on the CPU
  double total; // values per channel over every rank
};

// The ranks' rows of (n, C means, C sums of squares about those means),
// combined in rank order: the same bits on every rank (Note [SyncBatchNorm]).
Statistics combine_statistics(const torch::Tensor& gathered, int64_t channels) {
  const auto rows = gathered.contiguous();
  const double* data = rows.data_ptr<double>();
  const int64_t width = 2 * channels + 1;
  Statistics out{torch::zeros({channels}, torch::kDouble), torch::zeros({channels}, torch::kDouble), 0.0};
  for (int64_t r = 0; r < rows.size(0); ++r) {
    out.total += data[r * width];
  }
  if (out.total <= 0) {
    return out;
  }
  double* mean = out.mean.data_ptr<double>();
  double* var = out.var.data_ptr<double>();
  for (int64_t r = 0; r < rows.size(0); ++r) {
    for (int64_t c = 0; c < channels; ++c) {
      mean[c] += data[r * width] * data[r * width + 1 + c];
    }
  }
  for (int64_t c = 0; c < channels; ++c) {
    mean[c] /= out.total;
  }
  for (int64_t r = 0; r < rows.size(0); ++r) {
    const double* row = data + r * width;
    for (int64_t c = 0; c < channels; ++c) {
      const double apart = row[1 + c] - mean[c];
      var[c] += row[1 + channels + c] + row[0] * apart * apart;
    }
  }
  for (int64_t c = 0; c < channels; ++c) {
    var[c] = std::max(var[c] / out.total, 0.0);
  }
  return out;
}

class SyncBatchNormFunction : public torch::autograd::Function<SyncBatchNormFunction> {
 public:
  static torch::Tensor forward(
      torch::autograd::AutogradContext* ctx,
      const torch::Tensor& input,
      const c10::optional<torch::Tensor>& maybe_weight,
      const c10::optional<torch::Tensor>& maybe_bias,
      const c10::optional<torch::Tensor>& maybe_running_mean,
      const c10::optional<torch::Tensor>& maybe_running_var,
      double eps,
      double momentum,
      c10::intrusive_ptr<GroupCapsule> capsule) {
    // Optional: apply() refuses an undefined tensor argument, and a layer
    // without affine or track_running_stats has none.
    const auto weight = maybe_weight.value_or(torch::Tensor());
    const auto bias = maybe_bias.value_or(torch::Tensor());
    const auto running_mean = maybe_running_mean.value_or(torch::Tensor());
    const auto running_var = maybe_running_var.value_or(torch::Tensor());
    const ProcessGroup& group = capsule->group;
    const auto x = input.contiguous(input.suggest_memory_format()); // channels-last stays so, as BatchNorm's
    const int64_t channels = x.size(1);
    // On the CPU where the backend cannot reduce on the input's device (MPI beside a CUDA input), as GradScaler's.
    const auto dbl = torch::TensorOptions(torch::kDouble).device(statistics_device(group, Collective::AllGather, x));
    const auto acc = accumulate_type(x);
    const auto xa = x.to(acc);
    const auto stats = local_statistics(x, xa, dbl);
    auto gathered = torch::empty({group.size(), 2 * channels + 1}, dbl);
    {
      detail::CollectiveTag tag(capsule->tag);
      group.all_gather_into_async(gathered.view(-1), stats, capsule->label + "'s statistics (" +
                                  std::to_string(channels) + " channels)")->wait();
    }
    const auto combined = combine_statistics(gathered.cpu(), channels);
    const double total = combined.total;
    TORCH_CHECK(total > 1, where(group), "expected more than 1 value per channel in training, but every rank's batch "
                "together has ", static_cast<int64_t>(total), " (input ", input.sizes(), " on this rank). Train on "
                "larger batches, or put the layer in eval mode.");
    const auto mean = combined.mean.to(x.device());
    const auto var = combined.var.to(x.device());
    const auto invstd = (var + eps).rsqrt();

    if (running_mean.defined()) {
      torch::NoGradGuard no_grad;
      running_mean.mul_(1 - momentum).add_(mean.to(running_mean.scalar_type()), momentum);
      running_var.mul_(1 - momentum).add_((var * (total / (total - 1))).to(running_var.scalar_type()), momentum);
    }
    const auto mean_acc = mean.to(acc);
    const auto invstd_acc = invstd.to(acc);
    auto out = (xa - per_channel(mean_acc, x)) * per_channel(invstd_acc, x);
    if (weight.defined()) {
      out = out * per_channel(weight.to(acc), x) + per_channel(bias.to(acc), x);
    }
    ctx->save_for_backward({x, weight, mean_acc, invstd_acc});
    ctx->saved_data["total"] = total;
    ctx->saved_data["group"] = c10::IValue::make_capsule(capsule);
    return out.to(x.scalar_type());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    const auto& weight = saved[1];
    const auto& mean = saved[2];
    const auto& invstd = saved[3];
    const double total = ctx->saved_data["total"].toDouble();
    const auto capsule = c10::static_intrusive_pointer_cast<GroupCapsule>(ctx->saved_data["group"].toCapsule());
    const ProcessGroup& group = capsule->group;
    const auto dims = reduced_dims(x);
    const int64_t channels = x.size(1);
    // Autograd runs a backward with create_graph under grad mode. This one's
    // allreduce is not differentiable: a second-order gradient (a gradient
    // penalty) would take the global sums for this rank's own and silently
    // leave out every other rank's terms. PyTorch's SyncBatchNorm refuses
    // double backward too. Before the collective, so that ranks that all ask
    // for it all stop here.
    TORCH_CHECK(!torch::GradMode::is_enabled(), "lockstep::", capsule->label, ": rank ", group.rank(), " of ",
                group.size(), ": a backward with create_graph (double backward, a gradient penalty) reached it, but "
                "its gradient's allreduce is not differentiable, so the second-order gradient would leave out the "
                "other ranks' terms. Compute that gradient without create_graph through this layer, or use "
                "BatchNorm there (per rank) as PyTorch's SyncBatchNorm would require too.");

    const auto acc = mean.scalar_type(); // accumulate_type(x), as forward saved it
    const auto dy = grads[0].defined() ? grads[0].contiguous(x.suggest_memory_format()).to(acc)
                                       : torch::zeros_like(x, x.options().dtype(acc));
    const auto xmu = x.to(acc) - per_channel(mean, x);
    const auto local_sum_dy = dy.sum(dims, false, torch::kDouble);
    const auto local_sum_dy_xmu = (dy * xmu).sum(dims, false, torch::kDouble);
    // Every rank reduces, whether or not its input needs a gradient: the
    // others wait for it.
    auto sums = torch::cat({local_sum_dy, local_sum_dy_xmu}).to(statistics_device(group, Collective::Allreduce, x));
    {
      detail::CollectiveTag tag(capsule->tag);
      group.allreduce_async({sums}, ReduceOp::Sum, capsule->label + "'s gradient sums (" + std::to_string(channels) +
                            " channels)")->wait();
    }
    sums = sums.to(x.device());
    const auto mean_dy = (sums.narrow(0, 0, channels) / total).to(acc);
    const auto mean_dy_xmu = (sums.narrow(0, channels, channels) / total).to(acc);

    auto scale = weight.defined() ? invstd * weight.to(acc) : invstd;
    auto grad_input = ((dy - per_channel(mean_dy, x) - xmu * per_channel(invstd * invstd * mean_dy_xmu, x)) *
                       per_channel(scale, x)).to(x.scalar_type());
    torch::Tensor grad_weight, grad_bias;
    if (weight.defined()) {
      grad_weight = (local_sum_dy_xmu * invstd.to(torch::kDouble)).to(weight.scalar_type());
      grad_bias = local_sum_dy.to(weight.scalar_type());
    }
    return {grad_input, grad_weight, grad_bias, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor()};
  }
};

bool is_batch_norm(const torch::nn::Module& m) {
  return m.as<torch::nn::BatchNorm1dImpl>() != nullptr || m.as<torch::nn::BatchNorm2dImpl>() != nullptr ||
      m.as<torch::nn::BatchNorm3dImpl>() != nullptr;
}

} // namespace

std::vector<std::string> detail::batch_norm_parameter_names(torch::nn::Module& root) {
  std::vector<std::string> names;
  for (const auto& named : root.named_modules()) {
    const auto& m = *named.value();
    if (is_batch_norm(m) || m.as<SyncBatchNormImpl>() != nullptr) {
      for (const auto& p : m.named_parameters(/*recurse=*/false)) {
        names.push_back(named.key().empty() ? p.key() : named.key() + "." + p.key());
      }
    }
  }
  return names;
}

namespace {

std::shared_ptr<SyncBatchNormImpl> make_sync(const torch::nn::Module& m, const ProcessGroup& group) {
  if (const auto* bn = m.as<torch::nn::BatchNorm1dImpl>()) {
    return std::make_shared<SyncBatchNormImpl>(*bn, group);
  }
  if (const auto* bn = m.as<torch::nn::BatchNorm2dImpl>()) {
    return std::make_shared<SyncBatchNormImpl>(*bn, group);
  }
  const auto* bn = m.as<torch::nn::BatchNorm3dImpl>();
  TORCH_INTERNAL_ASSERT(bn != nullptr);
  return std::make_shared<SyncBatchNormImpl>(*bn, group);
}

bool is_container(const torch::nn::Module& m) {
  return m.as<torch::nn::SequentialImpl>() != nullptr || m.as<torch::nn::ModuleListImpl>() != nullptr ||
      m.as<torch::nn::ModuleDictImpl>() != nullptr;
}

std::string path_of(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

// Throws, naming the path, at the first BatchNorm that no container holds.
void check_convertible(const torch::nn::Module& m, const std::string& path) {
  for (const auto& child : m.named_children()) {
    const auto child_path = path_of(path, child.key());
    if (is_batch_norm(*child.value())) {
      TORCH_CHECK(is_container(m), "lockstep::convert_sync_batchnorm: cannot replace '", child_path, "' (",
                  child.value()->name(), "), a member of ", path.empty() ? std::string("the model") : "'" + path + "'",
                  " (", m.name(), "). LibTorch modules call their submodules through typed member fields, which no "
                  "function can swap from outside, so only BatchNorm layers held in a torch::nn::Sequential, "
                  "ModuleList or ModuleDict can be converted. Declare this one as lockstep::SyncBatchNorm "
                  "(lockstep::SyncBatchNorm(torch::nn::BatchNormOptions(C), group)), or hold it in a "
                  "torch::nn::Sequential. Nothing was converted.");
    } else {
      check_convertible(*child.value(), child_path);
    }
  }
}

size_t convert(torch::nn::Module& m, const ProcessGroup& group) {
  size_t converted = 0;
  for (const auto& child : m.named_children()) {
    if (!is_batch_norm(*child.value())) {
      converted += convert(*child.value(), group);
      continue;
    }
    auto sync = make_sync(*child.value(), group);
    if (auto* seq = m.as<torch::nn::SequentialImpl>()) {
      for (auto it = seq->begin(); it != seq->end(); ++it) {
        if (it->ptr() == child.value()) {
          *it = torch::nn::AnyModule(SyncBatchNorm(sync));
        }
      }
      m.replace_module(child.key(), sync);
    } else if (auto* list = m.as<torch::nn::ModuleListImpl>()) {
      for (auto it = list->begin(); it != list->end(); ++it) {
        if (*it == child.value()) {
          *it = sync;
        }
      }
      m.replace_module(child.key(), sync);
    } else {
      auto* dict = m.as<torch::nn::ModuleDictImpl>();
      TORCH_INTERNAL_ASSERT(dict != nullptr, "checked by check_convertible");
      dict->update(std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>{{child.key(), sync}});
    }
    ++converted;
  }
  return converted;
}

} // namespace

SyncBatchNormImpl::SyncBatchNormImpl(torch::nn::BatchNormOptions options_, ProcessGroup group_)
    : options(std::move(options_)), group(std::move(group_)) {
  reset();
}

void SyncBatchNormImpl::reset() {
  TORCH_CHECK(options.num_features() > 0, "lockstep::SyncBatchNorm: num_features must be > 0, but got ",
              options.num_features(), ".");
  // A NaN or negative eps makes every output NaN where a channel's variance
  // is small, and a momentum outside [0, 1] running statistics that
  // extrapolate (or NaN), without an error from the operators.
  TORCH_CHECK(std::isfinite(options.eps()) && options.eps() >= 0, "lockstep::SyncBatchNorm: eps must be a finite "
              "number >= 0 (PyTorch's default is 1e-5), but got ", options.eps(), ".");
  const auto momentum = options.momentum();
  TORCH_CHECK(!momentum.has_value() || (*momentum >= 0 && *momentum <= 1), "lockstep::SyncBatchNorm: momentum must "
              "be from 0 to 1 (the weight of each batch in the running statistics; PyTorch's default is 0.1), or none "
              "for a cumulative average, but got ", momentum.has_value() ? *momentum : 0.0, ".");
  // The names, shapes and order of torch::nn::BatchNorm's, so that state
  // dicts move between the two.
  const int64_t c = options.num_features();
  const bool adopt = adopting_;
  adopting_ = false;
  if (options.affine()) {
    // An adopted (converted) BatchNorm's frozen weight stays frozen, as
    // PyTorch's convert_sync_batchnorm keeps it: register_parameter would
    // otherwise set requires_grad on the shared tensor.
    weight = register_parameter("weight", adopt ? adopted_.weight : torch::empty({c}),
                                !adopt || adopted_.weight.requires_grad());
    bias = register_parameter("bias", adopt ? adopted_.bias : torch::empty({c}), !adopt || adopted_.bias.requires_grad());
  } else {
    weight = register_parameter("weight", torch::Tensor(), /*requires_grad=*/false);
    bias = register_parameter("bias", torch::Tensor(), /*requires_grad=*/false);
  }
  if (options.track_running_stats()) {
    running_mean = register_buffer("running_mean", adopt ? adopted_.running_mean : torch::zeros({c}));
    running_var = register_buffer("running_var", adopt ? adopted_.running_var : torch::ones({c}));
    num_batches_tracked = register_buffer(
        "num_batches_tracked", adopt ? adopted_.num_batches_tracked : torch::tensor(0, torch::dtype(torch::kLong)));
  } else {
    running_mean = register_buffer("running_mean", torch::Tensor());
    running_var = register_buffer("running_var", torch::Tensor());
    num_batches_tracked = register_buffer("num_batches_tracked", torch::Tensor());
  }
  adopted_ = Adopted{};
  if (!adopt) {
    reset_parameters();
  }
}

void SyncBatchNormImpl::reset_running_stats() {
  if (options.track_running_stats()) {
    torch::NoGradGuard no_grad;
    running_mean.zero_();
    running_var.fill_(1);
    num_batches_tracked.zero_();
  }
}

void SyncBatchNormImpl::reset_parameters() {
  reset_running_stats();
  if (options.affine()) {
    torch::nn::init::ones_(weight);
    torch::nn::init::zeros_(bias);
  }
}

torch::Tensor SyncBatchNormImpl::forward(const torch::Tensor& input) {
  TORCH_CHECK(input.dim() >= 2 && input.size(1) == options.num_features(), where(group), "expected input of shape (N, ",
              options.num_features(), ", *), but got ", input.sizes(), ".");
  // Its statistics in an integer dtype would truncate (1/std to 0) across ranks.
  TORCH_CHECK(input.is_floating_point(), where(group), "expected a floating-point input, but got ", input.scalar_type(),
              "; convert it first, e.g. input.to(torch::kFloat).");
  // As torch::nn::BatchNorm, so that a group of one and eval mode are it exactly.
  double factor = options.momentum().value_or(0.0);
  if (is_training() && options.track_running_stats()) {
    num_batches_tracked += 1;
    if (!options.momentum()) {
      factor = 1.0 / num_batches_tracked.item<double>();
    }
  }
  if (!is_training() || group.size() == 1) {
    return torch::nn::functional::detail::batch_norm(input, running_mean, running_var, weight, bias,
                                                     is_training() || !options.track_running_stats(), factor,
                                                     options.eps());
  }
  auto label = path_.empty() ? std::string("SyncBatchNorm") : "SyncBatchNorm '" + path_ + "'";
  const auto maybe = [](const torch::Tensor& t) {
    return t.defined() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
  };
  return SyncBatchNormFunction::apply(input, maybe(weight), maybe(bias), maybe(running_mean), maybe(running_var),
                                      options.eps(), factor,
                                      c10::make_intrusive<GroupCapsule>(group, tag_, std::move(label)));
}

void SyncBatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << "lockstep::SyncBatchNorm(" << options.num_features() << ", eps=" << options.eps()
         << ", momentum=" << options.momentum().value_or(-1) << ", affine=" << options.affine()
         << ", track_running_stats=" << options.track_running_stats() << ", world_size=" << group.size() << ")";
}

size_t convert_sync_batchnorm(torch::nn::Module& module, const ProcessGroup& group) {
  TORCH_CHECK(!is_batch_norm(module), "lockstep::convert_sync_batchnorm: the model itself is a ", module.name(),
              ", which cannot be replaced in place. Make a lockstep::SyncBatchNorm(", "torch::nn::BatchNormOptions(C), "
              "group) instead, or pass the module that holds it.");
  check_convertible(module, "");
  return convert(module, group);
}

namespace detail {

void label_sync_batch_norms(torch::nn::Module& root, const ProcessGroup& group, int64_t model) {
  int64_t number = 0;
  for (const auto& named : root.named_modules()) {
    if (auto* sync = named.value()->as<SyncBatchNormImpl>()) {
      sync->tag_ = layer_tag(sync->group.same_group_as(group) ? model : 0, ++number);
      sync->path_ = named.key();
    }
  }
}

// Replicas on threads of one process would start their allreduces on the
// one group in whatever order the threads reach it, on every rank: replica
// i of rank 0 meets replica j of rank 1, with the same sizes and tag, and
// the statistics mix without an error (or, where a replica's chunk is
// empty and it does not run, the ranks' counts differ and they hang).
void check_replicable(const torch::nn::Module& root, size_t replicas) {
  for (const auto& named : root.named_modules()) {
    const auto* sync = named.value()->as<SyncBatchNormImpl>();
    if (replicas > 1 && sync != nullptr && sync->group.size() > 1) {
      TORCH_CHECK(false, "lockstep::DataParallel: '", named.key(), "' is a lockstep::SyncBatchNorm over ",
                  sync->group.size(), " ranks, but DataParallel runs ", replicas, " replicas of it on threads of one "
                  "process, whose allreduces would meet the other ranks' replicas in whatever order the threads reach "
                  "the group, mixing their statistics. Run one replica per process under DistributedDataParallel "
                  "(one device per rank), or give the layer a group of one (BatchNorm per replica).");
    }
  }
}

} // namespace detail

} // namespace lockstep
