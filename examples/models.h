#pragma once

// The models the trainer and the benchmarks share.

#include <lockstep/activation_checkpoint.h>

#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace lockstep {
namespace examples {

/// A small convolutional classifier for 1x28x28 images (MNIST's shape).
struct ConvNetImpl : torch::nn::Cloneable<ConvNetImpl> {
  ConvNetImpl() {
    reset();
  }
  void reset() override {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 5).padding(2)));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(16));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 5).padding(2)));
    bn2 = register_module("bn2", torch::nn::BatchNorm2d(32));
    fc1 = register_module("fc1", torch::nn::Linear(32 * 7 * 7, 128));
    fc2 = register_module("fc2", torch::nn::Linear(128, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::max_pool2d(torch::relu(bn1(conv1(x))), 2);
    h = torch::max_pool2d(torch::relu(bn2(conv2(h))), 2);
    return fc2(torch::relu(fc1(h.flatten(1))));
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(ConvNet);

/// One pre-norm transformer block: multi-head self-attention, then an MLP
/// of 4x the width, each added to its input; with `causal`, a position
/// attends to itself and those before it only. A lockstep::Checkpointable:
/// with its switch on (set_activation_checkpointing, or
/// ShardingOptions().activation_checkpointing() on a unit), forward is a
/// checkpoint segment whose activations backward makes again.
///
/// Attention is written out (one qkv projection, matmuls, a softmax) rather
/// than torch::nn::MultiheadAttention, which takes [length, batch, dim]. On
/// the CPU the two are as fast at the ViT's shape (bench/bench_attention.cpp,
/// docs/performance.md); this one keeps batch-first shapes, takes the causal
/// mask without a separate argument, and is the same code on 1.13 and 2.x.
struct TransformerBlockImpl : torch::nn::Cloneable<TransformerBlockImpl>, lockstep::Checkpointable {
  TransformerBlockImpl(int64_t dim, int64_t heads, double dropout, bool causal = false)
      : dim(dim), heads(heads), dropout(dropout), causal(causal) {
    reset();
  }
  void reset() override {
    norm1 = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    qkv = register_module("qkv", torch::nn::Linear(dim, 3 * dim));
    proj = register_module("proj", torch::nn::Linear(dim, dim));
    norm2 = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    fc1 = register_module("fc1", torch::nn::Linear(dim, 4 * dim));
    fc2 = register_module("fc2", torch::nn::Linear(4 * dim, dim));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return checkpointed_call([this](const torch::Tensor& in) { return body(in); }, x);
  }
  torch::Tensor body(const torch::Tensor& x) {
    const int64_t batch = x.size(0), length = x.size(1), head_dim = dim / heads;
    auto parts = qkv(norm1(x)).view({batch, length, 3, heads, head_dim}).permute({2, 0, 3, 1, 4});
    auto scores = parts[0].matmul(parts[1].transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim));
    if (causal) {
      auto later = torch::ones({length, length}, x.options().dtype(torch::kBool)).triu(1);
      scores = scores.masked_fill(later, -std::numeric_limits<double>::infinity());
    }
    auto attended = torch::dropout(torch::softmax(scores, -1), dropout, is_training()).matmul(parts[2]);
    auto h = x + torch::dropout(proj(attended.transpose(1, 2).reshape({batch, length, dim})), dropout, is_training());
    auto mlp = fc2(torch::dropout(torch::gelu(fc1(norm2(h))), dropout, is_training()));
    return h + torch::dropout(mlp, dropout, is_training());
  }
  int64_t dim, heads;
  double dropout;
  bool causal;
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(TransformerBlock);

/// `blocks` (TransformerBlocks) applied in turn to `x`. Read from the list
/// at each call, not kept aside: a clone (DataParallel's replicas) fills the
/// list it made in reset() with the original's blocks, in place.
inline torch::Tensor run_blocks(torch::nn::ModuleList& blocks, torch::Tensor x) {
  for (const auto& block : *blocks) {
    x = block->as<TransformerBlockImpl>()->forward(x);
  }
  return x;
}

/// A Vision Transformer for 1x28x28 images: 4x4 patches (49 of them) and a
/// class token, learned position embeddings, pre-norm blocks, and a linear
/// head on the class token. With `checkpointed`, each block is a segment of
/// lockstep::checkpoint: its activations are made again in backward.
struct VisionTransformerImpl : torch::nn::Cloneable<VisionTransformerImpl> {
  explicit VisionTransformerImpl(int64_t dim = 64, int64_t depth = 4, int64_t heads = 4, double dropout = 0.1,
                                 bool checkpointed = false)
      : dim(dim), depth(depth), heads(heads), dropout(dropout), checkpointed(checkpointed) {
    reset();
  }
  void reset() override {
    patch = register_module("patch", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, dim, 4).stride(4)));
    cls_token = register_parameter("cls_token", torch::zeros({1, 1, dim}));
    pos_embed = register_parameter("pos_embed", torch::randn({1, 50, dim}) * 0.02);
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < depth; ++i) {
      TransformerBlock block(dim, heads, dropout);
      block->set_activation_checkpointing(checkpointed);
      blocks->push_back(block);
    }
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    head = register_module("head", torch::nn::Linear(dim, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto tokens = patch(x).flatten(2).transpose(1, 2); // [batch, 49, dim]
    tokens = torch::cat({cls_token.expand({x.size(0), 1, dim}), tokens}, 1) + pos_embed;
    tokens = torch::dropout(tokens, dropout, is_training());
    tokens = run_blocks(blocks, tokens);
    return head(norm(tokens.select(1, 0)));
  }
  int64_t dim, depth, heads;
  double dropout;
  bool checkpointed;
  torch::nn::Conv2d patch{nullptr};
  torch::Tensor cls_token, pos_embed;
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(VisionTransformer);

/// A decoder-only language model: token and learned position embeddings,
/// causal pre-norm blocks, a final LayerNorm, and logits from the token
/// embedding itself (tied, as GPT-2's). Takes [batch, length] token ids,
/// length at most `context`; gives [batch, length, vocab] logits, position
/// t's for the token after t. With `checkpointed`, each block is a segment
/// of lockstep::checkpoint.
struct GptImpl : torch::nn::Cloneable<GptImpl> {
  explicit GptImpl(int64_t vocab = 256, int64_t context = 128, int64_t dim = 128, int64_t depth = 4,
                   int64_t heads = 4, double dropout = 0.1, bool checkpointed = false)
      : vocab(vocab), context(context), dim(dim), depth(depth), heads(heads), dropout(dropout),
        checkpointed(checkpointed) {
    reset();
  }
  void reset() override {
    wte = register_module("wte", torch::nn::Embedding(vocab, dim));
    {
      torch::NoGradGuard no_grad;
      wte->weight.normal_(0, 0.02); // GPT-2's: the head shares it, and N(0, 1) logits start far from uniform
    }
    wpe = register_parameter("wpe", torch::randn({context, dim}) * 0.02);
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < depth; ++i) {
      TransformerBlock block(dim, heads, dropout, /*causal=*/true);
      block->set_activation_checkpointing(checkpointed);
      blocks->push_back(block);
    }
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
  }
  torch::Tensor forward(const torch::Tensor& tokens) {
    TORCH_CHECK(tokens.dim() == 2 && tokens.size(1) <= context, "Gpt: takes [batch, length] token ids with length at "
                "most its context ", context, "; got a tensor of shape ", tokens.sizes(), ".");
    auto h = torch::dropout(wte(tokens) + wpe.narrow(0, 0, tokens.size(1)), dropout, is_training());
    h = run_blocks(blocks, h);
    return torch::linear(norm(h), wte->weight);
  }
  int64_t vocab, context, dim, depth, heads;
  double dropout;
  bool checkpointed;
  torch::nn::Embedding wte{nullptr};
  torch::Tensor wpe;
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(Gpt);

/// lockstep-train's model: --model cnn (ConvNet), vit (VisionTransformer)
/// or gpt (Gpt over bytes, sequences of `context`), whose layers it holds
/// under their own names, so that its parameters, checkpoints and
/// safetensors files are the chosen model's.
struct TrainerNetImpl : torch::nn::Cloneable<TrainerNetImpl> {
  explicit TrainerNetImpl(std::string kind = "cnn", bool checkpointed = false, double dropout = 0.1,
                          int64_t context = 128)
      : kind(std::move(kind)), checkpointed(checkpointed), dropout(dropout), context(context) {
    reset();
  }
  void reset() override {
    if (kind == "vit") {
      vit = VisionTransformer(64, 4, 4, dropout, checkpointed);
      adopt(*vit);
    } else if (kind == "gpt") {
      gpt = Gpt(256, context, 128, 4, 4, dropout, checkpointed);
      adopt(*gpt);
    } else {
      cnn = ConvNet();
      adopt(*cnn);
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return vit ? vit->forward(x) : gpt ? gpt->forward(x) : cnn->forward(x);
  }
  /// The chosen model too: it is not a child (its children are this
  /// module's), and its own dropout reads its own mode.
  void train(bool on = true) override {
    torch::nn::Module::train(on);
    if (cnn) {
      cnn->train(on);
    }
    if (vit) {
      vit->train(on);
    }
    if (gpt) {
      gpt->train(on);
    }
  }
  /// The units FullyShardedDataParallel shards by default: each block of a
  /// transformer; each direct child of the CNN.
  std::vector<std::string> units() const {
    const int64_t depth = vit ? vit->depth : gpt ? gpt->depth : 0;
    std::vector<std::string> paths;
    for (int64_t i = 0; i < depth; ++i) {
      paths.push_back("blocks." + std::to_string(i));
    }
    return paths;
  }
  std::string kind;
  bool checkpointed;
  double dropout;
  int64_t context;
  ConvNet cnn{nullptr};
  VisionTransformer vit{nullptr};
  Gpt gpt{nullptr};

 private:
  void adopt(torch::nn::Module& model) {
    for (const auto& child : model.named_children()) {
      register_module(child.key(), child.value());
    }
    for (const auto& param : model.named_parameters(/*recurse=*/false)) {
      register_parameter(param.key(), param.value());
    }
  }
};
TORCH_MODULE(TrainerNet);

/// For saved weights whose tensor `name` has the shape `there` where this
/// trainer's model has `here`: the flag behind the difference and its value
/// to give, in words; "" when no flag explains it. The GPT's position table
/// `wpe` has a row per token of --context.
inline std::string shape_flag_hint(const std::string& name, c10::IntArrayRef there, c10::IntArrayRef here) {
  if (name != "wpe" || there.size() != 2 || here.size() != 2 || there[0] == here[0] || there[1] != here[1]) {
    return "";
  }
  return "'wpe', the GPT's position table, has a row per token of --context: these weights were written with "
         "--context " + std::to_string(there[0]) + ", and this run has --context " + std::to_string(here[0]) +
         ". Give --context " + std::to_string(there[0]) + " to go on from them.";
}

/// The MLP 784-1024-1024-10.
inline torch::nn::Sequential make_mlp() {
  return torch::nn::Sequential(
      torch::nn::Linear(784, 1024), torch::nn::ReLU(), torch::nn::Linear(1024, 1024), torch::nn::ReLU(),
      torch::nn::Linear(1024, 10));
}

} // namespace examples
} // namespace lockstep
