#pragma once

// DeviceMesh: torch.distributed.device_mesh.DeviceMesh for paratrain's process groups. The world's
// ranks are laid out as an N-dimensional grid with named dimensions; mesh["tp"] is the process
// group of this rank's peers along "tp" (the ranks whose other coordinates equal this rank's).
//
//   auto world = paratrain::dist::init_process_group();
//   auto mesh = paratrain::init_device_mesh(world, {{"dp_shard", 2}, {"tp", 2}});
//   paratrain::parallelize_module(model, mesh["tp"], plan);          // tensor parallel
//   paratrain::FullyShardedDataParallel fsdp(model, mesh["dp_shard"]); // FSDP across
//
// Layout (torchtitan's): dimensions are listed outermost first and the last one varies fastest,
// so rank = ((c0 * d1 + c1) * d2 + c2) ... in row-major order. With torchtitan's order
// pp, dp_replicate, dp_shard, tp, the tensor-parallel peers are adjacent ranks, which a launcher
// places on one node (--nproc-per-node a multiple of tp).
//
// "dp" names the flattened data-parallel dimensions (dp_replicate x dp_shard, whichever the mesh
// has), as torchtitan's mesh["dp"]: the ranks that see different batches.
//
// Every sub-group is made once, in the constructor, with ProcessGroup::new_group, so it has the
// world's backend, routes and timeout. The constructor is a collective: every rank calls it with
// the same dimensions.

#include "paratrain/comm/process_group.h"

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace paratrain {

class DeviceMesh {
 public:
  /// One named dimension and its degree (its size).
  using Dim = std::pair<std::string, int>;

  /// Lays `world`'s ranks out over `dims` (outermost first). Throws c10::Error with one line for
  /// degrees whose product is not the world size (naming both), a degree below 1, an empty or
  /// repeated name, the reserved name "dp" used for a dimension, no dimensions, or a null group.
  DeviceMesh(dist::ProcessGroupPtr world, std::vector<Dim> dims);

  /// The process group along `name` (a dimension, or "dp"). Throws c10::Error naming the
  /// dimensions the mesh has for another name.
  const dist::ProcessGroupPtr& operator[](const std::string& name) const;
  /// The degree of `name` (1 for a name the mesh does not have, as a dimension of degree 1).
  int size(const std::string& name) const;
  /// This rank's coordinate along `name` (0 for a name the mesh does not have); PyTorch's
  /// get_local_rank.
  int local_rank(const std::string& name) const;
  /// Whether the mesh has a dimension `name` ("dp" when it has dp_replicate or dp_shard).
  bool has(const std::string& name) const;

  const std::vector<Dim>& dims() const { return dims_; }
  /// This rank's coordinates, one per dimension, in the order of dims().
  const std::vector<int>& coordinate() const { return coordinate_; }
  const dist::ProcessGroupPtr& world() const { return world_; }
  /// "dp_shard=2 x tp=2": the dimensions and their degrees, outermost first.
  std::string describe() const { return describe(dims_); }
  static std::string describe(const std::vector<Dim>& dims);

  /// The world ranks of the group along dimension `dim` (by index) that holds `rank`, in the
  /// order of the coordinate along it.
  std::vector<int> peers(size_t dim, int rank) const;

 private:
  std::vector<int> flattened_peers(const std::vector<size_t>& flat_dims, int rank) const;
  int index_of(const std::string& name) const;

  dist::ProcessGroupPtr world_;
  std::vector<Dim> dims_;
  std::vector<int> coordinate_;
  std::map<std::string, dist::ProcessGroupPtr> groups_;
};

/// torch.distributed.device_mesh.init_device_mesh: the mesh of `dims` over `world`.
DeviceMesh init_device_mesh(dist::ProcessGroupPtr world, std::vector<DeviceMesh::Dim> dims);

/// torchtitan's parallel degrees (ParallelDims): the mesh's dimensions in its order (pp,
/// dp_replicate, dp_shard, tp), keeping those of degree above 1, and dp_shard always (FSDP
/// shards over it, on one rank too).
/// A dp_shard of -1 takes what the others leave of the world (torchtitan's default). Throws
/// c10::Error when the degrees do not multiply to `world_size`, naming each.
std::vector<DeviceMesh::Dim> mesh_dims(
    int world_size, int dp_replicate, int dp_shard, int tp, int pp);

}  // namespace paratrain
