// Internal to parallel/: a saved sharded FSDP state as loading, resharding and consolidation read
// it, whichever of its two on-disk forms holds it:
//   - a Checkpoint (io/checkpoint.h): the layout in the manifest's metadata under "fsdp", each
//     rank's shards ("fsdp.<unit>") and optimizer state ("optim.<key>") in its rank file, the
//     buffers ("model.<name>") in the shared file. The Trainer and save_sharded_checkpoint write
//     this one;
//   - the fsdp.json manifest with rank-R-of-W.safetensors files, which save_sharded_checkpoint
//     wrote before: read, never written.
#pragma once

#include "paratrain/io/checkpoint.h"
#include "paratrain/parallel/fully_sharded_data_parallel.h"
#include "paratrain/parallel/tensor_parallel.h"

#include <torch/optim/optimizer.h>

#include <nlohmann/json.hpp>

#include <cstddef>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace paratrain {
namespace fsdp_saved {

using Json = nlohmann::json;
using Unit = FullyShardedDataParallel::Unit;

/// The older format's manifest, in the checkpoint's directory.
constexpr const char* kOldManifest = "fsdp.json";

struct SavedShards {
  std::string where;  ///< the checkpoint, as messages name it (a directory or a manifest)
  int world = 0;      ///< the ranks that saved it
  std::vector<Unit> units;
  bool has_optimizer = false;
  /// "<group>.<index>." (optimizer_state's key prefix) -> the unit that parameter steps.
  std::map<std::string, size_t> optimizer;
  std::string prefix;  ///< the shards' key prefix in the rank files: "fsdp." or "model."
  TensorMap buffers;   ///< by module name; the older format has none
  std::map<std::string, std::string> metadata;  ///< the caller's
  std::string config;                           ///< a Trainer's run configuration (JSON), or ""
  std::function<std::string(int rank)> file;    ///< rank r's file, as messages name it
  /// Rank r's tensors, verified; with optimizer false the optimizer's may be left out.
  std::function<TensorMap(int rank, bool optimizer)> read;

  // Saved on a device mesh: every world rank's file holds its dp_shard group's shards (rank r of
  // `world`, the units' layout) of its tensor-parallel part. file and read above name the files
  // of tensor-parallel rank `tp_rank` of the first replica; tp_part() points them at another.
  std::string mesh;  ///< its dimensions (DeviceMesh::describe()); "": plain
  std::vector<std::pair<std::string, int>> dims;  ///< outermost first; empty when plain
  int tp = 1;
  int tp_rank = 0;
  std::map<std::string, TensorParallelShard> split;  ///< what tensor parallelism split
  // Saved with pipeline stages (pp above 1): units, optimizer and split above are stage
  // `pp_rank`'s, and file and read name its ranks; stage_part() points them at another stage.
  int pp = 1;
  int pp_rank = 0;
  Json stages;  ///< per stage: {"fsdp": its layout, "tensor_parallel": its split}
  std::function<std::string(int world_rank)> world_file;
  std::function<TensorMap(int world_rank, bool optimizer)> world_read;
};

/// Refuses, before anything is loaded, a model whose buffers the saved state lacks or shapes
/// otherwise (the older format saved none: nothing to check).
void check_buffers(const SavedShards& s, FullyShardedDataParallel& fsdp);
/// Copies the saved buffers into the model's (after check_buffers).
void load_buffers(const SavedShards& s, FullyShardedDataParallel& fsdp);
/// A unit as sharded_state() and the rank files call it: "root" for the root.
std::string unit_key(const Unit& u);
/// The layout as a checkpoint saves it: {"world_size", "units", "optimizer"} (null without one).
Json layout_json(const FullyShardedDataParallel& fsdp, torch::optim::Optimizer* optimizer);
/// The first difference between the saved units and the model's, "" when they match: a unit,
/// a parameter's name, or its shape.
std::string layout_difference(const std::vector<Unit>& saved, const std::vector<Unit>& now);
/// Which unit each optimizer parameter ("<group>.<index>.") steps, found by the shard it holds.
std::map<std::string, size_t> optimizer_units(torch::optim::Optimizer& optimizer,
                                              const FullyShardedDataParallel& fsdp);

/// A Checkpoint's sharded state (its manifest's metadata has "fsdp", and "mesh" when saved on
/// one), file and read pointing at tensor-parallel rank `tp_rank`'s files (0 when it has none);
/// `state.own` (may be empty) is the saving world rank `state.rank`'s tensors, already read.
SavedShards from_checkpoint(const CheckpointState& state, int tp_rank = 0, int pp_rank = 0);
/// The same saved state with file and read naming tensor-parallel rank `t`'s files.
SavedShards tp_part(const SavedShards& s, int t);
/// The same saved state for pipeline stage `stage` (its layout, and its files of tensor-parallel
/// rank `t`).
SavedShards stage_part(const SavedShards& s, int stage, int t);

/// Every saved rank file, [tensor-parallel rank][dp_shard rank] (a plain checkpoint: [0][rank]),
/// with or without the optimizer's state.
std::vector<std::vector<TensorMap>> read_all(const SavedShards& s, bool optimizer);

/// The whole tensors of unit `unit`'s parameters in the flat tensor `key` of every file in
/// `files` (read_all's): the unit's shards ("fsdp.<unit>") or one optimizer field laid out like
/// them, put together over dp_shard and joined over tensor parallelism.
TensorMap whole_of_unit(const std::vector<std::vector<TensorMap>>& files,
                        const SavedShards& s,
                        size_t unit,
                        const std::string& key);

/// Takes a saved state from another mesh (another tensor-parallel degree or split) into `fsdp`
/// and `optimizer`: the whole of each tensor, then this rank's part of it under `layout` on
/// tensor-parallel rank `tp_rank`, then its FSDP shard. Holds the whole model and its optimizer
/// state in memory once. Throws c10::Error, one line, before changing anything, for a model or
/// optimizer that does not match the saved one.
void load_across_meshes(const SavedShards& s,
                        FullyShardedDataParallel& fsdp,
                        torch::optim::Optimizer* optimizer,
                        const TensorParallelLayout& layout,
                        int tp_rank);

/// The checkpoint in `dir`: its newest Checkpoint manifest, else an older fsdp.json; rank
/// `rank`'s own file is read with it (when it has one; rank < 0: none). Throws c10::Error, one
/// line, for a file, a directory that holds neither, a checkpoint of unsharded weights, or a
/// missing rank file.
SavedShards from_directory(const std::string& dir, int rank);

}  // namespace fsdp_saved
}  // namespace paratrain
