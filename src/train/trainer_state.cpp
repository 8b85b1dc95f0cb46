// The Trainer's training state and checkpoints: capture() gathers the model, the optimizer (ZeRO's
// shards consolidated or not), the schedule, the GradScaler, the O2 masters, every rank's RNG
// states and where the sampler was in the epoch; restore() puts a checkpoint's back (an elastic
// job: over another world size); resume() finds the checkpoint to resume from.

#include "trainer_impl.h"

#include "paratrain/base/option_error.h"
#include "paratrain/io/safetensors.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <sstream>

namespace paratrain {

CheckpointState Trainer::Impl::capture() {
  CheckpointState s;
  s.step = global_step;
  Json scaler;
  for (const auto& kv : mp->scaler().state_dict()) {
    scaler[kv.first] = kv.second;
  }
  Json meta = Json{{"epoch", epoch},
                   {"batch", batch},
                   {"epoch_start", epoch_start},
                   {"epoch_cap", epoch_cap},
                   {"batches_per_epoch", batches_per_epoch},
                   {"world_size", world},
                   {"data_world", data_world},
                   {"batch_size", o.batch_size()},
                   {"global_step", global_step},
                   {"schedule_steps", schedule->steps()},
                   {"scaler", scaler},
                   {"strategy", to_string(o.strategy())},
                   {"config", Json::parse(o.config())}};
  s.meta = meta.dump();
  strategy->capture(s, *opt);
  for (auto& kv : rng_state()) {
    s.own[kv.first] = std::move(kv.second);
  }
  if (mp->opt_level() == amp::OptLevel::kO2) {
    for (size_t i = 0; i < mp->masters().size(); ++i) {
      s.shared["amp.master." + std::to_string(i)] = mp->masters()[i];
    }
  }
  return s;
}

namespace {

// The first key whose value differs, as one line; empty when equal. Keys in `may_change` (their
// dashes read as underscores, as flag names) are not compared.
std::string first_difference(const Json& saved,
                             const Json& now,
                             const std::vector<std::string>& may_change) {
  std::set<std::string> keys;
  for (const auto& kv : saved.items()) {
    keys.insert(kv.key());
  }
  for (const auto& kv : now.items()) {
    keys.insert(kv.key());
  }
  for (std::string name : may_change) {
    std::replace(name.begin(), name.end(), '-', '_');
    keys.erase(name);
  }
  for (const auto& k : keys) {
    const Json a = saved.contains(k) ? saved.at(k) : Json("(unset)");
    const Json b = now.contains(k) ? now.at(k) : Json("(unset)");
    if (a != b) {
      return "'" + k + "' is " + a.dump() + " there and " + b.dump() + " in this run";
    }
  }
  return "";
}

}  // namespace

// The saved run's configuration against this one's (the keys that may change aside).
void Trainer::Impl::check_saved_config(const CheckpointState& s, const Json& meta) const {
  const std::string model_diff = strategy->saved_model_difference(s);
  TORCH_CHECK(model_diff.empty(), "checkpoint ", s.path, " is from another model: ", model_diff);
  const std::string config_diff =
      first_difference(meta.at("config"), Json::parse(o.config()), o.resume_may_change());
  PARATRAIN_CHECK_OPTION(config_diff.empty(), "config", "checkpoint '", s.path,
                         "' was made with another configuration: ", config_diff,
                         "; use the same settings, or another checkpoint_dir");
}

void Trainer::Impl::restore(const CheckpointState& s) {
  try {
    const Json meta = Json::parse(s.meta);
    check_saved_config(s, meta);
    strategy->restore(s, meta, *opt);  // after the checks: nothing is loaded from a refused one
    if (mp->opt_level() == amp::OptLevel::kO2) {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < mp->masters().size(); ++i) {
        auto it = s.shared.find("amp.master." + std::to_string(i));
        TORCH_CHECK(it != s.shared.end(), "checkpoint ", s.path,
                    " has no O2 master weights: it was saved at another opt level");
        mp->masters()[i].copy_(it->second);
      }
    }
    schedule->set_steps(meta.at("schedule_steps").get<int64_t>());
    std::map<std::string, double> scaler;
    for (const auto& kv : meta.at("scaler").items()) {
      scaler[kv.key()] = kv.value().get<double>();
    }
    if (!scaler.empty()) {
      mp->scaler().load_state_dict(scaler);
    }
    restore_progress(s, meta);
  } catch (const Json::exception& e) {
    TORCH_CHECK(false, "checkpoint ", s.path, " lacks a field (", e.what(),
                "): it is damaged or from another program");
  }
  resumed_from = s.path;
}

// Where the saved run was: the epoch, the batch, and the RNG streams, or (another world) the
// rest of the epoch shared out over this one.
void Trainer::Impl::restore_progress(const CheckpointState& s, const Json& meta) {
  epoch = meta.at("epoch").get<int64_t>();
  batch = meta.at("batch").get<int64_t>();
  global_step = meta.at("global_step").get<int64_t>();
  epoch_start = meta.value("epoch_start", int64_t{0});
  epoch_cap = meta.value("epoch_cap", int64_t{0});
  // The ranks that drew different data: on a device mesh, the data-parallel ones (the world over
  // its tp degree, for the first mesh checkpoints, which did not record them).
  int64_t saved_data_world = s.world_size;
  if (meta.contains("data_world")) {
    saved_data_world = meta.at("data_world").get<int64_t>();
  } else if (meta.contains("mesh")) {
    const std::string dims = meta.at("mesh").value("dims", std::string());
    const size_t tp = dims.find("tp=");
    saved_data_world /= tp == std::string::npos ? 1 : std::max(1, std::atoi(dims.c_str() + tp + 3));
  }
  if (s.world_size == world) {
    set_rng_state(s.own);
  }
  if (s.world_size != world || saved_data_world != data_world) {
    // Another world (elastic), or another mesh: the saved ranks took, between them, the first
    // data_world * batch_size * batch samples of the epoch's order after its start (the sampler
    // interleaves them); the rest is shared out over this world from its first batch. The RNG
    // streams of another world belonged to ranks that no longer exist.
    const int64_t saved_batch = meta.value("batch_size", o.batch_size());
    const int64_t saved_batches = meta.value("batches_per_epoch", int64_t{0});
    epoch_start = std::min<int64_t>(static_cast<int64_t>(train->size()),
                                    epoch_start + saved_data_world * saved_batch * batch);
    if (saved_batches > 0 && batch >= saved_batches) {
      epoch_start = static_cast<int64_t>(train->size());  // the epoch was done
    } else if (o.steps_per_epoch() > 0) {
      // What is left of the epoch's step budget (the data may end first: refresh_batches takes
      // the smaller).
      const int64_t budget = epoch_cap > 0 ? epoch_cap : o.steps_per_epoch() * o.accumulate();
      epoch_cap = std::max<int64_t>(1, budget - batch);
    }
    batch = 0;
  }
  sampler->set_start_index(static_cast<size_t>(epoch_start));
  refresh_batches();
}

// Under ddp and fsdp, whether every rank loaded its part of the checkpoint it was given: each
// rank reads its own files, and one that fails must not leave the others restoring (and saying
// so) and training without it. Throws on every rank when any failed: that rank with its own
// error, the others naming it.
void Trainer::Impl::agree_on_load(const std::string& path, const std::exception_ptr& error) {
  if (!o.process_group()) {
    if (error) {
      std::rethrow_exception(error);
    }
    return;
  }
  at::Tensor failed = torch::zeros({world}, torch::kInt);
  failed[rank].fill_(error ? 1 : 0);
  failed = failed.to(device);                    // the group's device
  o.process_group()->allreduce(failed)->wait();  // every rank's flag
  failed = failed.cpu();
  if (error) {
    std::rethrow_exception(error);
  }
  for (int r = 0; r < world; ++r) {
    TORCH_CHECK(failed[r].item<int>() == 0, "checkpoint ", path, " failed its checks on rank ", r,
                " (whose error says why): nothing was restored");
  }
}

// The newest checkpoint that verifies everywhere. The Checkpoint's options are the Trainer's under
// other names: a refusal naming one names the Trainer's.
std::optional<CheckpointState> Trainer::Impl::load_latest() {
  try {
    return ckpt->load_latest();
  } catch (const OptionError& e) {
    static const std::map<std::string, std::string> ours{{"any_world_size", "elastic"}};
    const auto it = ours.find(e.field());
    if (it == ours.end()) {
      throw;
    }
    std::string text = e.what_without_backtrace();
    for (size_t at = text.find(it->first); at != std::string::npos; at = text.find(it->first)) {
      text.replace(at, it->first.size(), it->second);
    }
    throw OptionError(it->second, text);
  }
}

void Trainer::Impl::resume() {
  if (o.resume() == "auto") {
    // Every rank agrees on the newest checkpoint that verified everywhere; when there are
    // checkpoints and none verifies, this fails (deleting nothing) unless start_fresh_if_damaged.
    std::optional<CheckpointState> s = load_latest();
    if (!s) {
      if (rank == 0) {
        if (ckpt->steps().empty()) {
          std::cerr << "paratrain: no checkpoint in " << o.checkpoint_dir()
                    << " yet: starting from step 0" << std::endl;
        } else {
          std::cerr << "paratrain: every checkpoint in " << o.checkpoint_dir()
                    << " is damaged: starting from step 0, as asked; they stay where they are, "
                       "and no save deletes them"
                    << std::endl;
        }
      }
      write_metrics(Json{{"resumed_from", nullptr}, {"step", 0}});
      return;
    }
    // A rank may fail alone here (an fsdp checkpoint of another world size: each rank reads the
    // saving ranks' files that hold its slices): every rank learns it before training.
    std::exception_ptr error;
    try {
      restore(*s);
    } catch (const std::exception&) {
      error = std::current_exception();
    }
    agree_on_load(s->path, error);
  } else {
    // An elastic job may resume a checkpoint of another world size: ranks it did not have get
    // no own files.
    // Checked from the manifest, alike on every rank, before a rank beyond the saved world
    // fails alone on its missing file while the others go on into training.
    struct stat st;
    PARATRAIN_CHECK_OPTION(::stat(o.resume().c_str(), &st) == 0 || errno != ENOENT, "resume",
                           "resume '", o.resume(),
                           "' does not exist: give a ckpt-N.json manifest, or resume auto");
    const int saved_world = Checkpoint::saved_world_size(o.resume());
    PARATRAIN_CHECK_OPTION(o.elastic() || saved_world == world, "elastic", "checkpoint '",
                           o.resume(), "' was made by ", saved_world, " ranks and this job has ",
                           world, ": start as many ranks, or set elastic to reshard it");
    std::optional<CheckpointState> s;
    std::exception_ptr error;
    try {
      s = o.elastic() ? Checkpoint::load_shared(o.resume(), rank)
                      : Checkpoint::load(o.resume(), rank);
      restore(*s);
    } catch (const std::exception&) {
      error = std::current_exception();
    }
    agree_on_load(o.resume(), error);
    if (ckpt) {
      // The checkpoints of checkpoint_dir newer than this one stay (a run the caller went back
      // from): rotation deletes only older ones and this run's own.
      ckpt->set_resumed_step(s->step);
    }
  }
  // Everything verified and restored, on every rank: in the metrics, where this attempt starts
  // (the steps logged after it repeat lost work).
  write_metrics(Json{{"resumed_from", resumed_from}, {"step", global_step}});
  if (rank == 0) {
    std::cerr << "paratrain: resumed from " << resumed_from << " (step " << global_step
              << ", epoch " << epoch + 1 << ", batch " << batch << ")" << std::endl;
  }
}

void Trainer::save_checkpoint() {
  TORCH_CHECK(impl_->ckpt, "save_checkpoint needs checkpoint_dir");
  impl_->ckpt->save(impl_->capture());
  impl_->ckpt->wait();
}

void Trainer::wait_for_checkpoint() {
  if (impl_->ckpt) {
    impl_->ckpt->wait();
  }
}

}  // namespace paratrain
