// Sharded checkpoints of FullyShardedDataParallel: a rank's part of one (capture), taking one
// back on any number of ranks (restore, resharding), save_sharded_checkpoint and its load over
// io::Checkpoint, and the consolidation into one file. The format is described in
// fsdp_checkpoint.h; fsdp_saved.cpp reads it, and the older fsdp.json form.

#include "paratrain/parallel/fsdp_checkpoint.h"

#include "fsdp_saved.h"
#include "paratrain/io/safetensors.h"
#include "paratrain/util/atomic_file.h"
#include "util/strings.h"

#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

namespace paratrain {

namespace {

using fsdp_saved::Json;
using fsdp_saved::SavedShards;
using fsdp_saved::Unit;
using fsdp_saved::unit_key;
using torch::Tensor;

// The saving ranks whose files hold a piece of one of this rank's slices: the only files it
// reads (on the same world size, its own).
std::vector<bool> needed_ranks(const SavedShards& m, const FullyShardedDataParallel& fsdp) {
  std::vector<bool> out(static_cast<size_t>(m.world), false);
  const auto now = fsdp.units();
  for (size_t k = 0; k < now.size(); ++k) {
    if (now[k].padded == 0) {
      continue;
    }
    const int64_t size = now[k].padded / fsdp.world_size();
    const int64_t begin = fsdp.rank() * size;
    const int64_t end = std::min(begin + size, now[k].numel);  // the padding needs no file
    const int64_t old_size = m.units[k].padded / m.world;
    for (int q = 0; q < m.world; ++q) {
      if (begin < end && q * old_size < end && (q + 1) * old_size > begin) {
        out[static_cast<size_t>(q)] = true;
      }
    }
  }
  return out;
}

// The pieces of tensor `name` (of unit `unit`) over the saving ranks: the files read, and for the
// others zeros that take no memory (reshard takes only their size from them).
std::vector<Tensor> pieces_of(const std::vector<TensorMap>& files,
                              const std::vector<bool>& read,
                              const SavedShards& m,
                              size_t unit,
                              const std::string& name) {
  const int64_t size = m.units[unit].padded / m.world;
  std::vector<Tensor> pieces(files.size());
  torch::ScalarType dtype = torch::kFloat;
  for (size_t r = 0; r < files.size(); ++r) {
    if (read[r]) {
      auto it = files[r].find(name);
      TORCH_CHECK(it != files[r].end() && it->second.dim() == 1 && it->second.numel() == size,
                  m.file(static_cast<int>(r)), " has no '", name, "' of ", size,
                  " elements, as the layout in its manifest says it must: the file is damaged");
      pieces[r] = it->second;
      dtype = it->second.scalar_type();
    }
  }
  for (auto& p : pieces) {
    if (!p.defined()) {
      p = torch::zeros({1}, torch::TensorOptions().dtype(dtype)).expand({size});
    }
  }
  return pieces;
}

// The saving ranks' files this rank reads, the others left empty.
struct OldFiles {
  std::vector<TensorMap> files;
  std::vector<bool> read;
  // The file the optimizer's state that is the same on every rank (Adam's step) comes from: the
  // first one read, or rank 0's when none is.
  size_t source = 0;
};

// Every file is read and checked before anything is loaded.
OldFiles read_old_files(const SavedShards& m, const FullyShardedDataParallel& fsdp, bool optim) {
  OldFiles old;
  old.read = needed_ranks(m, fsdp);
  old.files.resize(old.read.size());
  const auto first = std::find(old.read.begin(), old.read.end(), true);
  old.source = first == old.read.end() ? 0 : static_cast<size_t>(first - old.read.begin());
  for (size_t r = 0; r < old.files.size(); ++r) {
    if (old.read[r] || (optim && r == old.source)) {
      old.files[r] = m.read(static_cast<int>(r), optim);
    }
  }
  return old;
}

// This rank's part of the saved optimizer state: the tensors laid out as the unit's shard
// resharded, the rest (Adam's step) as the source file has it.
TensorMap optimizer_slices(const OldFiles& old,
                           const SavedShards& m,
                           const FullyShardedDataParallel& fsdp) {
  TensorMap out;
  for (const auto& [key, t] : with_prefix(old.files[old.source], "optim.", /*strip=*/true)) {
    const std::string param = key.substr(0, key.find('.', key.find('.') + 1) + 1);
    auto owner = m.optimizer.find(param);
    TORCH_CHECK(owner != m.optimizer.end(), m.file(static_cast<int>(old.source)),
                " holds optimizer state '", key,
                "' of a parameter its manifest does not list: the file is damaged");
    const size_t unit = owner->second;
    if (t.dim() == 1 && t.numel() == m.units[unit].padded / m.world) {
      out[key] = fsdp.reshard(unit, pieces_of(old.files, old.read, m, unit, "optim." + key));
    } else {
      out[key] = t;
    }
  }
  return out;
}

// Refuses, before anything is read or changed, a checkpoint that this model and optimizer could
// not take: another layout, an optimizer that steps the units otherwise, a missing buffer.
void check_compatible(const SavedShards& m,
                      FullyShardedDataParallel& fsdp,
                      torch::optim::Optimizer* optimizer) {
  const std::string difference = fsdp_saved::layout_difference(m.units, fsdp.units());
  TORCH_CHECK(difference.empty(), "the checkpoint in ", m.where,
              " is of another model: ", difference,
              "; load it into a model built as the one that saved it");
  if (optimizer != nullptr) {
    const auto owners = fsdp_saved::optimizer_units(*optimizer, fsdp);
    for (const auto& [param, unit] : m.optimizer) {
      auto it = owners.find(param);
      TORCH_CHECK(it != owners.end() && it->second == unit, "the optimizer's parameter ",
                  param.substr(0, param.size() - 1), " steps unit '", unit_key(m.units.at(unit)),
                  "' in the checkpoint in ", m.where, " but ",
                  it == owners.end() ? "is not there" : "'" + unit_key(m.units[it->second]) + "'",
                  " here; build the optimizer over fsdp.parameters(), as the saved one was");
    }
  }
  fsdp_saved::check_buffers(m, fsdp);
}

// Takes a saved sharded state into `fsdp` and `optimizer` (when not null), resharding it over
// this world.
void load_shards(const SavedShards& m,
                 FullyShardedDataParallel& fsdp,
                 torch::optim::Optimizer* optimizer) {
  check_compatible(m, fsdp, optimizer);
  const bool optim = optimizer != nullptr && m.has_optimizer;
  if (m.world == fsdp.world_size()) {
    // This rank's own shards and optimizer state, as saved: no other file, and no unit made whole.
    const TensorMap own = m.read(fsdp.rank(), optim);
    fsdp.load_own_shards(with_prefix(own, m.prefix, /*strip=*/true));
    if (optimizer != nullptr) {
      load_optimizer_state(*optimizer, with_prefix(own, "optim.", /*strip=*/true));
    }
    fsdp_saved::load_buffers(m, fsdp);
    return;
  }
  OldFiles old = read_old_files(m, fsdp, optim);
  std::vector<TensorMap> shards(old.files.size());
  const auto units = fsdp.units();
  for (size_t k = 0; k < units.size(); ++k) {
    if (units[k].padded > 0) {
      const auto pieces = pieces_of(old.files, old.read, m, k, m.prefix + unit_key(units[k]));
      for (size_t r = 0; r < pieces.size(); ++r) {
        shards[r][unit_key(units[k])] = pieces[r];
      }
    }
  }
  const TensorMap state = optim ? optimizer_slices(old, m, fsdp) : TensorMap();
  old = OldFiles();  // what was read and not kept in `shards` or `state`
  fsdp.load_sharded_state(shards);
  if (optimizer != nullptr) {
    load_optimizer_state(*optimizer, state);
  }
  fsdp_saved::load_buffers(m, fsdp);
}

// Runs `step` on this rank, then lets every rank know whether all succeeded (an allgather of
// {ok, values...}), so that none waits in a later collective for a rank that gave up. Returns
// every rank's values; throws when any rank failed: that rank with its own error, the others
// naming it.
std::vector<int64_t> on_every_rank(FullyShardedDataParallel& fsdp,
                                   const std::string& what,
                                   size_t values,
                                   const std::function<std::vector<int64_t>()>& step) {
  std::exception_ptr error;
  std::vector<int64_t> mine(values + 1, 0);
  try {
    const std::vector<int64_t> got = step();
    TORCH_INTERNAL_ASSERT(got.size() == values);
    mine[0] = 1;
    std::copy(got.begin(), got.end(), mine.begin() + 1);
  } catch (...) {
    error = std::current_exception();
  }
  const int world = fsdp.world_size();
  const torch::Device device = fsdp.parameters().at(0).device();  // where the group runs
  Tensor all = torch::empty({world * static_cast<int64_t>(values + 1)},
                            torch::TensorOptions().dtype(torch::kLong).device(device));
  std::vector<Tensor> outputs = all.chunk(world);
  fsdp.process_group()->allgather(outputs, torch::tensor(mine).to(device))->wait();
  if (error) {
    std::rethrow_exception(error);
  }
  all = all.cpu();
  std::vector<int64_t> out;
  for (int r = 0; r < world; ++r) {
    const int64_t* row = all.data_ptr<int64_t>() + r * static_cast<int64_t>(values + 1);
    TORCH_CHECK(row[0] == 1, "save_sharded_checkpoint: rank ", r, " could not ", what,
                " (its own error says why); the checkpoint is incomplete");
    out.insert(out.end(), row + 1, row + 1 + values);
  }
  return out;
}

// A safetensors file written atomically.
void write_safetensors(const std::string& path,
                       const TensorMap& tensors,
                       const std::map<std::string, std::string>& meta) {
  const SafetensorsParts parts = encode_safetensors(tensors, meta);
  std::vector<FilePiece> pieces{{parts.header.data(), parts.header.size()}};
  for (const auto& t : parts.tensors) {
    pieces.push_back({t.data_ptr(), t.nbytes()});
  }
  write_pieces_atomic(path, pieces);
}

void make_directory(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TORCH_CHECK(!ec && ::access(dir.c_str(), W_OK | X_OK) == 0,
              "cannot write the checkpoint directory ", dir, ": ",
              ec ? ec.message() : std::string(std::strerror(errno)), "; give a writable directory");
}

// rank-R-of-W.safetensors: a rank file of the older format.
bool is_old_rank_file(const std::string& name) {
  auto digits = [](const std::string& t) {
    return !t.empty() && t.find_first_not_of("0123456789") == std::string::npos;
  };
  const std::string tensors = ".safetensors";
  if (!detail::starts_with(name, "rank-") || name.size() <= 5 + tensors.size() ||
      !detail::ends_with(name, tensors)) {
    return false;
  }
  const std::string middle = name.substr(5, name.size() - 5 - tensors.size());  // R-of-W
  const size_t of = middle.find("-of-");
  return of != std::string::npos && digits(middle.substr(0, of)) && digits(middle.substr(of + 4));
}

// The files of the save before, removed by rank 0 before any rank writes: that save's manifest
// first (it is no checkpoint any more), then the files it listed, and an older format's. A rank
// file of that save left in place could pass for one of this save.
void remove_previous_save(const std::string& dir, int64_t step) {
  TORCH_CHECK(step >= 0, "remove_previous_save: step ", step, " is no checkpoint's");
  for (const std::string& manifest :
       {Checkpoint::manifest_path(dir, step), dir + "/" + fsdp_saved::kOldManifest}) {
    TORCH_CHECK(::unlink(manifest.c_str()) == 0 || errno == ENOENT, "cannot remove the old ",
                manifest, ": ", std::strerror(errno));
  }
  std::vector<std::string> stale;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (Checkpoint::file_step(name) == step || is_old_rank_file(name)) {
      stale.push_back(entry.path().string());
    }
  }
  for (const auto& path : stale) {
    ::unlink(path.c_str());
  }
}

// The output of a consolidation, checked before anything is read: never in the checkpoint's own
// directory, and never under the name of a file that a checkpoint lists (anywhere: replacing one
// would damage that checkpoint, and a new one would pass for a checkpoint's file).
void check_output(const std::string& dir, const std::string& out_file) {
  const std::string out_dir = parent_directory(out_file);
  struct stat a {};
  struct stat b {};
  TORCH_CHECK(::stat(out_dir.c_str(), &a) != 0 || ::stat(dir.c_str(), &b) != 0 ||
                  a.st_dev != b.st_dev || a.st_ino != b.st_ino,
              "consolidate: the output file ", out_file, " is in the checkpoint's directory ", dir,
              ", whose files are the checkpoint: write it elsewhere");
  const std::string name = out_file.substr(out_file.rfind('/') + 1);
  TORCH_CHECK(!Checkpoint::is_checkpoint_file(name) && !is_old_rank_file(name) &&
                  name != fsdp_saved::kOldManifest,
              "consolidate: the output file ", out_file,
              " has the name of a checkpoint's own file (", name,
              "), which it would replace or pass for: give it another name");
}

// The whole model of a saved sharded state, every saving rank's file read (on a mesh, the first
// replica's), tensor-parallel parts joined.
ConsolidatedModel consolidate(const SavedShards& m,
                              const std::function<std::string(const std::string&)>& name_map) {
  auto files = fsdp_saved::read_all(m, /*optimizer=*/false);
  ConsolidatedModel model;
  std::map<std::string, std::string> source;  // each output name's parameter or buffer
  auto add = [&](const std::string& name, const Tensor& t) {
    const std::string to = name_map ? name_map(name) : name;
    TORCH_CHECK(source.emplace(to, name).second, "consolidate: '", name, "' and '", source[to],
                "' would both be saved as '", to, "'");
    model.tensors[to] = t;
  };
  for (size_t k = 0; k < m.units.size(); ++k) {
    const Unit& u = m.units[k];
    if (u.padded == 0) {
      continue;
    }
    const std::string name = m.prefix + unit_key(u);
    for (const auto& [param, t] : fsdp_saved::whole_of_unit(files, m, k, name)) {
      add(param, t);
      ++model.counts.tensors;
      model.counts.parameters += t.numel();
    }
    for (auto& part : files) {
      for (auto& f : part) {
        f.erase(name);  // one copy of the weights at a time: the pieces go as the units are made
      }
    }
  }
  for (const auto& [name, t] : m.buffers) {  // not sharded
    add(name, t);
    ++model.counts.tensors;
  }
  model.metadata = m.metadata;
  model.config = m.config;
  return model;
}

// The whole model of every pipeline stage (each holds its own units; one stage without them).
ConsolidatedModel consolidate_stages(
    const SavedShards& m, const std::function<std::string(const std::string&)>& name_map) {
  ConsolidatedModel model = consolidate(m, name_map);
  for (int stage = 1; stage < m.pp; ++stage) {
    SavedShards other = fsdp_saved::stage_part(m, stage, 0);
    other.buffers.clear();  // taken once, with the first stage
    ConsolidatedModel part = consolidate(other, name_map);
    for (auto& [name, t] : part.tensors) {
      TORCH_CHECK(model.tensors.emplace(name, std::move(t)).second, "consolidate: two pipeline ",
                  "stages of ", m.where, " give the name '", name,
                  "' (a name_map that makes two names one, or a damaged checkpoint)");
    }
    model.counts.tensors += part.counts.tensors;
    model.counts.parameters += part.counts.parameters;
  }
  return model;
}

bool same_split(const SavedShards& m, const TensorParallelLayout& layout) {
  if (m.tp != layout.degree || m.split.size() != layout.shards.size()) {
    return false;
  }
  for (const auto& [name, split] : layout.shards) {
    auto it = m.split.find(name);
    if (it == m.split.end() || it->second.dim != split.dim || it->second.chunks != split.chunks) {
      return false;
    }
  }
  return true;
}

// A saved state into a model split as `layout` (on tensor-parallel rank `tp_rank`): shard by
// shard when tensor parallelism split it alike, else through the whole tensors.
void load_onto_mesh(const SavedShards& m,
                    FullyShardedDataParallel& fsdp,
                    torch::optim::Optimizer* optimizer,
                    const TensorParallelLayout& layout,
                    int tp_rank) {
  if (same_split(m, layout)) {
    load_shards(fsdp_saved::tp_part(m, tp_rank), fsdp, optimizer);
  } else {
    fsdp_saved::load_across_meshes(m, fsdp, optimizer, layout, tp_rank);
  }
}

// Pipeline stages are not resharded: a checkpoint's stages hold other units than another
// count's would.
void check_stages(const SavedShards& m, int stages) {
  TORCH_CHECK(m.pp == stages, "the checkpoint in ", m.where, " was saved on ",
              m.mesh.empty() ? "plain FSDP" : "mesh " + m.mesh, ", with ", m.pp, " pipeline stage",
              m.pp == 1 ? "" : "s", ", and this one has ", stages,
              "; restore it on a mesh with pp ", m.pp,
              " (its stages cannot be resharded; the other degrees can), or consolidate it");
}

}  // namespace

void capture_sharded_state(FullyShardedDataParallel& fsdp,
                           torch::optim::Optimizer* optimizer,
                           CheckpointState& state) {
  Json meta = Json::parse(state.meta, nullptr, false);
  TORCH_CHECK(meta.is_object(), "capture_sharded_state: the state's meta is not a JSON object");
  meta["fsdp"] = fsdp_saved::layout_json(fsdp, optimizer);  // the mapping is checked here
  state.meta = meta.dump();
  for (const auto& [unit, shard] : fsdp.sharded_state()) {
    state.own["fsdp." + unit] = shard;
  }
  if (optimizer != nullptr) {
    for (const auto& [key, t] : with_prefix(optimizer_state(*optimizer), "optim.")) {
      state.own[key] = t;
    }
  }
  for (const auto& b : fsdp.module()->named_buffers()) {
    state.shared["model." + b.key()] = b.value();
  }
  state.own_read_by_all = true;
}

void capture_sharded_state(FullyShardedDataParallel& fsdp,
                           torch::optim::Optimizer* optimizer,
                           CheckpointState& state,
                           const DeviceMesh& mesh,
                           const TensorParallelLayout& layout) {
  TORCH_CHECK(mesh.has("dp_shard") && mesh.size("dp_shard") == fsdp.world_size(),
              "capture_sharded_state: the model is sharded over ", fsdp.world_size(),
              " ranks, not over the mesh's dp_shard (", mesh.describe(),
              "); shard it over mesh[\"dp_shard\"]");
  capture_sharded_state(fsdp, optimizer, state);
  Json meta = Json::parse(state.meta);
  Json degrees = Json::array();
  for (const auto& [name, degree] : mesh.dims()) {
    degrees.push_back(Json::array({name, degree}));
  }
  Json split = Json::object();
  for (const auto& [name, shard] : layout.shards) {
    split[name] = {{"dim", shard.dim}, {"chunks", shard.chunks}};
  }
  meta["mesh"] = {{"dims", mesh.describe()}, {"degrees", degrees}, {"tensor_parallel", split}};
  if (mesh.size("pp") > 1) {  // each stage's units differ: the manifest holds every stage's
    Json stages = Json::array();
    const Json mine = {{"fsdp", meta.at("fsdp")}, {"tensor_parallel", split}};
    std::vector<std::string> all;
    mesh["pp"]->all_gather_object(all, mine.dump());
    for (const std::string& stage : all) {
      stages.push_back(Json::parse(stage));
    }
    meta["mesh"]["stages"] = stages;
  }
  state.meta = meta.dump();
}

void restore_sharded_state(const CheckpointState& state,
                           FullyShardedDataParallel& fsdp,
                           torch::optim::Optimizer* optimizer) {
  const SavedShards m = fsdp_saved::from_checkpoint(state);
  check_stages(m, 1);
  load_onto_mesh(m, fsdp, optimizer, {}, 0);
}

void restore_sharded_state(const CheckpointState& state,
                           FullyShardedDataParallel& fsdp,
                           torch::optim::Optimizer* optimizer,
                           const DeviceMesh& mesh,
                           const TensorParallelLayout& layout) {
  TORCH_CHECK(mesh.size("dp_shard") == fsdp.world_size(), "restore_sharded_state: the model is ",
              "sharded over ", fsdp.world_size(), " ranks, not over the mesh's dp_shard (",
              mesh.describe(), "); shard it over mesh[\"dp_shard\"]");
  TORCH_CHECK(layout.degree == mesh.size("tp"), "restore_sharded_state: the layout is of ",
              layout.degree, " tensor-parallel ranks and the mesh has tp ", mesh.size("tp"));
  const SavedShards m =
      fsdp_saved::from_checkpoint(state, mesh.local_rank("tp"), mesh.local_rank("pp"));
  check_stages(m, mesh.size("pp"));
  load_onto_mesh(m, fsdp, optimizer, layout, mesh.local_rank("tp"));
}

void save_sharded_checkpoint(const std::string& dir,
                             FullyShardedDataParallel& fsdp,
                             torch::optim::Optimizer* optimizer,
                             const std::map<std::string, std::string>& metadata) {
  // Everything to write is made before the directory is touched: an optimizer that cannot be
  // saved must not leave the old checkpoint without its manifest.
  CheckpointState state;
  state.step = 0;  // one checkpoint per directory
  state.meta = Json{{"metadata", metadata}}.dump();
  capture_sharded_state(fsdp, optimizer, state);
  on_every_rank(fsdp, "prepare " + dir, 0, [&] {
    make_directory(dir);
    const std::vector<int64_t> steps = Checkpoint::steps_in(dir);
    TORCH_CHECK(steps.empty() || steps.front() == state.step, "save_sharded_checkpoint: ", dir,
                " holds checkpoints of other steps (the newest: ",
                Checkpoint::manifest_path(dir, steps.empty() ? 0 : steps.front()),
                "), which it would not replace: save into a directory of its own");
    return std::vector<int64_t>{};
  });
  // Only once every rank is here (done loading from this directory, say) does the save before go.
  on_every_rank(fsdp, "remove the save before from " + dir, 0, [&] {
    if (fsdp.rank() == 0) {
      remove_previous_save(dir, state.step);
    }
    return std::vector<int64_t>{};
  });
  try {
    on_every_rank(fsdp, "write its shards to " + dir, 0, [&] {
      Checkpoint files(CheckpointOptions(dir).keep(2).background(false), fsdp.process_group());
      files.save(std::move(state));
      return std::vector<int64_t>{};
    });
  } catch (...) {
    // Rank 0 wrote the manifest after its own files, not after every rank's: a save that failed
    // on any rank must not be left as a checkpoint.
    if (fsdp.rank() == 0) {
      ::unlink(Checkpoint::manifest_path(dir, 0).c_str());
    }
    throw;
  }
}

std::map<std::string, std::string> load_sharded_checkpoint(const std::string& dir,
                                                           FullyShardedDataParallel& fsdp,
                                                           torch::optim::Optimizer* optimizer) {
  SavedShards m = fsdp_saved::from_directory(dir, fsdp.rank());
  check_stages(m, 1);
  load_onto_mesh(m, fsdp, optimizer, {}, 0);
  return m.metadata;
}

ConsolidatedModel consolidate_sharded_model(
    const std::string& dir, const std::function<std::string(const std::string&)>& name_map) {
  return consolidate_stages(fsdp_saved::from_directory(dir, 0), name_map);
}

ConsolidatedCheckpoint consolidate_sharded_checkpoint(
    const std::string& dir,
    const std::string& out_file,
    const std::function<std::string(const std::string&)>& name_map) {
  // A missing checkpoint is named before the output is looked at.
  const SavedShards m = fsdp_saved::from_directory(dir, 0);
  check_output(dir, out_file);
  const ConsolidatedModel model = consolidate_stages(m, name_map);
  write_safetensors(out_file, model.tensors, model.metadata);
  return model.counts;
}

}  // namespace paratrain
