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

#include <torch/optim/optimizer.h>

#include <nlohmann/json.hpp>

#include <cstddef>
#include <functional>
#include <map>
#include <string>
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
};

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

/// A Checkpoint's sharded state (its manifest's metadata has "fsdp"); `own` (may be empty) is
/// the saving rank `own_rank`'s tensors, already read.
SavedShards from_checkpoint(const CheckpointState& state, int own_rank);
/// The checkpoint in `dir`: its newest Checkpoint manifest, else an older fsdp.json; rank
/// `rank`'s own file is read with it (when it has one; rank < 0: none). Throws c10::Error, one
/// line, for a file, a directory that holds neither, a checkpoint of unsharded weights, or a
/// missing rank file.
SavedShards from_directory(const std::string& dir, int rank);

}  // namespace fsdp_saved
}  // namespace paratrain
