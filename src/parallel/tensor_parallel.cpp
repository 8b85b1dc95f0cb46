#include "paratrain/parallel/tensor_parallel.h"

#include "paratrain/parallel/module_hooks.h"

#include <torch/autograd.h>
#include <torch/nn/functional/embedding.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <ATen/Context.h>
#include <ATen/core/Generator.h>

#include <fnmatch.h>

#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <unordered_map>
#include <utility>

// Note [Layouts of gradients]
// Every style gives the gradient of its input in the input's own layout: whole on every rank for
// a Replicate input (a ColwiseParallel layer all-reduces the partial gradients of its features),
// this rank's part for a Shard one. So a layout change only moves whole gradients: a
// PrepareModuleInput from Shard(1) to Replicate all-gathers forward and keeps this rank's part of
// the gradient backward, whatever consumes the gathered tensor (a residual, another layer).
// PyTorch's DTensor can leave a gradient Partial and reduce-scatter it once; here the column-wise
// layers that gather their input themselves (input_layouts Shard(1)) do that instead.

namespace paratrain {
namespace {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The group travels to backward inside the autograd context, as a capsule.
struct TpGroupCapsule : torch::CustomClassHolder {
  explicit TpGroupCapsule(dist::ProcessGroupPtr g) : group(std::move(g)) {}
  dist::ProcessGroupPtr group;
};

int64_t normalized(int64_t dim, const Tensor& x) {
  return dim < 0 ? dim + x.dim() : dim;
}

// A tensor split along `dim` over the group: the sequence (dimension 1) under sequence
// parallelism, features elsewhere.
void check_splits(const Tensor& x, int64_t dim, dist::ProcessGroup& g) {
  TORCH_CHECK(x.size(dim) % g.size() == 0, "tensor parallel: dimension ", dim, " (of shape ",
              x.sizes(), ") does not split over the ", g.size(),
              " ranks of the tensor-parallel group",
              dim == 1 ? "; make the sequence a multiple of " + std::to_string(g.size()) : "");
}

Tensor all_reduce_sum(const Tensor& x, dist::ProcessGroup& g) {
  Tensor y = x.clone(at::MemoryFormat::Contiguous);
  g.allreduce(y)->wait();
  return y;
}

Tensor all_gather_along(const Tensor& x, int64_t dim, dist::ProcessGroup& g) {
  Tensor moved = x.movedim(dim, 0).contiguous();
  std::vector<int64_t> sizes = moved.sizes().vec();
  sizes[0] *= g.size();
  Tensor out = torch::empty(sizes, moved.options());
  g.all_gather_into_tensor(out, moved)->wait();
  return out.movedim(0, dim).contiguous();
}

Tensor reduce_scatter_along(const Tensor& x, int64_t dim, dist::ProcessGroup& g) {
  check_splits(x, dim, g);
  Tensor moved = x.movedim(dim, 0).contiguous();
  std::vector<int64_t> sizes = moved.sizes().vec();
  sizes[0] /= g.size();
  Tensor out = torch::empty(sizes, moved.options());
  g.reduce_scatter_tensor(out, moved, dist::ReduceOp::kSum)->wait();
  return out.movedim(0, dim).contiguous();
}

Tensor chunk_along(const Tensor& x, int64_t dim, dist::ProcessGroup& g) {
  check_splits(x, dim, g);
  const int64_t part = x.size(dim) / g.size();
  return x.narrow(dim, part * g.rank(), part).contiguous();
}

// The collectives between layouts, each with the backward that makes it differentiable.
enum class Comm : int64_t {
  kCopy,           // identity; backward all-reduces (Megatron's f)
  kReduce,         // all-reduce; backward identity (Megatron's g)
  kGather,         // all-gather along dim; backward reduce-scatters (a partial gradient)
  kGatherWhole,    // all-gather along dim; backward keeps this rank's part (a whole gradient)
  kReduceScatter,  // reduce-scatter along dim; backward all-gathers
  kSplit,          // this rank's part along dim; backward all-gathers
};

Tensor run_comm(Comm comm, const Tensor& x, int64_t dim, dist::ProcessGroup& g, bool backward) {
  switch (comm) {
    case Comm::kCopy:
      return backward ? all_reduce_sum(x, g) : x;
    case Comm::kReduce:
      return backward ? x : all_reduce_sum(x, g);
    case Comm::kGather:
      return backward ? reduce_scatter_along(x, dim, g) : all_gather_along(x, dim, g);
    case Comm::kGatherWhole:
      return backward ? chunk_along(x, dim, g) : all_gather_along(x, dim, g);
    case Comm::kReduceScatter:
      return backward ? all_gather_along(x, dim, g) : reduce_scatter_along(x, dim, g);
    case Comm::kSplit:
      return backward ? all_gather_along(x, dim, g) : chunk_along(x, dim, g);
  }
  TORCH_CHECK(false, "tensor parallel: unknown collective");
}

struct TpComm : torch::autograd::Function<TpComm> {
  static Tensor forward(AutogradContext* ctx,
                        const Tensor& x,
                        int64_t comm,
                        int64_t dim,
                        const c10::IValue& capsule) {
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["group"] = capsule;
    auto g = c10::static_intrusive_pointer_cast<TpGroupCapsule>(capsule.toCapsule())->group;
    return run_comm(static_cast<Comm>(comm), x, dim, *g, false);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto g =
        c10::static_intrusive_pointer_cast<TpGroupCapsule>(ctx->saved_data["group"].toCapsule())
            ->group;
    const auto comm = static_cast<Comm>(ctx->saved_data["comm"].toInt());
    const int64_t dim = ctx->saved_data["dim"].toInt();
    return {run_comm(comm, grads[0], dim, *g, true), Tensor(), Tensor(), Tensor()};
  }
};

Tensor comm(Comm kind, const Tensor& x, int64_t dim, const dist::ProcessGroupPtr& g) {
  if (g->size() == 1) {
    return x;
  }
  const c10::IValue capsule = c10::IValue::make_capsule(c10::make_intrusive<TpGroupCapsule>(g));
  return TpComm::apply(x, static_cast<int64_t>(kind), normalized(dim, x), capsule);
}

// A layout change; the gradient comes back whole (Note [Layouts of gradients]).
Tensor relayout(const Tensor& x,
                const Placement& from,
                const Placement& to,
                const dist::ProcessGroupPtr& g) {
  if (from == to) {
    return x;
  }
  if (from.shard && !to.shard) {
    return comm(Comm::kGatherWhole, x, from.dim, g);
  }
  if (!from.shard && to.shard) {
    return comm(Comm::kSplit, x, to.dim, g);
  }
  TORCH_CHECK(false, "tensor parallel: no layout change from ", from.str(), " to ", to.str(),
              "; go through Replicate()");
}

}  // namespace

std::string Placement::str() const {
  return shard ? "Shard(" + std::to_string(dim) + ")" : "Replicate()";
}

torch::Tensor tensor_parallel_all_gather(const torch::Tensor& local,
                                         int64_t dim,
                                         const dist::ProcessGroupPtr& tp) {
  TORCH_CHECK(tp != nullptr, "tensor_parallel_all_gather: the tensor-parallel group is null");
  torch::NoGradGuard no_grad;
  return tp->size() == 1 ? local : all_gather_along(local, normalized(dim, local), *tp);
}

torch::Tensor tensor_parallel_slice(const torch::Tensor& whole,
                                    const TensorParallelShard& shard,
                                    int rank,
                                    int degree) {
  const int64_t dim = normalized(shard.dim, whole);
  const int64_t pieces = shard.chunks * degree;
  TORCH_CHECK(whole.size(dim) % pieces == 0, "tensor parallel: dimension ", dim, " of size ",
              whole.size(dim), " does not split into ", shard.chunks, " x ", degree, " pieces");
  const int64_t part = whole.size(dim) / pieces;
  std::vector<Tensor> mine;
  for (const Tensor& chunk : whole.chunk(shard.chunks, dim)) {
    mine.push_back(chunk.narrow(dim, part * rank, part));
  }
  return torch::cat(mine, dim).contiguous();
}

namespace {

// Note [Sequence-parallel linear layers]
// A column-parallel layer whose input is split along the sequence all-gathers it first. Kept for
// backward, the gathered input would hold the whole sequence's activations on every rank, which
// sequence parallelism is there to avoid; so, as Megatron-LM's sequence-parallel linear layers do,
// only this rank's part is kept, and backward all-gathers it again to compute the weight's
// gradient (one more all-gather per such layer: see bench/parallel.cpp's formula). The input's
// gradient, partial on every rank, is reduce-scattered back to the parts.
struct GatheredLinear : torch::autograd::Function<GatheredLinear> {
  static Tensor forward(AutogradContext* ctx,
                        const Tensor& local,
                        const Tensor& weight,
                        const Tensor& bias,
                        const c10::IValue& capsule,
                        int64_t dim,
                        bool in_out) {
    auto g = c10::static_intrusive_pointer_cast<TpGroupCapsule>(capsule.toCapsule())->group;
    ctx->save_for_backward({local, weight});
    ctx->saved_data["group"] = capsule;
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["in_out"] = in_out;
    ctx->saved_data["bias"] = bias.defined();
    const Tensor x = all_gather_along(local, dim, *g);
    if (!in_out) {
      return torch::linear(x, weight, bias);
    }
    // As Conv1D computes it (addmm), so that autocast casts alike with and without gathering.
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = weight.size(1);
    const Tensor x2 = x.reshape({-1, x.size(-1)});
    return (bias.defined() ? torch::addmm(bias, x2, weight) : torch::mm(x2, weight)).view(shape);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto g =
        c10::static_intrusive_pointer_cast<TpGroupCapsule>(ctx->saved_data["group"].toCapsule())
            ->group;
    const auto saved = ctx->get_saved_variables();
    const Tensor& weight = saved[1];
    const int64_t dim = ctx->saved_data["dim"].toInt();
    const bool in_out = ctx->saved_data["in_out"].toBool();
    // Backward runs outside autocast: compute in the dtype the forward gave (dy's), and return
    // each gradient in its input's dtype.
    const Tensor dy = grads[0];
    const Tensor x = all_gather_along(saved[0], dim, *g).to(dy.scalar_type());  // gathered again
    const Tensor w = weight.to(dy.scalar_type());
    const Tensor dx = in_out ? torch::matmul(dy, w.t()) : torch::matmul(dy, w);
    const Tensor x2 = x.reshape({-1, x.size(-1)}), dy2 = dy.reshape({-1, dy.size(-1)});
    const Tensor dw = in_out ? torch::matmul(x2.t(), dy2) : torch::matmul(dy2.t(), x2);
    const Tensor db = ctx->saved_data["bias"].toBool() ? dy2.sum(0) : Tensor();
    // Summed over the ranks in the input's dtype (fp32 under autocast), not the compute dtype.
    return {reduce_scatter_along(dx.to(saved[0].scalar_type()), dim, *g),
            dw.to(weight.scalar_type()),
            db.defined() ? db.to(weight.scalar_type()) : db,
            Tensor(),
            Tensor(),
            Tensor()};
  }
};

// What a style may be applied to.
// kInOut is a LinearLayer whose weight is [in, out] (Conv1D); one with [out, in] is a kLinear.
enum class Kind { kLinear, kInOut, kEmbedding, kLayerNorm, kNoParameters, kOther };

Kind kind_of(torch::nn::Module& m) {
  if (m.as<torch::nn::LinearImpl>() != nullptr) {
    return Kind::kLinear;
  }
  if (const auto* linear = dynamic_cast<const LinearLayer*>(&m)) {
    return linear->weight_is_in_out() ? Kind::kInOut : Kind::kLinear;
  }
  if (m.as<torch::nn::EmbeddingImpl>() != nullptr) {
    return Kind::kEmbedding;
  }
  if (m.as<torch::nn::LayerNormImpl>() != nullptr) {
    return Kind::kLayerNorm;
  }
  return m.parameters(/*recurse=*/true).empty() ? Kind::kNoParameters : Kind::kOther;
}

struct Target {
  std::string name;  // as named_modules() gives it
  torch::nn::Module* module;
  const dist::ProcessGroupPtr& group;
  TensorParallelLayout& layout;
  bool dry;  // check only: parallelize_module checks every entry before it changes anything
  std::set<const c10::TensorImpl*>* split;  // the dry pass's: each tensor split once (ties)
};

[[noreturn]] void unsupported(const Target& t, const char* style, const char* kinds) {
  TORCH_CHECK(false, "parallelize_module: ", style, " applies to ", kinds, "; '", t.name, "' is a ",
              t.module->name());
}

// The modules whose output parallelize_module leaves split over the tensor-parallel ranks, with
// this rank's place: libtorch's Module has no slot for it, so a table keyed by the module's
// address holds it, with a weak pointer to tell a live module from a later one at that address.
struct ShardedOutputs {
  std::mutex mutex;
  std::unordered_map<const torch::nn::Module*,
                     std::pair<std::weak_ptr<const torch::nn::Module>, int>>
      rank;
};

ShardedOutputs& sharded_outputs() {
  static ShardedOutputs table;
  return table;
}

void mark_sharded_output(const torch::nn::Module& module, int rank) {
  ShardedOutputs& t = sharded_outputs();
  std::lock_guard<std::mutex> lock(t.mutex);
  for (auto it = t.rank.begin(); it != t.rank.end();) {  // modules that are gone
    it = it->second.first.expired() ? t.rank.erase(it) : std::next(it);
  }
  t.rank[&module] = {module.shared_from_this(), rank};
}

// Replaces `param` (named `local` in t.module) by this rank's part.
void shard_parameter(const Target& t, const std::string& local, const TensorParallelShard& s) {
  auto params = t.module->named_parameters(/*recurse=*/false);
  torch::Tensor* p = params.find(local);
  TORCH_CHECK(p != nullptr && p->defined(), "parallelize_module: '", t.name, "' has no ", local);
  const std::string full = t.name + "." + local;
  TORCH_CHECK(t.layout.shards.count(full) == 0, "parallelize_module: ", full,
              " is split twice; name each module in one plan entry");
  const int64_t dim = normalized(s.dim, *p);
  const int64_t pieces = s.chunks * t.group->size();
  TORCH_CHECK(p->size(dim) % pieces == 0, "parallelize_module: ", full, " has ", p->size(dim),
              " rows along dimension ", dim, ", which do not split ",
              s.chunks > 1 ? "(in " + std::to_string(s.chunks) + " chunks) " : std::string(),
              "over a tensor-parallel degree of ", t.group->size());
  t.layout.shards[full] = {dim, s.chunks};
  TORCH_CHECK(!t.dry || t.split->insert(p->unsafeGetTensorImpl()).second,
              "parallelize_module: ", full,
              " is a tensor the plan already splits under another name (tied weights): "
              "name one of them");
  if (!t.dry) {
    torch::NoGradGuard no_grad;
    p->set_data(tensor_parallel_slice(*p, s, t.group->rank(), t.group->size()));
  }
}

// A module's own parameter, or an undefined tensor.
torch::Tensor own(torch::nn::Module* m, const std::string& name) {
  const auto params = m->named_parameters(/*recurse=*/false);
  const torch::Tensor* p = params.find(name);
  return p == nullptr ? torch::Tensor() : *p;
}

void apply(const Target& t, const ColwiseParallel& style) {
  const Kind kind = kind_of(*t.module);
  const int64_t chunks = style.chunks();
  TORCH_CHECK(chunks >= 1, "parallelize_module: ColwiseParallel chunks must be >= 1, got ", chunks);
  TORCH_CHECK(style.output_layouts().shard || chunks == 1, "parallelize_module: '", t.name,
              "': a chunked ColwiseParallel keeps its output Shard(-1)");
  TORCH_CHECK(!style.input_layouts().shard || style.input_layouts().dim == 1,
              "parallelize_module: ColwiseParallel's input is Replicate() or Shard(1), got ",
              style.input_layouts().str());
  TORCH_CHECK(!style.output_layouts().shard || style.output_layouts().dim == -1,
              "parallelize_module: ColwiseParallel's output is Shard(-1) or Replicate(), got ",
              style.output_layouts().str());
  TORCH_CHECK(kind != Kind::kEmbedding || !style.input_layouts().shard, "parallelize_module: '",
              t.name, "': an Embedding's input (token ids) is Replicate()");
  if (kind == Kind::kLinear) {
    shard_parameter(t, "weight", {0, chunks});
    if (own(t.module, "bias").defined()) {
      shard_parameter(t, "bias", {0, chunks});
    }
  } else if (kind == Kind::kInOut) {
    shard_parameter(t, "weight", {1, chunks});
    if (own(t.module, "bias").defined()) {
      shard_parameter(t, "bias", {0, chunks});
    }
  } else if (kind == Kind::kEmbedding) {
    shard_parameter(t, "weight", {1, chunks});
  } else if (kind != Kind::kNoParameters) {
    unsupported(t, "ColwiseParallel",
                "Linear, Conv1D, Embedding or a module without parameters (a tied head)");
  }
  const dist::ProcessGroupPtr g = t.group;
  if (t.dry) {
    return;
  }
  torch::nn::Module* m = t.module;
  if (style.output_layouts().shard) {
    mark_sharded_output(*m, g->rank());
  }
  const bool linear = kind == Kind::kLinear || kind == Kind::kInOut;
  register_forward_wrapper(*m, [g, m, style, linear, kind](const Tensor& x,
                                                           const ForwardFunction& forward) {
    Tensor y;
    if (linear && style.input_layouts().shard && g->size() > 1) {
      // Note [Sequence-parallel linear layers]
      const c10::IValue capsule = c10::IValue::make_capsule(c10::make_intrusive<TpGroupCapsule>(g));
      y = GatheredLinear::apply(x, own(m, "weight"), own(m, "bias"), capsule,
                                normalized(style.input_layouts().dim, x), kind == Kind::kInOut);
    } else {
      Tensor in = x;
      if (x.is_floating_point()) {  // token ids need no collective
        if (style.input_layouts().shard) {
          in = comm(Comm::kGather, x, style.input_layouts().dim, g);
        } else {
          in = comm(Comm::kCopy, x, 0, g);
        }
      }
      y = forward(in);
    }
    return style.output_layouts().shard ? y : comm(Comm::kGatherWhole, y, -1, g);
  });
}

// The output of a rowwise module before its bias: the partial product of this rank's rows.
Tensor rowwise_partial(Kind kind, torch::nn::Module* m, const Tensor& x, int rank, int degree) {
  const Tensor weight = own(m, "weight");
  if (kind == Kind::kLinear) {
    return torch::linear(x, weight);
  }
  if (kind == Kind::kInOut) {
    return torch::matmul(x, weight);
  }
  // An Embedding split by rows: ids outside this rank's rows look up nothing. An id outside every
  // rank's rows is an error, as Embedding's own index check.
  const int64_t rows = weight.size(0), first = rows * rank;
  if (x.numel() > 0) {
    const Tensor bounds = torch::stack({x.min(), x.max()}).cpu();  // one read of the device
    const int64_t low = bounds[0].item<int64_t>(), high = bounds[1].item<int64_t>();
    TORCH_CHECK(low >= 0 && high < rows * degree, "Embedding (split by rows over ", degree,
                " ranks): index ", low < 0 ? low : high, " is out of range for ", rows * degree,
                " rows");
  }
  const Tensor outside = (x < first).logical_or(x >= first + rows);
  const Tensor ids = (x - first).masked_fill(outside, 0);
  return torch::nn::functional::embedding(ids, weight).masked_fill(outside.unsqueeze(-1), 0);
}

void apply(const Target& t, const RowwiseParallel& style) {
  const Kind kind = kind_of(*t.module);
  if (kind == Kind::kLinear) {
    shard_parameter(t, "weight", {1, 1});
  } else if (kind == Kind::kInOut) {
    shard_parameter(t, "weight", {0, 1});
  } else if (kind == Kind::kEmbedding) {
    const auto* e = t.module->as<torch::nn::EmbeddingImpl>();
    TORCH_CHECK(!e->options.padding_idx() && !e->options.max_norm(), "parallelize_module: '",
                t.name, "': RowwiseParallel takes an Embedding without padding_idx or max_norm");
    TORCH_CHECK(!style.input_layouts().shard, "parallelize_module: '", t.name,
                "': an Embedding's input (token ids) is Replicate()");
    shard_parameter(t, "weight", {0, 1});
  } else {
    unsupported(t, "RowwiseParallel", "Linear, Conv1D or Embedding");
  }
  TORCH_CHECK(kind == Kind::kEmbedding || style.input_layouts() == Shard(-1) ||
                  style.input_layouts() == Replicate(),
              "parallelize_module: RowwiseParallel's input is Shard(-1) or Replicate(), got ",
              style.input_layouts().str());
  TORCH_CHECK(!style.output_layouts().shard || style.output_layouts().dim == 1,
              "parallelize_module: RowwiseParallel's output is Replicate() or Shard(1), got ",
              style.output_layouts().str());
  if (t.dry) {
    return;
  }
  const dist::ProcessGroupPtr g = t.group;
  torch::nn::Module* m = t.module;
  if (style.output_layouts().shard) {
    mark_sharded_output(*m, g->rank());
  }
  register_forward_wrapper(*m, [g, m, kind, style](const Tensor& x, const ForwardFunction&) {
    const Tensor in =
        kind != Kind::kEmbedding && !style.input_layouts().shard ? comm(Comm::kSplit, x, -1, g) : x;
    Tensor y = rowwise_partial(kind, m, in, g->rank(), g->size());
    const Tensor bias = own(m, "bias");
    if (!style.output_layouts().shard) {
      y = comm(Comm::kReduce, y, 0, g);
      return bias.defined() ? y + bias : y;
    }
    y = comm(Comm::kReduceScatter, y, style.output_layouts().dim, g);
    // Each rank adds the bias to its part of the sequence: its gradient is summed over them.
    return bias.defined() ? y + comm(Comm::kCopy, bias, 0, g) : y;
  });
}

void apply(const Target& t, const SequenceParallel& style) {
  const Kind kind = kind_of(*t.module);
  if (kind != Kind::kLayerNorm && kind != Kind::kNoParameters) {
    unsupported(t, "SequenceParallel", "LayerNorm or a module without parameters (dropout)");
  }
  TORCH_CHECK(style.sequence_dim() == 1,
              "parallelize_module: SequenceParallel splits the "
              "sequence, dimension 1 of [batch, sequence, features]; got sequence_dim ",
              style.sequence_dim());
  if (kind == Kind::kNoParameters || t.dry) {
    return;  // a module without weights runs on this rank's part of the sequence as it is
  }
  const dist::ProcessGroupPtr g = t.group;
  auto* norm = t.module->as<torch::nn::LayerNormImpl>();
  register_forward_wrapper(*norm, [g, norm](const Tensor& x, const ForwardFunction&) {
    // Each rank normalizes its part of the sequence; the weights' gradients are summed.
    const auto& o = norm->options;
    const Tensor w = norm->weight.defined() ? comm(Comm::kCopy, norm->weight, 0, g) : Tensor();
    const Tensor b = norm->bias.defined() ? comm(Comm::kCopy, norm->bias, 0, g) : Tensor();
    return torch::layer_norm(x, o.normalized_shape(), w, b, o.eps());
  });
}

void apply(const Target& t, const PrepareModuleInput& style) {
  if (t.dry) {
    return;
  }
  const dist::ProcessGroupPtr g = t.group;
  register_forward_wrapper(*t.module, [g, style](const Tensor& x, const ForwardFunction& forward) {
    return forward(relayout(x, style.input_layouts(), style.desired_input_layouts(), g));
  });
}

void apply(const Target& t, const PrepareModuleOutput& style) {
  if (t.dry) {
    return;
  }
  const dist::ProcessGroupPtr g = t.group;
  register_forward_wrapper(*t.module, [g, style](const Tensor& x, const ForwardFunction& forward) {
    return relayout(forward(x), style.output_layouts(), style.desired_output_layouts(), g);
  });
}

bool matches(const std::string& pattern, const std::string& name) {
  auto split = [](const std::string& s) {
    std::vector<std::string> out;
    std::stringstream in(s);
    for (std::string part; std::getline(in, part, '.');) {
      out.push_back(part);
    }
    return out;
  };
  const auto p = split(pattern), n = split(name);
  if (p.size() != n.size()) {
    return false;
  }
  for (size_t i = 0; i < p.size(); ++i) {
    if (fnmatch(p[i].c_str(), n[i].c_str(), 0) != 0) {
      return false;
    }
  }
  return true;
}

std::string children_of(torch::nn::Module& m) {
  std::string out;
  for (const auto& child : m.named_children()) {
    out += (out.empty() ? "" : ", ") + child.key();
  }
  return out.empty() ? "none" : out;
}

}  // namespace

TensorParallelLayout parallelize_module(const std::shared_ptr<torch::nn::Module>& module,
                                        const dist::ProcessGroupPtr& tp,
                                        const ParallelizePlan& plan) {
  TORCH_CHECK(module != nullptr, "parallelize_module: the module is null");
  TORCH_CHECK(tp != nullptr, "parallelize_module: the tensor-parallel group is null");
  const auto modules = module->named_modules(/*name_prefix=*/"", /*include_self=*/false);
  // Every entry is checked before any weight is split or any hook added, so that a bad plan
  // leaves the model as it was.
  std::set<const c10::TensorImpl*> split;
  std::map<const torch::nn::Module*, std::string> styled;  // each module takes one style
  for (const bool dry : {true, false}) {
    TensorParallelLayout layout;
    layout.degree = tp->size();
    for (const auto& [pattern, style] : plan) {
      bool found = false;
      for (const auto& item : modules) {
        if (!matches(pattern, item.key())) {
          continue;
        }
        found = true;
        TORCH_CHECK(!dry || !has_forward_hooks(*item.value()), "parallelize_module: '", item.key(),
                    "' has forward hooks already (a plan was applied to it); "
                    "parallelize a model once");
        if (dry) {
          const auto [it, fresh] = styled.emplace(item.value().get(), pattern);
          TORCH_CHECK(fresh, "parallelize_module: '", item.key(),
                      "' is named by two plan entries ('", it->second, "' and '", pattern,
                      "'); give each module one style");
        }
        const Target target{item.key(), item.value().get(), tp, layout, dry, &split};
        std::visit([&](const auto& s) { apply(target, s); }, style);
      }
      TORCH_CHECK(
          found, "parallelize_module: the plan names '", pattern,
          "', which matches no submodule of the model (its children: ", children_of(*module), ")");
    }
    if (!dry) {
      return layout;
    }
  }
  TORCH_CHECK(false, "parallelize_module: not reached");
}

std::map<std::string, torch::Tensor> tensor_parallel_full_state(
    const std::map<std::string, torch::Tensor>& local,
    const TensorParallelLayout& layout,
    const dist::ProcessGroupPtr& tp) {
  TORCH_CHECK(tp != nullptr, "tensor_parallel_full_state: the tensor-parallel group is null");
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, tensor] : local) {
    auto it = layout.shards.find(name);
    if (it == layout.shards.end() || tp->size() == 1) {
      out[name] = tensor;
      continue;
    }
    const TensorParallelShard& s = it->second;
    std::vector<Tensor> pieces;
    for (int r = 0; r < tp->size(); ++r) {
      pieces.push_back(torch::empty_like(tensor, at::MemoryFormat::Contiguous));
    }
    tp->allgather(pieces, tensor.contiguous())->wait();
    out[name] = tensor_parallel_join(pieces, s);
  }
  return out;
}

torch::Tensor tensor_parallel_join(const std::vector<torch::Tensor>& parts,
                                   const TensorParallelShard& shard) {
  TORCH_CHECK(!parts.empty(), "tensor_parallel_join: no parts");
  const int64_t dim = normalized(shard.dim, parts.front());
  TORCH_CHECK(dim >= 0 && dim < parts.front().dim() && shard.chunks >= 1 &&
                  parts.front().size(dim) % shard.chunks == 0,
              "tensor_parallel_join: parts of shape ", parts.front().sizes(), " do not split into ",
              shard.chunks, " chunks along dimension ", shard.dim);
  for (const Tensor& part : parts) {
    TORCH_CHECK(part.sizes() == parts.front().sizes(), "tensor_parallel_join: parts of sizes ",
                parts.front().sizes(), " and ", part.sizes(), "; every rank's part is the same");
  }
  // Part r holds rank r's piece of each chunk: chunk c is the ranks' c-th pieces in order.
  std::vector<Tensor> chunks;
  for (int64_t c = 0; c < shard.chunks; ++c) {
    std::vector<Tensor> pieces;
    for (const Tensor& part : parts) {
      pieces.push_back(part.chunk(shard.chunks, dim)[static_cast<size_t>(c)]);
    }
    chunks.push_back(torch::cat(pieces, dim));
  }
  return torch::cat(chunks, dim);
}

std::optional<int> tensor_parallel_sharded_output(const torch::nn::Module& module) {
  ShardedOutputs& t = sharded_outputs();
  std::lock_guard<std::mutex> lock(t.mutex);
  auto it = t.rank.find(&module);
  if (it == t.rank.end() || it->second.first.expired()) {
    return std::nullopt;
  }
  return it->second.second;
}

torch::Tensor tensor_parallel_dropout(const torch::Tensor& x,
                                      double p,
                                      bool train,
                                      std::optional<int> rank) {
  if (!rank || !train || p == 0) {
    return torch::dropout(x, p, train);
  }
  TORCH_CHECK(p > 0 && p < 1, "tensor_parallel_dropout: p must be in [0, 1), got ", p);
  // One draw from the default CPU generator, as every rank makes it, gives this call's seed; this
  // rank's stream is a clone of the device's generator seeded with it plus the rank. Nothing else
  // is kept: a checkpoint of the default generator's state replays the same masks, and the
  // default stream goes on alike on every rank (the replicated regions' dropout).
  const int64_t seed = torch::empty({}, torch::kLong).random_().item<int64_t>();
  at::Generator mine;
  {
    at::Generator device = at::globalContext().defaultGenerator(x.device());
    std::lock_guard<std::mutex> lock(device.mutex());  // another thread may draw from it
    mine = device.clone();
  }
  {
    std::lock_guard<std::mutex> lock(mine.mutex());
    mine.set_current_seed(static_cast<uint64_t>(seed) + static_cast<uint64_t>(*rank));
  }
  const Tensor keep = torch::empty_like(x, at::MemoryFormat::Contiguous).bernoulli_(1 - p, mine);
  return x * keep.div_(1 - p);
}

namespace {

constexpr int64_t kIgnoreIndex = -100;  // cross_entropy's default ignore_index

// cross_entropy's check: every target is a class or ignore_index.
void check_targets(const Tensor& target, int64_t classes) {
  if (target.numel() == 0) {
    return;
  }
  // One read of the device's values: the lowest and the highest target, ignore_index aside.
  const Tensor ignored = target == kIgnoreIndex;
  const Tensor bounds = torch::stack({target.masked_fill(ignored, classes - 1).min(),
                                      target.masked_fill(ignored, 0).max()})
                            .cpu();
  const int64_t low = bounds[0].item<int64_t>(), high = bounds[1].item<int64_t>();
  TORCH_CHECK(low >= 0 && high < classes, "loss_parallel_cross_entropy: a target of ",
              low < 0 ? low : high, " is outside the ", classes,
              " classes (the vocabulary over every rank)");
}

// Cross entropy over classes split across the group (Megatron's vocab-parallel cross entropy):
// the row maxima, the sums of exponentials and the target's logit are each reduced over the
// ranks, so no rank holds the whole logits.
struct ParallelCrossEntropy : torch::autograd::Function<ParallelCrossEntropy> {
  static Tensor forward(AutogradContext* ctx,
                        const Tensor& input,
                        const Tensor& target,
                        const c10::IValue& capsule) {
    auto g = c10::static_intrusive_pointer_cast<TpGroupCapsule>(capsule.toCapsule())->group;
    // As Megatron-LM's: at least fp32, whatever the logits.
    const Tensor logits = input.to(at::promote_types(input.scalar_type(), torch::kFloat));
    const int64_t classes = logits.size(1), first = classes * g->rank();
    check_targets(target, classes * g->size());
    ctx->saved_data["dtype"] = static_cast<int64_t>(input.scalar_type());
    Tensor max = std::get<0>(logits.max(1)).contiguous();
    g->allreduce(max, dist::ReduceOp::kMax)->wait();
    const Tensor exp = (logits - max.unsqueeze(1)).exp();
    Tensor sum = exp.sum(1).contiguous();
    g->allreduce(sum)->wait();
    const Tensor valid = target != kIgnoreIndex;
    const Tensor mine = (target >= first).logical_and(target < first + classes);
    const Tensor local = (target - first).masked_fill(mine.logical_not(), 0);
    Tensor picked =
        logits.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(mine.logical_not(), 0);
    picked = picked.contiguous();
    g->allreduce(picked)->wait();
    const Tensor count = valid.sum().clamp_min(1).to(logits.scalar_type());
    const Tensor losses = (sum.log() + max - picked).masked_fill(valid.logical_not(), 0);
    ctx->save_for_backward({exp / sum.unsqueeze(1), local, mine.logical_and(valid), valid, count});
    return losses.sum() / count;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    Tensor grad = saved[0].clone();  // softmax of this rank's classes
    grad.scatter_add_(1, saved[1].unsqueeze(1), -saved[2].to(grad.scalar_type()).unsqueeze(1));
    grad.masked_fill_(saved[3].logical_not().unsqueeze(1), 0);
    const auto dtype = static_cast<c10::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {(grad * (grads[0] / saved[4])).to(dtype), Tensor(), Tensor()};
  }
};

}  // namespace

torch::Tensor loss_parallel_cross_entropy(const torch::Tensor& local_logits,
                                          const torch::Tensor& target,
                                          const dist::ProcessGroupPtr& tp) {
  TORCH_CHECK(tp != nullptr, "loss_parallel_cross_entropy: the tensor-parallel group is null");
  const Tensor logits = local_logits.reshape({-1, local_logits.size(-1)});
  const Tensor flat = target.reshape({-1}).to(torch::kLong);
  TORCH_CHECK(logits.size(0) == flat.size(0), "loss_parallel_cross_entropy: ", logits.size(0),
              " rows of logits but ", flat.size(0), " targets");
  const c10::IValue capsule = c10::IValue::make_capsule(c10::make_intrusive<TpGroupCapsule>(tp));
  return ParallelCrossEntropy::apply(logits, flat, capsule);
}

}  // namespace paratrain
