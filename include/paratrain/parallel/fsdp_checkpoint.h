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
// The directory, for a job of W ranks:
//   rank-R-of-W.safetensors  rank R's shards: "model.<unit>" (one flat tensor per unit, "root"
//                            for the root) and "optim.<group>.<index>.<field>" (optimizer_state's
//                            keys, each the optimizer's state for one unit's shard); its
//                            safetensors metadata holds the layout as JSON ("fsdp.layout": the
//                            world size, the rank, each unit's name, parameters, shapes, offsets,
//                            flat and padded sizes) and the caller's metadata
//   fsdp.json                the manifest, written by rank 0 after every rank file is on disk:
//                            the world size, the layout, which unit each optimizer parameter
//                            steps, the caller's metadata, and each rank file's size and CRC-32
// Every file is written atomically (write_pieces_atomic). A save first removes the manifest and
// writes it again last: a directory without fsdp.json is a checkpoint that is not complete (a
// save that crashed), and a rank file that does not match the manifest's size and CRC-32 is one
// left over from another save.
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
// The directory must be one that every rank sees (a shared file system). Loading reads only the
// old ranks' files that hold a piece of this rank's slices: on the same world size, its own.

#include "paratrain/parallel/fully_sharded_data_parallel.h"

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>

namespace paratrain {

/// The manifest's file name in a sharded checkpoint's directory.
constexpr const char* kFsdpManifest = "fsdp.json";

/// Writes this rank's shards of `fsdp`'s weights and of `optimizer`'s state (when not null; SGD,
/// Adam or AdamW over fsdp.parameters()) to `dir` (made if missing), and `metadata` (text to
/// text: a step, a config) with them. A collective: call it on every rank; it returns once the
/// whole checkpoint is on disk. When any rank fails (an unwritable directory, a full disk), every
/// rank throws c10::Error, that rank with its own reason, the others naming it.
void save_sharded_checkpoint(const std::string& dir,
                             FullyShardedDataParallel& fsdp,
                             torch::optim::Optimizer* optimizer,
                             const std::map<std::string, std::string>& metadata = {});

/// Loads a checkpoint that save_sharded_checkpoint wrote, by a job of any number of ranks, into
/// `fsdp` and `optimizer` (when not null; it must step fsdp.parameters(), as the saved one did),
/// and returns the metadata saved with it. No communication: every rank reads what it needs.
/// Throws c10::Error with one line, before changing anything, for a directory without a manifest
/// (no checkpoint, or one whose save did not finish), a missing or damaged rank file, and a
/// checkpoint of another model (naming the first unit, parameter or shape that differs).
std::map<std::string, std::string> load_sharded_checkpoint(const std::string& dir,
                                                           FullyShardedDataParallel& fsdp,
                                                           torch::optim::Optimizer* optimizer);

/// What consolidate_sharded_checkpoint wrote.
struct ConsolidatedCheckpoint {
  int64_t tensors = 0;     ///< one per parameter of the model
  int64_t parameters = 0;  ///< their elements, in all
};

/// Writes the whole model of the sharded checkpoint in `dir` (save_sharded_checkpoint's, or the
/// newest of a Trainer's checkpoint directory under the fsdp strategy) to `out_file`: one
/// safetensors file (written atomically: an existing file is replaced whole or not at all) of
/// every parameter by its module name (or name_map's of it), in the dtype it was saved in, with
/// the checkpoint's metadata. Needs no process group and no model: the layout is the manifest's.
/// Holds one copy of the weights (not the optimizer's state) in memory. Throws c10::Error with one
/// line, before anything is written, for a `dir` that is a file (a manifest, say) or holds no
/// complete checkpoint, an `out_file` inside `dir` or named as a checkpoint's own file
/// (ckpt-N.json, fsdp.json, rank-R-of-W.safetensors, ...), a missing or damaged rank file, and two
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
