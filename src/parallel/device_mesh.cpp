#include "paratrain/parallel/device_mesh.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <set>

namespace paratrain {
namespace {

constexpr const char* kFlatDp = "dp";

std::vector<int> coordinate_of(int rank, const std::vector<DeviceMesh::Dim>& dims) {
  std::vector<int> out(dims.size());
  for (size_t i = dims.size(); i-- > 0;) {
    out[i] = rank % dims[i].second;
    rank /= dims[i].second;
  }
  return out;
}

void check_dims(const dist::ProcessGroupPtr& world, const std::vector<DeviceMesh::Dim>& dims) {
  TORCH_CHECK(world != nullptr, "DeviceMesh: the world process group is null");
  TORCH_CHECK(!dims.empty(), "DeviceMesh: give at least one dimension");
  std::set<std::string> names;
  int64_t product = 1;
  std::string listed;
  for (const auto& [name, degree] : dims) {
    TORCH_CHECK(!name.empty(), "DeviceMesh: a dimension has an empty name");
    TORCH_CHECK(name != kFlatDp, "DeviceMesh: \"dp\" names the flattened dp_replicate x dp_shard; ",
                "name the dimension dp_replicate or dp_shard");
    TORCH_CHECK(names.insert(name).second, "DeviceMesh: the dimension ", name, " is listed twice");
    TORCH_CHECK(degree >= 1, "DeviceMesh: the degree of ", name, " must be >= 1, got ", degree);
    product *= degree;
    listed += (listed.empty() ? "" : " x ") + name + "=" + std::to_string(degree);
  }
  TORCH_CHECK(product == world->size(), "DeviceMesh: the degrees ", listed, " make ", product,
              " ranks, but the world has ", world->size(),
              "; choose degrees whose product is the world size");
}

}  // namespace

DeviceMesh::DeviceMesh(dist::ProcessGroupPtr world, std::vector<Dim> dims)
    : world_(std::move(world)), dims_(std::move(dims)) {
  check_dims(world_, dims_);
  coordinate_ = coordinate_of(world_->rank(), dims_);
  // Every rank makes every group of every dimension, in one order (ProcessGroup::new_group's
  // contract): dimension by dimension, each group when its first rank comes up.
  for (size_t d = 0; d < dims_.size(); ++d) {
    for (int r = 0; r < world_->size(); ++r) {
      if (coordinate_of(r, dims_)[d] != 0) {
        continue;
      }
      auto group = world_->new_group(peers(d, r));
      if (group != nullptr) {
        groups_[dims_[d].first] = std::move(group);
      }
    }
  }
  std::vector<size_t> dp;
  for (size_t d = 0; d < dims_.size(); ++d) {
    if (dims_[d].first == "dp_replicate" || dims_[d].first == "dp_shard") {
      dp.push_back(d);
    }
  }
  if (!dp.empty()) {
    for (int r = 0; r < world_->size(); ++r) {
      const auto members = flattened_peers(dp, r);
      if (members.front() != r) {
        continue;
      }
      auto group = world_->new_group(members);
      if (group != nullptr) {
        groups_[kFlatDp] = std::move(group);
      }
    }
  }
}

std::vector<int> DeviceMesh::peers(size_t dim, int rank) const {
  return flattened_peers({dim}, rank);
}

// The ranks that share `rank`'s coordinates outside `flat_dims`, in row-major order of theirs.
std::vector<int> DeviceMesh::flattened_peers(const std::vector<size_t>& flat_dims, int rank) const {
  const std::vector<int> base = coordinate_of(rank, dims_);
  std::vector<int> out;
  for (int r = 0; r < world_->size(); ++r) {
    const std::vector<int> c = coordinate_of(r, dims_);
    bool same = true;
    for (size_t i = 0; i < dims_.size() && same; ++i) {
      const bool flat = std::find(flat_dims.begin(), flat_dims.end(), i) != flat_dims.end();
      same = flat || c[i] == base[i];
    }
    if (same) {
      out.push_back(r);
    }
  }
  return out;
}

int DeviceMesh::index_of(const std::string& name) const {
  for (size_t i = 0; i < dims_.size(); ++i) {
    if (dims_[i].first == name) {
      return static_cast<int>(i);
    }
  }
  return -1;
}

const dist::ProcessGroupPtr& DeviceMesh::operator[](const std::string& name) const {
  auto it = groups_.find(name);
  TORCH_CHECK(it != groups_.end(), "DeviceMesh: no dimension '", name, "' in the mesh ", describe(),
              has(kFlatDp) ? " (or dp)" : "");
  return it->second;
}

bool DeviceMesh::has(const std::string& name) const {
  return groups_.count(name) > 0;
}

int DeviceMesh::size(const std::string& name) const {
  if (name == kFlatDp) {
    return has(kFlatDp) ? groups_.at(kFlatDp)->size() : 1;
  }
  const int i = index_of(name);
  return i < 0 ? 1 : dims_[static_cast<size_t>(i)].second;
}

int DeviceMesh::local_rank(const std::string& name) const {
  if (name == kFlatDp) {
    return has(kFlatDp) ? groups_.at(kFlatDp)->rank() : 0;
  }
  const int i = index_of(name);
  return i < 0 ? 0 : coordinate_[static_cast<size_t>(i)];
}

std::string DeviceMesh::describe(const std::vector<Dim>& dims) {
  std::string out;
  for (const auto& [name, degree] : dims) {
    out += (out.empty() ? "" : " x ") + name + "=" + std::to_string(degree);
  }
  return out;
}

DeviceMesh init_device_mesh(dist::ProcessGroupPtr world, std::vector<DeviceMesh::Dim> dims) {
  return DeviceMesh(std::move(world), std::move(dims));
}

std::vector<DeviceMesh::Dim> mesh_dims(
    int world_size, int dp_replicate, int dp_shard, int tp, int pp) {
  TORCH_CHECK(dp_replicate >= 1 && tp >= 1 && pp >= 1 && (dp_shard >= 1 || dp_shard == -1),
              "mesh: every degree must be >= 1 (dp_shard may be -1: the rest of the world), got ",
              "dp_replicate=", dp_replicate, " dp_shard=", dp_shard, " tp=", tp, " pp=", pp);
  const int64_t others = int64_t{dp_replicate} * tp * pp;
  if (dp_shard == -1) {
    TORCH_CHECK(world_size % others == 0, "mesh: dp_replicate=", dp_replicate, " x tp=", tp,
                " x pp=", pp, " = ", others, " does not divide the world size ", world_size);
    dp_shard = static_cast<int>(world_size / others);
  }
  TORCH_CHECK(others * dp_shard == world_size, "mesh: dp_replicate=", dp_replicate,
              " x dp_shard=", dp_shard, " x tp=", tp, " x pp=", pp, " = ", others * dp_shard,
              " ranks, but the world has ", world_size,
              "; choose degrees whose product is the world size");
  std::vector<DeviceMesh::Dim> out;
  for (const DeviceMesh::Dim& d : std::vector<DeviceMesh::Dim>{
           {"pp", pp}, {"dp_replicate", dp_replicate}, {"dp_shard", dp_shard}, {"tp", tp}}) {
    if (d.second > 1 || d.first == "dp_shard") {
      out.push_back(d);
    }
  }
  return out;
}

}  // namespace paratrain
