// Checkpoints for exact resume, for the Trainer and for users' own loops:
//
//   paratrain::Checkpoint ckpt(paratrain::CheckpointOptions("runs/ckpt").keep(3), pg);
//   if (auto last = ckpt.load_latest()) {                     // the newest one that verifies
//     paratrain::load_module_state(*model, paratrain::with_prefix(last->shared, "model.", true));
//     paratrain::load_optimizer_state(optimizer, paratrain::with_prefix(last->shared, "optim.",
//     true)); paratrain::set_rng_state(last->own); step = last->step;
//   }
//   ...
//   paratrain::CheckpointState s;
//   s.step = step;
//   s.shared = paratrain::with_prefix(paratrain::module_state(*model), "model.");
//   s.own = paratrain::rng_state();
//   ckpt.save(std::move(s));   // copies to host now, writes on a background thread
//
// Layout in the directory, for step N: rank 0 writes ckpt-N.safetensors (the state every rank
// shares: model, optimizer, masters) and then its manifest ckpt-N.json (the step, the world size,
// the caller's metadata as JSON, and the tensor file's size and CRC-32). Every rank r writes its
// own ckpt-N.rank-r.safetensors (RNG states), whose header holds the step, the rank, the world
// size and the CRC-32 of its tensor data. A sharded optimizer adds tensors to the rank files.
// Each file is written to a temporary name, fsynced and renamed; the directory is fsynced once,
// after the rank's last file. load_latest takes a checkpoint only when every file it reads
// verifies on every rank, so a checkpoint is either whole or skipped, and a damaged one (a missing
// or truncated file, a flipped byte) fails its checks on load. When every checkpoint there is
// damaged, load_latest fails (unless start_fresh_if_damaged) and nothing is deleted. Rotation
// (keep) deletes every file of a pruned step, rank files of any world size included, and never a
// checkpoint newer than the one resumed that this object did not write. Checkpoints of earlier
// versions, with a ckpt-N.rank-r.json beside each rank file, load as before.
#pragma once

#include "paratrain/comm/process_group.h"
#include "paratrain/util/atomic_file.h"  // write_file_atomic, which checkpoints use

#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace paratrain {

using TensorMap = std::map<std::string, torch::Tensor>;

struct CheckpointOptions {
  /* implicit */ CheckpointOptions(std::string dir = "") : dir_(std::move(dir)) {}
  /// The directory the checkpoints are written to.
  TORCH_ARG(std::string, dir);
  /// How many checkpoints stay on disk; older ones are deleted after each save. >= 1, and >= 2
  /// with a process group: a rank killed while writing the newest leaves only the one before.
  TORCH_ARG(int64_t, keep) = 3;
  /// Write on a background thread (save() returns after copying to host memory).
  TORCH_ARG(bool, background) = true;
  /// Where load_latest's collectives run: the CPU, or the rank's GPU for an nccl-only group.
  TORCH_ARG(torch::Device, collective_device) = torch::kCPU;
  /// Elastic jobs: load_latest also takes a checkpoint made by another number of ranks (rank r
  /// gets rank r's own tensors when that rank existed, else none).
  TORCH_ARG(bool, any_world_size) = false;
  /// When every checkpoint in the directory fails its checks, load_latest throws, naming the
  /// newest one's fault, and deletes nothing. With this it returns nullopt instead (a start from
  /// step 0): the damaged checkpoints stay on disk, and rotation deletes none of them (a save at
  /// the same step replaces one).
  TORCH_ARG(bool, start_fresh_if_damaged) = false;
};

struct CheckpointState {
  int64_t step = 0;
  /// A JSON object (text) saved in the manifest: counters, config, scaler state.
  std::string meta = "{}";
  /// Rank 0's tensors, the same on every rank (only rank 0's are written).
  TensorMap shared;
  /// This rank's own tensors (RNG states, shards).
  TensorMap own;
  /// Where it was loaded from (the manifest), empty for a new one.
  std::string path;
  /// The number of ranks that wrote it (set by load).
  int world_size = 1;
  /// The saving rank whose tensors `own` holds (set by load); -1: none.
  int rank = -1;
  /// Every rank's `own` tensors are needed to resume it on another number of ranks (ZeRO's
  /// shards), not only this rank's: load_latest then verifies them all before taking it.
  bool own_read_by_all = false;
};

class Checkpoint {
 public:
  /// Creates the directory if needed and checks that it is writable (c10::Error, one line, if
  /// not). With a process group, rank 0 writes the shared files and every rank its own.
  explicit Checkpoint(CheckpointOptions options, dist::ProcessGroupPtr pg = nullptr);
  ~Checkpoint();  // waits for the write under way (errors are reported to stderr)
  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;

  /// Copies the tensors to host memory on this thread, then writes (in the background when
  /// options.background). Waits for the previous save first and rethrows its error.
  void save(CheckpointState state);
  /// Waits for the save under way; rethrows its error.
  void wait();
  /// Seconds the last finished write took (background thread time).
  double last_write_seconds() const { return last_write_seconds_.load(); }

  /// The newest checkpoint that verifies on every rank (a collective with a process group: rank
  /// 0's listing is the one all ranks walk, so the directory must be shared by the ranks).
  /// A damaged one is skipped with a warning to `warn` (stderr by default) naming the file and
  /// the reason; one made by another number of ranks is an error. nullopt when there is none.
  /// When there are checkpoints but every one is damaged: c10::Error naming the newest one's
  /// fault, with nothing loaded or deleted (nullopt with options.start_fresh_if_damaged).
  /// Rotation then keeps every checkpoint newer than the one returned (set_resumed_step).
  std::optional<CheckpointState> load_latest(
      const std::function<void(const std::string&)>& warn = nullptr);
  /// The step the caller resumed from, when it loaded the checkpoint itself (load): rotation
  /// never deletes a checkpoint newer than it that this object did not write (one skipped as
  /// damaged, or one of the run the caller went back from). -1: keep every checkpoint that was
  /// in the directory. Without it (and without load_latest) every checkpoint counts for `keep`.
  void set_resumed_step(int64_t step);
  /// The steps of the manifests in the directory, newest first.
  std::vector<int64_t> steps() const;
  /// The same for any directory (none when it does not exist), without checking any file.
  static std::vector<int64_t> steps_in(const std::string& dir);
  /// The manifest of step `step` in `dir`: dir/ckpt-N.json, N in 10 digits.
  static std::string manifest_path(const std::string& dir, int64_t step);
  /// Rank `rank`'s file of step `step`: ckpt-N.rank-R.safetensors.
  static std::string rank_file_name(int64_t step, int rank);
  /// Whether `name` (a file name, no directory) is one a checkpoint writes: a manifest
  /// ckpt-N.json, a shared file ckpt-N.safetensors, or a rank file ckpt-N.rank-R.safetensors
  /// (earlier versions: ckpt-N.rank-R.json). Temporaries are not.
  static bool is_checkpoint_file(const std::string& name);
  /// The step such a file belongs to; -1 for any other name.
  static int64_t file_step(const std::string& name);

  /// Loads one checkpoint: `path` is its manifest (ckpt-N.json), and `rank` picks the rank files
  /// (rank < 0: none, `own` stays empty). Throws c10::Error naming the file and what is wrong.
  static CheckpointState load(const std::string& path, int rank = 0);
  /// The same, where this rank's own files may be absent (a checkpoint of fewer ranks): `own` is
  /// then empty, and no rank file is read (nor for rank < 0).
  static CheckpointState load_shared(const std::string& path, int rank);
  /// Only rank `rank`'s own tensors of the checkpoint at `path` (its manifest) of step `step`,
  /// saved by `world_size` ranks, verified: another rank's shards, to reshard state saved by
  /// another number of ranks (world_size < 0: not checked). When the state says own_read_by_all,
  /// load_latest with any_world_size verifies every saving rank's files before it takes it.
  /// With `keep`, only the tensors it accepts are made (the file is verified whole).
  static TensorMap load_own(const std::string& path,
                            int rank,
                            int64_t step,
                            int world_size = -1,
                            const std::function<bool(const std::string&)>& keep = nullptr);
  /// The number of ranks that saved the checkpoint whose manifest is `path`.
  static int saved_world_size(const std::string& path);

  const CheckpointOptions& options() const { return options_; }

 private:
  void write(const CheckpointState& state);
  void prune(int64_t newest);
  void remove_stale_temporaries();
  std::vector<int64_t> agreed_steps() const;
  CheckpointOptions options_;
  dist::ProcessGroupPtr pg_;
  int rank_ = 0;
  // Rotation's bounds: the steps this object wrote, and the step resumed from (the checkpoints
  // above it that are not in written_ are never deleted).
  std::set<int64_t> written_;
  int64_t resumed_step_ = std::numeric_limits<int64_t>::max();
  std::thread writer_;
  std::exception_ptr error_;
  std::atomic<double> last_write_seconds_{0};
};

/// `prefix` + each key; with `strip`, only the keys that start with `prefix`, without it.
TensorMap with_prefix(const TensorMap& tensors, const std::string& prefix, bool strip = false);

/// The optimizer's per-parameter state (SGD's momentum buffers; Adam's and AdamW's moments and
/// step counts) as tensors keyed "<group>.<index>.<field>". Other optimizers: c10::Error.
TensorMap optimizer_state(torch::optim::Optimizer& optimizer);
/// Restores what optimizer_state() returned into an optimizer over the same parameters.
void load_optimizer_state(torch::optim::Optimizer& optimizer, const TensorMap& state);

/// The CPU generator's state ("rng.cpu") and each CUDA device's ("rng.cuda.N").
TensorMap rng_state();
void set_rng_state(const TensorMap& state);

}  // namespace paratrain
