#include "paratrain/models/gpt.h"

#include "hf_names.h"
#include "paratrain/models/conv1d.h"
#include "paratrain/parallel/module_hooks.h"
#include "paratrain/parallel/tensor_parallel.h"

#include <torch/torch.h>

#include <cmath>
#include <iterator>
#include <limits>
#include <memory>
#include <ostream>
#include <utility>
#include <vector>

// Note [The tied head of a cloned GPT]
// The head multiplies by embed.wte.weight without registering it, so that parameters() lists the
// tensor once (optimizers, DDP's buckets and sharding would otherwise see it twice). A handle that
// is not registered is not cloned either: Cloneable::clone would give the head's copy the
// original's embedding, and a DataParallel replica on another device would multiply by the
// weight on devices[0]. Sequential::clone clones its children in order, "embed" before "head", on
// one thread; so the embedding's clone() leaves {original, copy} in a thread-local slot, and the
// head's clone() ties itself to that copy when the original is its own embedding. A head cloned
// on its own keeps the original's embedding, as the tensor it is tied to.

namespace paratrain {
namespace models {
namespace {

namespace nn = torch::nn;

struct GptPreset {
  const char* name;
  int64_t layers, width, heads;
};
// Hugging Face's configs (n_layer, n_embd, n_head); vocab 50257 and context 1024 for all four.
constexpr GptPreset kGptPresets[] = {
    {"gpt2", 12, 768, 12},
    {"gpt2-medium", 24, 1024, 16},
    {"gpt2-large", 36, 1280, 20},
    {"gpt2-xl", 48, 1600, 25},
};

constexpr double kGptInitStd = 0.02;  // GPT-2's initializer_range

// Set while a gpt() with defer_init builds: the modules allocate their large tensors and write
// nothing (gpt_init_weights writes them later, in the same order).
thread_local bool building_deferred = false;
constexpr double kGptLayerNormEps = 1e-5;

void check_gpt_options(const GptOptions& o) {
  TORCH_CHECK(o.layers() >= 1, "gpt: layers must be >= 1, got ", o.layers());
  TORCH_CHECK(o.width() >= 1, "gpt: width must be >= 1, got ", o.width());
  TORCH_CHECK(o.heads() >= 1, "gpt: heads must be >= 1, got ", o.heads());
  TORCH_CHECK(o.vocab() >= 1, "gpt: vocab must be >= 1, got ", o.vocab());
  TORCH_CHECK(o.context() >= 1, "gpt: context must be >= 1, got ", o.context());
  TORCH_CHECK(o.width() % o.heads() == 0, "gpt: width ", o.width(), " is not divisible by heads ",
              o.heads(), "; each head takes width / heads of the features");
  TORCH_CHECK(o.dropout() >= 0 && o.dropout() < 1, "gpt: dropout must be in [0, 1), got ",
              o.dropout());
}

// torch::nn::LayerNorm with GPT-2's eps whose forward takes forward hooks (SequenceParallel), and
// which clones as itself (a Sequential's clone casts each child's clone back to its type).
struct GptLayerNormImpl : nn::LayerNormImpl {
  explicit GptLayerNormImpl(int64_t width)
      : nn::LayerNormImpl(nn::LayerNormOptions({width}).eps(kGptLayerNormEps)) {}
  explicit GptLayerNormImpl(const nn::LayerNormImpl& copy) : nn::LayerNormImpl(copy) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return call_with_hooks(
        *this, x, [this](const torch::Tensor& in) { return nn::LayerNormImpl::forward(in); });
  }
  std::shared_ptr<nn::Module> clone(
      const c10::optional<torch::Device>& device = c10::nullopt) const override {
    auto copy = std::dynamic_pointer_cast<nn::LayerNormImpl>(nn::LayerNormImpl::clone(device));
    return std::make_shared<GptLayerNormImpl>(*copy);
  }
};
TORCH_MODULE(GptLayerNorm);

// The residual projections' std: GPT-2 scales them by 1/sqrt(2 * layers), as each block adds two
// of them to the residual stream.
double gpt_residual_std(const GptOptions& o) {
  return kGptInitStd / std::sqrt(2.0 * static_cast<double>(o.layers()));
}

struct GptEmbeddingImpl;
struct LastEmbeddingClone {
  const GptEmbeddingImpl* original = nullptr;
  std::weak_ptr<GptEmbeddingImpl> copy;
};
// Note [The tied head of a cloned GPT]
LastEmbeddingClone& last_embedding_clone() {
  static thread_local LastEmbeddingClone last;
  return last;
}

// Token plus position embeddings, then dropout: [B, T] token ids -> [B, T, width].
struct GptEmbeddingImpl : nn::Cloneable<GptEmbeddingImpl> {
  explicit GptEmbeddingImpl(const GptOptions& options) : options(options) { reset(); }
  void reset() override {
    const bool deferred = building_deferred;
    // A given _weight is taken as it is: Embedding's own normal(0, 1) waits for init_weights.
    auto embedding = [deferred](int64_t rows, int64_t width) {
      auto o = nn::EmbeddingOptions(rows, width);
      return nn::Embedding(deferred ? o._weight(torch::empty({rows, width})) : o);
    };
    wte = register_module("wte", embedding(options.vocab(), options.width()));
    wpe = register_module("wpe", embedding(options.context(), options.width()));
    if (!deferred) {
      torch::NoGradGuard no_grad;
      wte->weight.normal_(0, kGptInitStd);
      wpe->weight.normal_(0, kGptInitStd);
    }
  }
  // The draws reset() makes when not deferred: Embedding's reset_parameters (normal(0, 1)) for
  // wte, then wpe, then GPT-2's normal(0, 0.02) over both.
  void init_weights() {
    torch::NoGradGuard no_grad;
    wte->weight.normal_();
    wpe->weight.normal_();
    wte->weight.normal_(0, kGptInitStd);
    wpe->weight.normal_(0, kGptInitStd);
  }
  torch::Tensor forward(const torch::Tensor& tokens) {
    return call_with_hooks(*this, tokens, [this](const torch::Tensor& in) { return embed(in); });
  }
  torch::Tensor embed(const torch::Tensor& tokens) {
    TORCH_CHECK(tokens.dim() == 2,
                "gpt: the input must be token ids of shape [batch, tokens], got shape ",
                tokens.sizes());
    TORCH_CHECK(c10::isIntegralType(tokens.scalar_type(), /*includeBool=*/false),
                "gpt: the input must be integer token ids (int64), got ", tokens.scalar_type());
    const int64_t length = tokens.size(1);
    TORCH_CHECK(length <= options.context(), "gpt: the input has ", length,
                " tokens per sequence, but the model's context is ", options.context(),
                "; shorten the sequences or build the model with a longer context");
    const torch::Tensor ids = tokens.to(torch::kLong);  // Embedding takes int64 (or int32) only
    const torch::Tensor positions = torch::arange(length, ids.options());
    const torch::Tensor words =
        call_with_hooks(*wte, ids, [this](const torch::Tensor& in) { return wte(in); });
    return torch::dropout(words + wpe(positions), options.dropout(), is_training());
  }
  std::shared_ptr<nn::Module> clone(
      const c10::optional<torch::Device>& device = c10::nullopt) const override {
    auto copy = nn::Cloneable<GptEmbeddingImpl>::clone(device);
    last_embedding_clone() = {this, std::dynamic_pointer_cast<GptEmbeddingImpl>(copy)};
    return copy;
  }
  GptOptions options;
  nn::Embedding wte{nullptr}, wpe{nullptr};
};
TORCH_MODULE(GptEmbedding);

// Causal self-attention: each position attends to itself and the positions before it.
struct GptAttentionImpl : nn::Cloneable<GptAttentionImpl> {
  explicit GptAttentionImpl(const GptOptions& options) : options(options) { reset(); }
  void reset() override {
    const int64_t width = options.width();
    c_attn = register_module("c_attn", Conv1D(width, 3 * width, kGptInitStd));
    c_proj = register_module("c_proj", Conv1D(width, width, gpt_residual_std(options)));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return call_with_hooks(*this, x, [this](const torch::Tensor& in) { return attend(in); });
  }
  // The heads are those c_attn gives: all of them, or this rank's under tensor parallelism
  // (ColwiseParallel with chunks 3 keeps each rank's heads of q, k and v).
  torch::Tensor attend(const torch::Tensor& x) {
    const int64_t head_dim = options.width() / options.heads();
    // The whole sequence: under sequence parallelism x holds this rank's part and c_attn
    // gathers it.
    const torch::Tensor fused = c_attn(x);
    const int64_t batch = fused.size(0), length = fused.size(1);
    const int64_t width = fused.size(2) / 3, heads = width / head_dim;
    const auto qkv = fused.split(width, /*dim=*/2);
    auto split_heads = [&](const torch::Tensor& t) {
      return t.view({batch, length, heads, head_dim}).transpose(1, 2);  // [B, heads, T, head_dim]
    };
    const torch::Tensor q = split_heads(qkv[0]), k = split_heads(qkv[1]), v = split_heads(qkv[2]);
    torch::Tensor scores =
        torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(head_dim)));
    // Built per forward rather than kept: a registered buffer would land in state dicts and in
    // sharding, and a T x T bool tensor costs little beside the B x heads x T x T scores.
    const torch::Tensor future =
        torch::ones({length, length}, x.options().dtype(torch::kBool)).triu(1);
    scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
    // Under tensor parallelism a rank's heads, and (sequence parallel) its part of the sequence,
    // draw masks of their own.
    const torch::Tensor probs =
        tensor_parallel_dropout(torch::softmax(scores, -1), options.dropout(), is_training(),
                                tensor_parallel_sharded_output(*c_attn));
    const torch::Tensor y = torch::matmul(probs, v).transpose(1, 2).reshape({batch, length, width});
    return tensor_parallel_dropout(c_proj(y), options.dropout(), is_training(),
                                   tensor_parallel_sharded_output(*c_proj));
  }
  GptOptions options;
  Conv1D c_attn{nullptr}, c_proj{nullptr};
};
TORCH_MODULE(GptAttention);

// The 4x MLP with GPT-2's tanh GELU (Hugging Face's gelu_new).
struct GptMlpImpl : nn::Cloneable<GptMlpImpl> {
  explicit GptMlpImpl(const GptOptions& options) : options(options) { reset(); }
  void reset() override {
    const int64_t width = options.width();
    c_fc = register_module("c_fc", Conv1D(width, 4 * width, kGptInitStd));
    c_proj = register_module("c_proj", Conv1D(4 * width, width, gpt_residual_std(options)));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return call_with_hooks(*this, x, [this](const torch::Tensor& in) {
      const torch::Tensor h = torch::gelu(c_fc(in), "tanh");
      return tensor_parallel_dropout(c_proj(h), options.dropout(), is_training(),
                                     tensor_parallel_sharded_output(*c_proj));
    });
  }
  GptOptions options;
  Conv1D c_fc{nullptr}, c_proj{nullptr};
};
TORCH_MODULE(GptMlp);

// A pre-LayerNorm block: x + attn(ln_1(x)), then x + mlp(ln_2(x)).
struct GptBlockImpl : nn::Cloneable<GptBlockImpl> {
  explicit GptBlockImpl(const GptOptions& options) : options(options) { reset(); }
  void reset() override {
    ln_1 = register_module("ln_1", GptLayerNorm(options.width()));
    attn = register_module("attn", GptAttention(options));
    ln_2 = register_module("ln_2", GptLayerNorm(options.width()));
    mlp = register_module("mlp", GptMlp(options));
  }
  torch::Tensor forward(const torch::Tensor& input) {
    return call_with_hooks(*this, input, [this](torch::Tensor x) {
      x = x + attn(ln_1(x));
      return x + mlp(ln_2(x));
    });
  }
  GptOptions options;
  GptLayerNorm ln_1{nullptr}, ln_2{nullptr};
  GptAttention attn{nullptr};
  GptMlp mlp{nullptr};
};
TORCH_MODULE(GptBlock);

// logits = x @ wte^T with the embedding's own weight, registered nowhere here (Note [The tied
// head of a cloned GPT]). On another device than the embedding (a pipeline stage of its own in
// one process) the weight is copied over per forward; autograd carries the gradient back.
struct GptHeadImpl : nn::Cloneable<GptHeadImpl> {
  explicit GptHeadImpl(GptEmbedding embedding) : embedding(std::move(embedding)) {}
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) {
    return call_with_hooks(*this, x, [this](const torch::Tensor& in) {
      torch::Tensor weight = embedding->wte->weight;
      if (weight.device() != in.device()) {
        weight = weight.to(in.device());
      }
      return torch::linear(in, weight);
    });
  }
  std::shared_ptr<nn::Module> clone(
      const c10::optional<torch::Device>& device = c10::nullopt) const override {
    auto copy = std::dynamic_pointer_cast<GptHeadImpl>(nn::Cloneable<GptHeadImpl>::clone(device));
    LastEmbeddingClone& last = last_embedding_clone();
    if (last.original == embedding.get()) {
      if (auto tied = last.copy.lock()) {
        copy->embedding = GptEmbedding(tied);
      }
      last = {};  // taken: a later embedding at the same address is another one
    }
    return copy;
  }
  void pretty_print(std::ostream& stream) const override {
    stream << "GptHead(tied to embed.wte.weight)";
  }
  GptEmbedding embedding;
};
TORCH_MODULE(GptHead);

// "h12" -> true; "h", "h1x", "head" -> false.
bool is_block_name(const std::string& name) {
  return name.size() > 1 && name[0] == 'h' &&
         name.find_first_not_of("0123456789", 1) == std::string::npos;
}

}  // namespace

Conv1DImpl::Conv1DImpl(int64_t in, int64_t out, double init_std)
    : in_(in), out_(out), std_(init_std) {
  reset();
}

void Conv1DImpl::reset() {
  weight = register_parameter("weight", torch::empty({in_, out_}));
  bias = register_parameter("bias", torch::zeros({out_}));
  if (!building_deferred) {
    reset_parameters();
  }
}

void Conv1DImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  bias.zero_();
  weight.normal_(0, std_);
}

void gpt_init_weights(torch::nn::Module& module) {
  // Pre-order, as the constructors ran: a block's c_attn, c_proj, c_fc, then c_proj.
  for (const auto& m : module.modules(/*include_self=*/true)) {
    if (auto* embedding = dynamic_cast<GptEmbeddingImpl*>(m.get())) {
      embedding->init_weights();
    } else if (auto* projection = dynamic_cast<Conv1DImpl*>(m.get())) {
      projection->reset_parameters();
    }
  }
}

torch::Tensor Conv1DImpl::forward(const torch::Tensor& x) {
  return call_with_hooks(*this, x, [this](const torch::Tensor& in) {
    std::vector<int64_t> shape = in.sizes().vec();
    shape.back() = weight.size(1);
    return torch::addmm(bias, in.reshape({-1, weight.size(0)}), weight).view(shape);
  });
}

void Conv1DImpl::pretty_print(std::ostream& stream) const {
  stream << "Conv1D(in=" << in_ << ", out=" << out_ << ")";
}

GptOptions gpt_options(const std::string& preset) {
  for (const auto& p : kGptPresets) {
    if (preset == p.name) {
      return GptOptions().layers(p.layers).width(p.width).heads(p.heads);
    }
  }
  std::string known;
  const size_t count = std::size(kGptPresets);
  for (size_t i = 0; i < count; ++i) {
    known += std::string(i == 0 ? "" : i + 1 == count ? " or " : ", ") + kGptPresets[i].name;
  }
  TORCH_CHECK(false, "gpt: no preset '", preset, "': choose ", known);
}

std::vector<std::string> gpt_presets() {
  std::vector<std::string> out;
  for (const auto& p : kGptPresets) {
    out.emplace_back(p.name);
  }
  return out;
}

torch::nn::Sequential gpt(const GptOptions& options) {
  check_gpt_options(options);
  struct Deferring {
    explicit Deferring(bool on) { building_deferred = on; }
    ~Deferring() { building_deferred = false; }
  } deferring(options.defer_init());
  nn::Sequential net;
  GptEmbedding embed(options);
  net->push_back("embed", embed);
  for (int64_t i = 0; i < options.layers(); ++i) {
    net->push_back("h" + std::to_string(i), GptBlock(options));
  }
  net->push_back("ln_f", GptLayerNorm(options.width()));
  net->push_back("head", GptHead(embed));
  return net;
}

int64_t gpt_parameter_count(const GptOptions& options) {
  check_gpt_options(options);
  const int64_t w = options.width();
  // Per block: two LayerNorms (2w each), c_attn (w x 3w + 3w), attn.c_proj (w x w + w), c_fc
  // (w x 4w + 4w), mlp.c_proj (4w x w + w): 12 w^2 + 13 w.
  const double approximate = (static_cast<double>(options.vocab()) + options.context()) * w +
                             options.layers() * (12.0 * w * w + 13.0 * w) + 2.0 * w;
  TORCH_CHECK(approximate < 9e18, "gpt: a model of these shapes would have about ", approximate,
              " parameters, more than an int64 counts");
  const int64_t embeddings = (options.vocab() + options.context()) * w;
  const int64_t per_block = 12 * w * w + 13 * w;
  return embeddings + options.layers() * per_block + 2 * w;  // + ln_f; the head has none
}

std::string hf_gpt2_name(const std::string& name) {
  const size_t dot = name.find('.');
  const std::string first = name.substr(0, dot);
  if (dot != std::string::npos) {
    if (first == "embed" &&
        (name.compare(dot + 1, 4, "wte.") == 0 || name.compare(dot + 1, 4, "wpe.") == 0)) {
      return detail::kHfTransformerPrefix + name.substr(dot + 1);
    }
    if (first == "ln_f") {
      return detail::kHfTransformerPrefix + name;
    }
    if (is_block_name(first)) {
      return detail::kHfTransformerPrefix + std::string("h.") + first.substr(1) + name.substr(dot);
    }
  }
  TORCH_CHECK(false, "hf_gpt2_name: '", name,
              "' is not the name of a gpt() parameter (embed.wte.*, embed.wpe.*, h<N>.*, ln_f.*)");
}

GptOptions gpt_options_of(const torch::nn::Sequential& model) {
  const auto children = model->named_children();
  const auto* embed = children.find("embed");
  const auto* embedding = embed == nullptr ? nullptr : (*embed)->as<GptEmbeddingImpl>();
  TORCH_CHECK(embedding != nullptr,
              "gpt: the model is not a gpt() model (it has no GPT embedding named 'embed')");
  return GptOptions(embedding->options).context(embedding->wpe->weight.size(0));
}

int64_t gpt_context(const torch::nn::Sequential& model) {
  const auto children = model->named_children();
  const auto* embed = children.find("embed");
  if (embed == nullptr) {
    return 0;
  }
  const auto* embedding = (*embed)->as<GptEmbeddingImpl>();
  return embedding == nullptr ? 0 : embedding->wpe->weight.size(0);
}

std::vector<std::string> gpt_block_names(const torch::nn::Sequential& model) {
  std::vector<std::string> out;
  for (const auto& child : model->named_children()) {
    if (is_block_name(child.key())) {
      out.push_back(child.key());
    }
  }
  return out;
}

}  // namespace models
}  // namespace paratrain
