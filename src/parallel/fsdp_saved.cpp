// Reading a saved sharded FSDP state, in either of its forms (fsdp_saved.h): the layout, its
// checks, the optimizer's mapping to units, and each saving rank's verified tensors.

#include "fsdp_saved.h"

#include "paratrain/io/safetensors.h"
#include "paratrain/util/atomic_file.h"
#include "util/files.h"
#include "util/strings.h"

#include <c10/util/Exception.h>

#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <string>
#include <utility>

namespace paratrain {
namespace fsdp_saved {

namespace {

constexpr const char* kOldFormat = "paratrain-fsdp-checkpoint-1";
// The older rank files' metadata key for their own world size and rank.
constexpr const char* kOldLayoutKey = "fsdp.layout";

Json units_json(const std::vector<Unit>& units) {
  Json out = Json::array();
  for (const Unit& u : units) {
    out.push_back(Json{{"name", u.name},
                       {"params", u.params},
                       {"shapes", u.shapes},
                       {"offsets", u.offsets},
                       {"numel", u.numel},
                       {"padded", u.padded}});
  }
  return out;
}

// The units of a saved layout, checked for the sizes consolidation and resharding rely on. The
// Trainer's checkpoints of earlier versions named the root unit "root", as sharded_state() does.
std::vector<Unit> units_of(const Json& j, int world, const std::string& where) {
  std::vector<Unit> out;
  for (const Json& item : j) {
    Unit u;
    u.name = item.at("name").get<std::string>();
    u.name = u.name == "root" ? "" : u.name;
    u.params = item.at("params").get<std::vector<std::string>>();
    u.shapes = item.at("shapes").get<std::vector<std::vector<int64_t>>>();
    u.offsets = item.at("offsets").get<std::vector<int64_t>>();
    u.numel = item.at("numel").get<int64_t>();
    u.padded = item.at("padded").get<int64_t>();
    bool fits = u.shapes.size() == u.params.size() && u.offsets.size() == u.params.size() &&
                u.numel >= 0 && u.padded == fsdp_padded_size(u.numel, world);
    for (size_t i = 0; fits && i < u.params.size(); ++i) {
      int64_t n = 1;
      for (int64_t d : u.shapes[i]) {
        fits = fits && d >= 0 && !__builtin_mul_overflow(n, d, &n);
      }
      fits = fits && u.offsets[i] >= 0 && u.offsets[i] <= u.numel - n;
    }
    TORCH_CHECK(fits, where, ": the layout of unit '", unit_key(u), "' does not add up (",
                u.params.size(), " parameters in ", u.numel, " elements padded to ", u.padded,
                " over ", world, " ranks): the file is damaged");
    out.push_back(std::move(u));
  }
  return out;
}

// The optimizer's mapping, checked against the units: null (saved without an optimizer) leaves
// it empty.
void read_optimizer(const Json& j, SavedShards& s) {
  s.has_optimizer = !j.is_null();
  if (!s.has_optimizer) {
    return;
  }
  s.optimizer = j.get<std::map<std::string, size_t>>();
  for (const auto& [param, unit] : s.optimizer) {
    TORCH_CHECK(unit < s.units.size() && s.units[unit].padded > 0, s.where,
                " says optimizer parameter ", param, " steps unit ", unit,
                ", which has no parameters: the file is damaged");
  }
}

// The Trainer's checkpoints of earlier versions have no mapping: their optimizer, of one group,
// stepped parameters() in order, one per unit that has parameters.
std::map<std::string, size_t> mapping_by_order(const std::vector<Unit>& units) {
  std::map<std::string, size_t> out;
  for (size_t k = 0, i = 0; k < units.size(); ++k) {
    if (units[k].padded > 0) {
      out["0." + std::to_string(i++) + "."] = k;
    }
  }
  return out;
}

std::string old_rank_file(int rank, int world) {
  return "rank-" + std::to_string(rank) + "-of-" + std::to_string(world) + ".safetensors";
}

// Rank r's file of the older format, checked against its manifest entry (size and CRC-32) and
// its own metadata (world and rank).
TensorMap read_old_rank_file(
    const std::string& path, const Json& entry, int world, int rank, bool optimizer) {
  const std::string bytes = detail::read_whole_file(path, "the rank file");
  const uint32_t crc = crc32_of({{bytes.data(), bytes.size()}});
  TORCH_CHECK(bytes.size() == entry.value("bytes", size_t(0)) && crc == entry.value("crc32", 0u),
              path, " has ", bytes.size(), " bytes and CRC-32 ", crc, ", but ", kOldManifest,
              " says ", entry.value("bytes", size_t(0)), " and ", entry.value("crc32", 0u),
              ": the file is damaged, or left from another save");
  const auto metadata = safetensors_metadata_bytes(bytes.data(), bytes.size(), path);
  const auto layout = metadata.find(kOldLayoutKey);
  Json own = layout == metadata.end() ? Json() : Json::parse(layout->second, nullptr, false);
  TORCH_CHECK(own.is_object() && own.value("world", -1) == world && own.value("rank", -1) == rank,
              path, " is not rank ", rank, "'s file of a checkpoint of ", world,
              " ranks (its metadata ", kOldLayoutKey, " says otherwise)");
  return load_safetensors_bytes(bytes.data(), bytes.size(), path, [=](const std::string& name) {
    return optimizer || !detail::starts_with(name, "optim.");
  });
}

SavedShards from_old_manifest(const std::string& dir) {
  const std::string path = dir + "/" + kOldManifest;
  SavedShards s;
  s.where = dir;
  s.prefix = "model.";
  std::vector<Json> files;
  try {
    const Json j = Json::parse(detail::read_whole_file(path, "the checkpoint manifest"));
    TORCH_CHECK(j.is_object() && j.value("format", "") == kOldFormat, path,
                " is not the manifest of a sharded FSDP checkpoint (its format is not ", kOldFormat,
                ")");
    s.world = j.at("world").get<int>();
    TORCH_CHECK(s.world >= 1, path, " names a world of ", s.world, " ranks: the file is damaged");
    s.units = units_of(j.at("units"), s.world, path);
    read_optimizer(j.at("optimizer"), s);
    s.metadata = j.at("metadata").get<std::map<std::string, std::string>>();
    files = j.at("files").get<std::vector<Json>>();
    TORCH_CHECK(files.size() == static_cast<size_t>(s.world), path, " lists ", files.size(),
                " rank files for a world of ", s.world, ": the file is damaged");
  } catch (const Json::exception& e) {
    TORCH_CHECK(false, path, " is damaged (", e.what(), "); save the checkpoint again");
  }
  const int world = s.world;
  s.file = [dir, world](int r) { return dir + "/" + old_rank_file(r, world); };
  s.read = [file = s.file, files, world](int r, bool optimizer) {
    return read_old_rank_file(file(r), files[static_cast<size_t>(r)], world, r, optimizer);
  };
  return s;
}

// Checked up front, on every rank alike, so that a checkpoint with a missing file fails on all
// of them with the same line rather than on the ranks that would read that file.
void check_rank_files_exist(const SavedShards& s) {
  for (int r = 0; r < s.world; ++r) {
    struct stat st;
    TORCH_CHECK(::stat(s.file(r).c_str(), &st) == 0, "the checkpoint in ", s.where, " lacks ",
                s.file(r), " (rank ", r, "'s shards of ", s.world,
                "): it is incomplete; copy every rank's file with its manifest");
  }
}

std::string shape_text(const std::vector<int64_t>& shape) {
  return c10::str(c10::IntArrayRef(shape));
}

// The first difference between two units of the same name, "" when none.
std::string unit_difference(const Unit& a, const Unit& b) {
  for (size_t i = 0; i < std::max(a.params.size(), b.params.size()); ++i) {
    if (i >= a.params.size() || i >= b.params.size() || a.params[i] != b.params[i]) {
      return "unit '" + unit_key(a) + "' has parameter " +
             (i < a.params.size() ? "'" + a.params[i] + "'" : "none") +
             " in it where this model has " +
             (i < b.params.size() ? "'" + b.params[i] + "'" : "none") + " (" +
             std::to_string(a.params.size()) + " parameters in it, " +
             std::to_string(b.params.size()) + " here)";
    }
    if (a.shapes[i] != b.shapes[i]) {
      return "unit '" + unit_key(a) + "' has '" + a.params[i] + "' of shape " +
             shape_text(a.shapes[i]) + " in it but " + shape_text(b.shapes[i]) + " here";
    }
    if (a.offsets[i] != b.offsets[i]) {
      return "unit '" + unit_key(a) + "' has '" + a.params[i] + "' at offset " +
             std::to_string(a.offsets[i]) + " in it but " + std::to_string(b.offsets[i]) + " here";
    }
  }
  if (a.numel != b.numel) {
    return "unit '" + unit_key(a) + "' has " + std::to_string(a.numel) + " elements in it but " +
           std::to_string(b.numel) + " here";
  }
  return "";
}

}  // namespace

std::string unit_key(const Unit& u) {
  return u.name.empty() ? "root" : u.name;
}

Json layout_json(const FullyShardedDataParallel& fsdp, torch::optim::Optimizer* optimizer) {
  return Json{{"world_size", fsdp.world_size()},
              {"units", units_json(fsdp.units())},
              {"optimizer", optimizer ? Json(optimizer_units(*optimizer, fsdp)) : Json()}};
}

std::string layout_difference(const std::vector<Unit>& saved, const std::vector<Unit>& now) {
  const std::string counts = "it has " + std::to_string(saved.size()) + " units and this model " +
                             std::to_string(now.size()) + ": ";
  for (size_t k = 0; k < std::max(saved.size(), now.size()); ++k) {
    if (k >= now.size()) {
      return counts + "its unit '" + unit_key(saved[k]) + "' is not in this model";
    }
    if (k >= saved.size()) {
      return counts + "this model's unit '" + unit_key(now[k]) + "' is not in it";
    }
    if (saved[k].name != now[k].name) {
      return "its unit " + std::to_string(k) + " is '" + unit_key(saved[k]) +
             "' where this model's is '" + unit_key(now[k]) + "'";
    }
    const std::string d = unit_difference(saved[k], now[k]);
    if (!d.empty()) {
      return d;
    }
  }
  return "";
}

std::map<std::string, size_t> optimizer_units(torch::optim::Optimizer& optimizer,
                                              const FullyShardedDataParallel& fsdp) {
  std::map<const void*, size_t> unit_of_shard;
  const auto units = fsdp.units();
  const auto shards = fsdp.parameters();  // the units that have parameters, in order
  for (size_t k = 0, s = 0; k < units.size(); ++k) {
    if (units[k].padded > 0) {
      unit_of_shard[shards[s++].unsafeGetTensorImpl()] = k;
    }
  }
  std::map<std::string, size_t> out;
  auto& groups = optimizer.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t i = 0; i < groups[g].params().size(); ++i) {
      auto it = unit_of_shard.find(groups[g].params()[i].unsafeGetTensorImpl());
      TORCH_CHECK(it != unit_of_shard.end(), "sharded checkpoint: the optimizer's parameter ", g,
                  ".", i,
                  " is not one of the FSDP model's shards; build the optimizer over "
                  "fsdp.parameters()");
      out[std::to_string(g) + "." + std::to_string(i) + "."] = it->second;
    }
  }
  return out;
}

namespace {

// The world rank at `coords` (by dimension name; the others 0) of a mesh laid out row-major.
int world_rank_at(const std::vector<std::pair<std::string, int>>& dims,
                  const std::map<std::string, int>& coords) {
  int rank = 0;
  for (const auto& [name, degree] : dims) {
    auto it = coords.find(name);
    rank = rank * degree + (it == coords.end() ? 0 : it->second);
  }
  return rank;
}

void read_split(const Json& split_json, SavedShards& s) {
  s.split.clear();
  for (const auto& [name, split] : split_json.items()) {
    s.split[name] =
        TensorParallelShard{split.at("dim").get<int64_t>(), split.at("chunks").get<int64_t>()};
    TORCH_CHECK(s.split[name].chunks >= 1, s.where, " splits ", name, " in ", s.split[name].chunks,
                " chunks: the file is damaged");
  }
}

// The units' layout (meta "fsdp", or a stage's) and which unit each optimizer parameter steps.
void read_layout(const Json& fsdp, SavedShards& s) {
  TORCH_CHECK(fsdp.value("world_size", -1) == s.world, s.where, "'s layout is of ",
              fsdp.value("world_size", -1), " ranks but its manifest says ", s.world,
              ": the file is damaged");
  s.units = units_of(fsdp.at("units"), s.world, s.where);
  if (fsdp.contains("optimizer")) {
    read_optimizer(fsdp.at("optimizer"), s);
  } else {  // a Trainer's, of an earlier version: always with its optimizer
    s.has_optimizer = true;
    s.optimizer = mapping_by_order(s.units);
  }
}

// The mesh a checkpoint was saved on (meta "mesh"): its dimensions, and what tensor parallelism
// split. The units' layout is then that of the dp_shard group: its world is that dimension's.
void read_mesh(const Json& mesh, SavedShards& s) {
  s.mesh = mesh.at("dims").get<std::string>();
  if (mesh.contains("degrees")) {
    for (const Json& d : mesh.at("degrees")) {
      s.dims.emplace_back(d.at(0).get<std::string>(), d.at(1).get<int>());
    }
  } else {  // the first mesh checkpoints recorded only DeviceMesh::describe(): "a=2 x b=2"
    std::istringstream in(s.mesh);
    for (std::string item; in >> item;) {
      const size_t eq = item.find('=');
      if (item != "x") {
        TORCH_CHECK(eq != std::string::npos, s.where, "'s mesh '", s.mesh,
                    "' is not one DeviceMesh::describe() writes: the file is damaged");
        s.dims.emplace_back(item.substr(0, eq), std::atoi(item.c_str() + eq + 1));
      }
    }
  }
  int product = 1;
  for (const auto& [name, degree] : s.dims) {
    TORCH_CHECK(degree >= 1, s.where, " names a mesh dimension ", name, " of degree ", degree,
                ": the file is damaged");
    product *= degree;
  }
  TORCH_CHECK(product == s.world, s.where, "'s mesh ", s.mesh, " is not of its ", s.world,
              " ranks: the file is damaged");
  int shard = 1;
  for (const auto& [name, degree] : s.dims) {
    shard = name == "dp_shard" ? degree : shard;
    s.tp = name == "tp" ? degree : s.tp;
    s.pp = name == "pp" ? degree : s.pp;
  }
  if (s.pp > 1) {
    TORCH_CHECK(mesh.contains("stages") && mesh.at("stages").size() == static_cast<size_t>(s.pp),
                s.where, " was saved with ", s.pp, " pipeline stages but holds the layout of ",
                mesh.contains("stages") ? mesh.at("stages").size() : 0, ": the file is damaged");
    s.stages = mesh.at("stages");
  }
  read_split(mesh.at("tensor_parallel"), s);
  s.world = shard;
}

}  // namespace

SavedShards tp_part(const SavedShards& s, int t) {
  TORCH_CHECK(t >= 0 && t < s.tp, "tp_part: tensor-parallel rank ", t, " of ", s.tp);
  SavedShards out = s;
  out.tp_rank = t;
  if (s.dims.empty()) {
    out.file = s.world_file;
    out.read = s.world_read;
    return out;
  }
  auto at = [dims = s.dims, t, stage = s.pp_rank](int r) {
    return world_rank_at(dims, {{"dp_shard", r}, {"tp", t}, {"pp", stage}});
  };
  out.file = [at, f = s.world_file](int r) { return f(at(r)); };
  out.read = [at, f = s.world_read](int r, bool optimizer) { return f(at(r), optimizer); };
  return out;
}

SavedShards stage_part(const SavedShards& s, int stage, int t) {
  TORCH_CHECK(stage >= 0 && stage < s.pp, "stage_part: pipeline stage ", stage, " of ", s.pp);
  SavedShards out = s;
  out.pp_rank = stage;
  if (s.pp > 1) {
    try {
      const Json& part = s.stages.at(static_cast<size_t>(stage));
      read_layout(part.at("fsdp"), out);
      read_split(part.at("tensor_parallel"), out);
    } catch (const Json::exception& e) {
      TORCH_CHECK(false, s.where, " is damaged (", e.what(), "); save the checkpoint again");
    }
  }
  return tp_part(out, t);
}

SavedShards from_checkpoint(const CheckpointState& state, int tp_rank, int pp_rank) {
  SavedShards s;
  s.where = state.path;
  s.prefix = "fsdp.";
  s.world = state.world_size;
  try {
    const Json meta = Json::parse(state.meta);
    if (meta.contains("mesh")) {
      read_mesh(meta.at("mesh"), s);
    }
    read_layout(meta.at("fsdp"), s);
    if (meta.contains("metadata")) {
      s.metadata = meta.at("metadata").get<std::map<std::string, std::string>>();
    } else {
      s.metadata = {{"step", std::to_string(state.step)}};
    }
    s.config = meta.contains("config") ? meta.at("config").dump() : "";
  } catch (const Json::exception& e) {
    TORCH_CHECK(false, state.path, " is damaged (", e.what(), "); save the checkpoint again");
  }
  s.buffers = with_prefix(state.shared, "model.", /*strip=*/true);
  const std::string path = state.path;
  const int64_t step = state.step;
  const int world = state.world_size;
  s.world_file = [path, step](int r) {
    return parent_directory(path) + "/" + Checkpoint::rank_file_name(step, r);
  };
  // The tensors already read are those of saving rank state.rank.
  s.world_read = [path, step, world, own_rank = state.own.empty() ? -1 : state.rank,
                  own = state.own](int r, bool optimizer) {
    if (r == own_rank) {
      return own;
    }
    return Checkpoint::load_own(path, r, step, world, [optimizer](const std::string& name) {
      return optimizer || !detail::starts_with(name, "optim.");
    });
  };
  return stage_part(s, std::min(std::max(pp_rank, 0), s.pp - 1),
                    std::min(std::max(tp_rank, 0), s.tp - 1));
}

SavedShards from_directory(const std::string& dir, int rank) {
  struct stat st;
  const bool exists = ::stat(dir.c_str(), &st) == 0;
  TORCH_CHECK(!exists || S_ISDIR(st.st_mode), "a sharded checkpoint is a directory, and ", dir,
              " is a file: give the directory that holds it, ", parent_directory(dir));
  const std::vector<int64_t> steps = Checkpoint::steps_in(dir);
  SavedShards s;
  if (!steps.empty()) {
    const std::string path = Checkpoint::manifest_path(dir, steps.front());
    s.where = dir;
    s.world = Checkpoint::saved_world_size(path);
    s.file = [dir, step = steps.front()](int r) {
      return dir + "/" + Checkpoint::rank_file_name(step, r);
    };
    check_rank_files_exist(s);  // before this rank's own is read
    const CheckpointState state = Checkpoint::load_shared(path, rank);
    const Json meta = Json::parse(state.meta, nullptr, false);
    TORCH_CHECK(meta.is_object() && meta.contains("fsdp"), "checkpoint ", path,
                " holds no sharded state: it was saved by the ",
                meta.is_object() ? meta.value("strategy", std::string("?")) : "?",
                " strategy, whose weights are whole (model.* in its shared file); only fsdp "
                "checkpoints are sharded");
    s = from_checkpoint(state);
    s.where = dir;
  } else {
    TORCH_CHECK(::stat((dir + "/" + kOldManifest).c_str(), &st) == 0, "no complete checkpoint in ",
                dir, ": it has no manifest (",
                exists ? "a save that did not finish, or another directory"
                       : "the directory does not exist",
                "); give the directory of a save that finished");
    s = from_old_manifest(dir);
    s.world_file = s.file;
    s.world_read = s.read;
    check_rank_files_exist(s);
  }
  return s;
}

void check_buffers(const SavedShards& s, FullyShardedDataParallel& fsdp) {
  if (s.prefix == "model.") {
    return;  // the older format saved no buffers
  }
  for (const auto& b : fsdp.module()->named_buffers()) {
    auto it = s.buffers.find(b.key());
    TORCH_CHECK(it != s.buffers.end() && it->second.sizes() == b.value().sizes(),
                "the checkpoint in ", s.where, " is of another model: ",
                it == s.buffers.end() ? "it has no buffer '" + b.key() + "'"
                                      : "its buffer '" + b.key() + "' has another shape",
                "; load it into a model built as the one that saved it");
  }
}

void load_buffers(const SavedShards& s, FullyShardedDataParallel& fsdp) {
  torch::NoGradGuard no_grad;
  for (auto& b : fsdp.module()->named_buffers()) {
    auto it = s.buffers.find(b.key());
    if (it != s.buffers.end()) {
      b.value().copy_(it->second);
    }
  }
}

}  // namespace fsdp_saved
}  // namespace paratrain
