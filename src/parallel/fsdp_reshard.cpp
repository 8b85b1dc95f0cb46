// Taking a sharded FSDP state saved on one device mesh into another: every saving rank's shards
// put back together into whole tensors (over dp_shard, then joined over tensor parallelism), then
// cut again for this rank. The same whole tensors are what consolidation writes.

#include "fsdp_saved.h"

#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>
#include <torch/torch.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

namespace paratrain {
namespace fsdp_saved {

namespace {

using torch::Tensor;

// Tensor-parallel rank t's flat tensor `key` of unit `unit`, put together from its dp_shard
// ranks' pieces and cut to the unit's elements (the padding dropped).
Tensor flat_of(const std::vector<TensorMap>& files,
               const SavedShards& s,
               int t,
               size_t unit,
               const std::string& key) {
  const int64_t size = s.units[unit].padded / s.world;
  std::vector<Tensor> pieces;
  for (size_t r = 0; r < files.size(); ++r) {
    auto it = files[r].find(key);
    TORCH_CHECK(it != files[r].end() && it->second.dim() == 1 && it->second.numel() == size,
                tp_part(s, t).file(static_cast<int>(r)), " has no '", key, "' of ", size,
                " elements, as the layout in its manifest says it must: the file is damaged");
    pieces.push_back(it->second);
  }
  return torch::cat(pieces).narrow(0, 0, s.units[unit].numel);
}

// Whether a saved optimizer tensor is laid out like its unit's shard (Adam's moments, SGD's
// momentum) rather than the same on every rank (Adam's step).
bool like_shard(const Tensor& t, const SavedShards& s, size_t unit) {
  return t.dim() == 1 && t.numel() == s.units[unit].padded / s.world;
}

// This rank's FSDP shard of unit `unit` of `fsdp`, from the whole tensors of its parameters:
// each cut to this tensor-parallel rank's part under `layout`, laid out flat, then resharded.
Tensor shard_from_whole(const FullyShardedDataParallel& fsdp,
                        size_t unit,
                        const TensorMap& whole,
                        const TensorParallelLayout& layout,
                        int tp_rank) {
  const auto u = fsdp.units().at(unit);
  Tensor flat;
  for (size_t i = 0; i < u.params.size(); ++i) {
    const Tensor& w = whole.at(u.params[i]);
    auto split = layout.shards.find(u.params[i]);
    const Tensor part = split == layout.shards.end()
                            ? w
                            : tensor_parallel_slice(w, split->second, tp_rank, layout.degree);
    if (!flat.defined()) {
      flat = torch::zeros({u.numel}, w.options());
    }
    flat.narrow(0, u.offsets[i], part.numel()).copy_(part.reshape({-1}));
  }
  return fsdp.reshard(unit, {flat});
}

// The shape of a whole saved tensor's part on this rank, checked against the model's before
// anything is loaded.
void check_part_shapes(const SavedShards& s,
                       const FullyShardedDataParallel& fsdp,
                       const TensorMap& whole,
                       const TensorParallelLayout& layout) {
  for (const auto& u : fsdp.units()) {
    for (size_t i = 0; i < u.params.size(); ++i) {
      const std::string& name = u.params[i];
      auto it = whole.find(name);
      TORCH_CHECK(it != whole.end(), "the checkpoint in ", s.where,
                  " is of another model: it has no parameter '", name,
                  "'; load it into a model built as the one that saved it");
      std::vector<int64_t> shape = it->second.sizes().vec();
      auto split = layout.shards.find(name);
      if (split != layout.shards.end()) {
        const int64_t dim = split->second.dim < 0
                                ? split->second.dim + static_cast<int64_t>(shape.size())
                                : split->second.dim;
        TORCH_CHECK(dim >= 0 && dim < static_cast<int64_t>(shape.size()) &&
                        shape[dim] % (split->second.chunks * layout.degree) == 0,
                    "the checkpoint in ", s.where, " holds '", name, "' of shape ",
                    it->second.sizes(), ", which tensor parallelism of degree ", layout.degree,
                    " does not split as this model does");
        shape[dim] /= layout.degree;
      }
      TORCH_CHECK(shape == u.shapes[i], "the checkpoint in ", s.where, " holds '", name,
                  "' of shape ", it->second.sizes(), ", whose part here would be ",
                  c10::IntArrayRef(shape), " where this model's is ", c10::IntArrayRef(u.shapes[i]),
                  "; load it into a model built as the one that saved it");
    }
  }
}

// The units by name: the saved ones and the model's agree on names, not on shapes.
size_t saved_unit(const SavedShards& s, const std::string& name) {
  for (size_t k = 0; k < s.units.size(); ++k) {
    if (s.units[k].name == name) {
      return k;
    }
  }
  TORCH_CHECK(false, "the checkpoint in ", s.where, " is of another model: it has no unit '",
              name.empty() ? "root" : name,
              "'; load it into a model built as the one that saved it");
}

// The same parameters in the same units, and an optimizer that steps the same units: what the
// saved state and this model may differ in is only how they are split.
void check_same_model(const SavedShards& s,
                      const FullyShardedDataParallel& fsdp,
                      torch::optim::Optimizer* optimizer) {
  const auto units = fsdp.units();
  size_t with_params = 0;
  for (const auto& u : units) {
    const size_t k = saved_unit(s, u.name);
    TORCH_CHECK(s.units[k].params == u.params, "the checkpoint in ", s.where,
                " is of another model: its unit '", unit_key(u), "' holds ",
                s.units[k].params.size(), " parameters (the first: '",
                s.units[k].params.empty() ? "none" : s.units[k].params[0], "') and this model's ",
                u.params.size(), "; load it into a model built as the one that saved it");
    with_params += u.padded > 0 ? 1 : 0;
  }
  const size_t saved_with_params = static_cast<size_t>(
      std::count_if(s.units.begin(), s.units.end(), [](const Unit& u) { return u.padded > 0; }));
  TORCH_CHECK(saved_with_params == with_params, "the checkpoint in ", s.where,
              " is of another model: it has ", saved_with_params,
              " units with parameters and this model ", with_params,
              "; load it into a model built as the one that saved it");
  if (optimizer != nullptr && s.has_optimizer) {
    const auto owners = optimizer_units(*optimizer, fsdp);
    for (const auto& [key, unit] : s.optimizer) {
      TORCH_CHECK(owners.count(key), "the checkpoint in ", s.where,
                  " holds optimizer state of parameter ", key.substr(0, key.size() - 1),
                  ", which this optimizer does not step; build the optimizer over "
                  "fsdp.parameters(), as the saved one was");
    }
  }
}

// This rank's optimizer state from the saved one: `key` ("<group>.<index>.") of the model's
// unit `unit`, whose saved unit is `saved`.
void optimizer_of_unit(const std::vector<std::vector<TensorMap>>& files,
                       const SavedShards& s,
                       const FullyShardedDataParallel& fsdp,
                       const std::pair<std::string, size_t>& owner,
                       const TensorParallelLayout& layout,
                       int tp_rank,
                       TensorMap& out) {
  const auto& [key, unit] = owner;
  const size_t saved = saved_unit(s, fsdp.units().at(unit).name);
  auto mapped = s.optimizer.find(key);
  TORCH_CHECK(
      mapped != s.optimizer.end() && mapped->second == saved, "the optimizer's parameter ",
      key.substr(0, key.size() - 1), " steps unit '", unit_key(fsdp.units().at(unit)),
      "' here but ",
      mapped == s.optimizer.end() ? "nothing" : "'" + unit_key(s.units[mapped->second]) + "'",
      " in the checkpoint in ", s.where,
      "; build the optimizer over fsdp.parameters(), as the saved one was");
  for (const auto& [name, t] : files.at(0).at(0)) {
    if (name.rfind("optim." + key, 0) != 0) {
      continue;
    }
    const std::string field = name.substr(6);  // "<group>.<index>.<field>"
    out[field] =
        like_shard(t, s, saved)
            ? shard_from_whole(fsdp, unit, whole_of_unit(files, s, saved, name), layout, tp_rank)
            : t;
  }
}

}  // namespace

std::vector<std::vector<TensorMap>> read_all(const SavedShards& s, bool optimizer) {
  std::vector<std::vector<TensorMap>> files(static_cast<size_t>(s.tp));
  for (int t = 0; t < s.tp; ++t) {
    const SavedShards part = tp_part(s, t);
    for (int r = 0; r < s.world; ++r) {
      files[static_cast<size_t>(t)].push_back(part.read(r, optimizer));
    }
  }
  return files;
}

TensorMap whole_of_unit(const std::vector<std::vector<TensorMap>>& files,
                        const SavedShards& s,
                        size_t unit,
                        const std::string& key) {
  const Unit& u = s.units.at(unit);
  std::vector<Tensor> flats;
  for (int t = 0; t < s.tp; ++t) {
    flats.push_back(flat_of(files.at(static_cast<size_t>(t)), s, t, unit, key));
  }
  TensorMap out;
  for (size_t i = 0; i < u.params.size(); ++i) {
    const int64_t n = c10::multiply_integers(u.shapes[i]);
    std::vector<Tensor> parts;
    for (const Tensor& flat : flats) {
      parts.push_back(flat.narrow(0, u.offsets[i], n).view(u.shapes[i]));
    }
    auto split = s.split.find(u.params[i]);
    // A part tensor parallelism did not split is the same on every tensor-parallel rank.
    out[u.params[i]] =
        split == s.split.end() ? parts.front().clone() : tensor_parallel_join(parts, split->second);
  }
  return out;
}

void load_across_meshes(const SavedShards& s,
                        FullyShardedDataParallel& fsdp,
                        torch::optim::Optimizer* optimizer,
                        const TensorParallelLayout& layout,
                        int tp_rank) {
  const bool optim = optimizer != nullptr && s.has_optimizer;
  const auto files = read_all(s, optim);
  TensorMap whole;
  for (size_t k = 0; k < s.units.size(); ++k) {
    if (s.units[k].padded > 0) {
      for (auto& kv : whole_of_unit(files, s, k, s.prefix + unit_key(s.units[k]))) {
        whole.insert(std::move(kv));
      }
    }
  }
  check_same_model(s, fsdp, optimizer);
  check_part_shapes(s, fsdp, whole, layout);
  check_buffers(s, fsdp);
  TensorMap shards;
  TensorMap state;
  const auto units = fsdp.units();
  for (size_t k = 0; k < units.size(); ++k) {
    if (units[k].padded > 0) {
      shards[unit_key(units[k])] = shard_from_whole(fsdp, k, whole, layout, tp_rank);
    }
  }
  if (optim) {
    for (const auto& owner : optimizer_units(*optimizer, fsdp)) {
      optimizer_of_unit(files, s, fsdp, owner, layout, tp_rank, state);
    }
  }
  fsdp.load_own_shards(shards);
  if (optimizer != nullptr) {  // without saved state: none, as a plain load leaves it
    load_optimizer_state(*optimizer, state);
  }
  load_buffers(s, fsdp);
}

}  // namespace fsdp_saved
}  // namespace paratrain
