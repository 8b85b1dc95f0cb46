#pragma once

// Sharded checkpoints of a FullyShardedDataParallel model, as torch.distributed.checkpoint saves
// an FSDP2 model's state dict: every rank writes only its own shards (weights and optimizer
// state), no rank ever holds the whole model, and a job of another size takes the checkpoint by
// resharding it.
//
//   paratrain::save_sharded_checkpoint("runs/step-1000", fsdp, &optimizer, {{"step", "1000"}});
//   ...                                          // later, on any number of ranks:
//   auto meta = paratrain::load_sharded_checkpoint("runs/step-1000", fsdp, &optimizer);
//   int64_t step = std::stoll(meta.at("step"));
//   ...                                          // one file of the whole model, no ranks:
//   paratrain::consolidate_sharded_checkpoint("runs/step-1000", "model.safetensors");
//
// The directory holds one checkpoint in io::Checkpoint's format (io/checkpoint.h), the one the
// Trainer's checkpoints use, at step 0 (the Trainer's are at their global step):
//   ckpt-0000000000.rank-R.safetensors  rank R's shards ("fsdp.<unit>": one flat tensor per
//                            unit, "root" for the root) and its optimizer's state for them
//                            ("optim.<group>.<index>.<field>", optimizer_state's keys), with the
//                            step, the rank, the world size and a CRC-32 in its header
//   ckpt-0000000000.safetensors  the module's buffers ("model.<name>": BatchNorm's running
//                            statistics, not sharded), rank 0's
//   ckpt-0000000000.json     the manifest, written by rank 0 after its own files (a save that
//                            fails on any rank removes it): the world size, and in its
//                            metadata the layout ("fsdp": each unit's name, parameters, shapes,
//                            offsets, flat and padded sizes, and which unit each optimizer
//                            parameter steps) and the caller's metadata ("metadata")
// Every file is written atomically. Once every rank has entered it, a save removes the manifest
// and the files of the save before: a directory without a manifest holds no complete checkpoint
// (a save that crashed), and a rank file that fails its checks is one left over from another
// save. A directory with checkpoints of other steps (a Trainer's) is refused, not replaced.
// load_sharded_checkpoint and consolidation also take the newest checkpoint of a Trainer's
// checkpoint directory under the fsdp strategy, and the fsdp.json manifest with
// rank-R-of-W.safetensors files that earlier versions of save_sharded_checkpoint wrote.
//
// The shards are saved as they are (the flat parameters, fp32 for fp32 weights, the padding
// included), so a job of the same size loads every tensor back bit for bit; a job of another
// size puts each unit's flat tensor back together from the old ranks' pieces and takes its own
// slice (FullyShardedDataParallel::reshard), of the weights and of every optimizer tensor laid
// out like them (Adam's exp_avg and exp_avg_sq, SGD's momentum). The optimizer's other state
// (Adam's step) is the same on every rank and is taken from one of the files read. The
// optimizer's options (the learning rate) are not saved: they are the caller's, as with
// optimizer_state().
//
// On a device mesh (capture_sharded_state with a mesh), the manifest's metadata also has "mesh":
// its dimensions ("dims", "degrees") and what tensor parallelism split ("tensor_parallel": each
// split parameter's dim and chunks). Every world rank writes its own file, of its dp_shard group's
// layout (the units' shapes are its tensor-parallel part's). Such a checkpoint loads into any
// mesh, into plain FSDP, and consolidates into the whole model: tensor-parallel parts are joined.
//
// The directory must be one that every rank sees (a shared file system). Loading reads only the
// old ranks' files that hold a piece of this rank's slices: on the same world size, its own.

#include "paratrain/io/checkpoint.h"
#include "paratrain/parallel/device_mesh.h"
#include "paratrain/parallel/fully_sharded_data_parallel.h"
#include "paratrain/parallel/tensor_parallel.h"

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>

namespace paratrain {

/// Adds this rank's part of a sharded checkpoint of `fsdp` (and of `optimizer`, when not null) to
/// `state`, for Checkpoint::save: its shards and optimizer state to `own` (own_read_by_all: a job
/// of another size reads every saving rank's), the buffers to `shared`, and the layout to the
/// JSON object `meta` under "fsdp". The Trainer's checkpoints under the fsdp strategy are these.
void capture_sharded_state(FullyShardedDataParallel& fsdp,
                           torch::optim::Optimizer* optimizer,
                           CheckpointState& state);
/// The same for a model on a device mesh: `fsdp` sharded over mesh["dp_shard"] (and replicated
/// over "dp_replicate"), its modules split by parallelize_module over mesh["tp"] as `layout`
/// says. The manifest records the mesh and the layout, so that the checkpoint can be resumed on
/// another mesh, loaded into plain FSDP, or consolidated.
void capture_sharded_state(FullyShardedDataParallel& fsdp,
                           torch::optim::Optimizer* optimizer,
                           CheckpointState& state,
                           const DeviceMesh& mesh,
                           const TensorParallelLayout& layout);
/// Takes what capture_sharded_state saved (loaded by Checkpoint: load_latest or load) into
/// `fsdp` and `optimizer` (when not null), on any number of ranks: this rank's `own` tensors are
/// used as they are, and the other saving ranks' files whose pieces it needs are read from the
/// checkpoint's directory. Throws c10::Error as load_sharded_checkpoint does, before changing
/// anything.
void restore_sharded_state(const CheckpointState& state,
                           FullyShardedDataParallel& fsdp,
                           torch::optim::Optimizer* optimizer);
/// The same into a model on a device mesh, split by tensor parallelism as `layout` says (see
/// capture_sharded_state), whatever the mesh it was saved on: a checkpoint of the same
/// tensor-parallel split is resharded shard by shard over dp_shard, as above; one of another
/// split (another tp degree, or plain FSDP into tensor parallelism and back) is put back together
/// into whole tensors, holding the whole model and its optimizer state in memory once, and cut
/// again. The first replica's files are read.
void restore_sharded_state(const CheckpointState& state,
                           FullyShardedDataParallel& fsdp,
                           torch::optim::Optimizer* optimizer,
                           const DeviceMesh& mesh,
                           const TensorParallelLayout& layout);

/// Writes this rank's shards of `fsdp`'s weights and of `optimizer`'s state (when not null; SGD,
/// Adam or AdamW over fsdp.parameters()), and rank 0 the buffers, to `dir` (made if missing),
/// and `metadata` (text to text: a step, a config) with them. A collective: call it on every rank;
/// it returns once the whole checkpoint is on disk. When any rank fails (an unwritable directory, a
/// full disk), every rank throws c10::Error, that rank with its own reason, the others naming it.
void save_sharded_checkpoint(const std::string& dir,
                             FullyShardedDataParallel& fsdp,
                             torch::optim::Optimizer* optimizer,
                             const std::map<std::string, std::string>& metadata = {});

/// Loads a checkpoint that save_sharded_checkpoint wrote (or the newest of a Trainer's fsdp
/// checkpoints in `dir`), by a job of any number of ranks, into `fsdp`, its buffers and
/// `optimizer` (when not null; it must step fsdp.parameters(), as the saved one did), and returns
/// the metadata saved with it (a Trainer's checkpoint: its "step"). No communication: every rank
/// reads what it needs. Throws c10::Error with one line, before changing anything, for a directory
/// without a manifest (no checkpoint, or one whose save did not finish), a missing or damaged rank
/// file, and a checkpoint of another model (naming the first unit, parameter or shape that
/// differs).
std::map<std::string, std::string> load_sharded_checkpoint(const std::string& dir,
                                                           FullyShardedDataParallel& fsdp,
                                                           torch::optim::Optimizer* optimizer);

/// What consolidate_sharded_checkpoint wrote.
struct ConsolidatedCheckpoint {
  int64_t tensors = 0;     ///< one per parameter and buffer of the model
  int64_t parameters = 0;  ///< their elements, in all
};

/// Writes the whole model of the sharded checkpoint in `dir` (save_sharded_checkpoint's, or the
/// newest of a Trainer's checkpoint directory under the fsdp strategy) to `out_file`: one
/// safetensors file (written atomically: an existing file is replaced whole or not at all) of
/// every parameter and buffer by its module name (or name_map's of it), in the dtype it was saved
/// in, with the checkpoint's metadata. Needs no process group and no model: the layout is the
/// manifest's. Holds one copy of the weights (not the optimizer's state) in memory. Throws
/// c10::Error with one line, before anything is written, for a `dir` that is a file (a manifest,
/// say) or holds no complete checkpoint, an `out_file` inside `dir` or named as a checkpoint's own
/// file (ckpt-N.json, ckpt-N.rank-R.safetensors, ...), a missing or damaged rank file, and two
/// names that name_map makes one.
ConsolidatedCheckpoint consolidate_sharded_checkpoint(
    const std::string& dir,
    const std::string& out_file,
    const std::function<std::string(const std::string&)>& name_map = nullptr);

/// The whole model of a sharded checkpoint in memory: what consolidate_sharded_checkpoint writes.
struct ConsolidatedModel {
  std::map<std::string, torch::Tensor> tensors;  ///< by module name, or name_map's of it
  std::map<std::string, std::string> metadata;   ///< the caller's; a Trainer checkpoint's step
  /// A Trainer checkpoint's run configuration (TrainerOptions::config, JSON); "" for one that
  /// save_sharded_checkpoint wrote.
  std::string config;
  ConsolidatedCheckpoint counts;
};

/// The same as consolidate_sharded_checkpoint, without writing: for another format (a Hugging
/// Face model directory, models/gpt_pretrained.h). Throws as consolidate_sharded_checkpoint does
/// for the checkpoint and for name_map.
ConsolidatedModel consolidate_sharded_model(
    const std::string& dir,
    const std::function<std::string(const std::string&)>& name_map = nullptr);

}  // namespace paratrain
