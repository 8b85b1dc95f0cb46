// Sharded checkpoints of FullyShardedDataParallel: each rank's file, the manifest, the resharding
// on load, and the consolidation into one file. The format is described in fsdp_checkpoint.h.

#include "paratrain/parallel/fsdp_checkpoint.h"

#include "../util/files.h"
#include "../util/strings.h"
#include "paratrain/io/checkpoint.h"
#include "paratrain/io/safetensors.h"
#include "paratrain/util/atomic_file.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <zlib.h>
#include <nlohmann/json.hpp>

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace paratrain {

namespace {

using Json = nlohmann::json;
using torch::Tensor;
using Unit = FullyShardedDataParallel::Unit;

constexpr const char* kFormat = "paratrain-fsdp-checkpoint-1";
// The rank files' metadata key for their layout; the caller's metadata may not use it.
constexpr const char* kLayoutKey = "fsdp.layout";

std::string rank_file(int rank, int world) {
  return "rank-" + std::to_string(rank) + "-of-" + std::to_string(world) + ".safetensors";
}

// A unit as sharded_state() and the tensors' names call it.
std::string unit_key(const Unit& u) {
  return u.name.empty() ? "root" : u.name;
}

Json layout_json(const std::vector<Unit>& units) {
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

// The units of a manifest, checked for the sizes consolidation and resharding rely on.
std::vector<Unit> layout_of(const Json& j, int world, const std::string& path) {
  std::vector<Unit> out;
  for (const Json& item : j) {
    Unit u;
    u.name = item.at("name").get<std::string>();
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
    TORCH_CHECK(fits, path, ": the layout of unit '", unit_key(u), "' does not add up (",
                u.params.size(), " parameters in ", u.numel, " elements padded to ", u.padded,
                " over ", world, " ranks): the file is damaged");
    out.push_back(std::move(u));
  }
  return out;
}

struct Manifest {
  int world = 0;
  std::vector<Unit> units;
  bool has_optimizer = false;
  std::map<std::string, size_t> optimizer;  // "<group>.<index>." -> the unit it steps
  std::map<std::string, std::string> metadata;
  std::vector<Json> files;  // {"file", "bytes", "crc32"} per rank
};

Manifest read_manifest(const std::string& dir) {
  const std::string path = dir + "/" + kFsdpManifest;
  struct stat st;
  TORCH_CHECK(::stat(path.c_str(), &st) == 0, "no complete FSDP checkpoint in ", dir, ": ",
              kFsdpManifest, " is missing (",
              ::stat(dir.c_str(), &st) == 0 ? "a save that did not finish, or another directory"
                                            : "the directory does not exist",
              "); give the directory of a save that finished");
  Manifest m;
  try {
    const Json j = Json::parse(detail::read_whole_file(path, "the checkpoint manifest"));
    TORCH_CHECK(j.is_object() && j.value("format", "") == kFormat, path,
                " is not the manifest of a sharded FSDP checkpoint (its format is not ", kFormat,
                ")");
    m.world = j.at("world").get<int>();
    TORCH_CHECK(m.world >= 1, path, " names a world of ", m.world, " ranks: the file is damaged");
    m.units = layout_of(j.at("units"), m.world, path);
    m.has_optimizer = !j.at("optimizer").is_null();
    if (m.has_optimizer) {
      m.optimizer = j.at("optimizer").get<std::map<std::string, size_t>>();
      for (const auto& [param, unit] : m.optimizer) {
        TORCH_CHECK(unit < m.units.size() && m.units[unit].padded > 0, path,
                    " says optimizer parameter ", param, " steps unit ", unit,
                    ", which has no parameters: the file is damaged");
      }
    }
    m.metadata = j.at("metadata").get<std::map<std::string, std::string>>();
    m.files = j.at("files").get<std::vector<Json>>();
    TORCH_CHECK(m.files.size() == static_cast<size_t>(m.world), path, " lists ", m.files.size(),
                " rank files for a world of ", m.world, ": the file is damaged");
  } catch (const Json::exception& e) {
    TORCH_CHECK(false, path, " is damaged (", e.what(), "); save the checkpoint again");
  }
  return m;
}

// Checked up front, on every rank alike, so that a checkpoint with a missing file fails on all
// of them with the same line rather than on the ranks that would read that file.
void check_rank_files_exist(const std::string& dir, const Manifest& m) {
  for (int r = 0; r < m.world; ++r) {
    const std::string name = rank_file(r, m.world);
    struct stat st;
    TORCH_CHECK(::stat((dir + "/" + name).c_str(), &st) == 0, "the checkpoint in ", dir, " lacks ",
                name, " (rank ", r, "'s shards of ", m.world,
                "): it is incomplete; copy every rank's file with its ", kFsdpManifest);
  }
}

uint32_t crc32_of(const std::string& bytes) {
  uLong crc = crc32(0L, Z_NULL, 0);
  for (size_t at = 0; at < bytes.size(); at += size_t(1) << 30) {  // zlib takes a uInt length
    const size_t n = std::min(bytes.size() - at, size_t(1) << 30);
    crc = crc32(crc, reinterpret_cast<const Bytef*>(bytes.data() + at), static_cast<uInt>(n));
  }
  return static_cast<uint32_t>(crc);
}

// Rank `r`'s file, checked against the manifest (its size and CRC-32, and the world and rank its
// own layout names), with the tensors `keep` accepts.
TensorMap read_rank_file(const std::string& dir,
                         const Manifest& m,
                         int r,
                         const SafetensorsFilter& keep) {
  const std::string path = dir + "/" + rank_file(r, m.world);
  const std::string bytes = detail::read_whole_file(path, "the rank file");
  const Json& entry = m.files[static_cast<size_t>(r)];
  const uint32_t crc = crc32_of(bytes);
  TORCH_CHECK(bytes.size() == entry.value("bytes", size_t(0)) && crc == entry.value("crc32", 0u),
              path, " has ", bytes.size(), " bytes and CRC-32 ", crc, ", but ", kFsdpManifest,
              " says ", entry.value("bytes", size_t(0)), " and ", entry.value("crc32", 0u),
              ": the file is damaged, or left from another save");
  const auto metadata = safetensors_metadata_bytes(bytes.data(), bytes.size(), path);
  const auto layout = metadata.find(kLayoutKey);
  Json own = layout == metadata.end() ? Json() : Json::parse(layout->second, nullptr, false);
  TORCH_CHECK(own.is_object() && own.value("world", -1) == m.world && own.value("rank", -1) == r,
              path, " is not rank ", r, "'s file of a checkpoint of ", m.world,
              " ranks (its metadata ", kLayoutKey, " says otherwise)");
  return load_safetensors_bytes(bytes.data(), bytes.size(), path, keep);
}

std::string shape_text(const std::vector<int64_t>& shape) {
  return c10::str(c10::IntArrayRef(shape));
}

// The first difference between the saved units and the model's, "" when they match.
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
    const Unit& a = saved[k];
    const Unit& b = now[k];
    if (a.name != b.name) {
      return "its unit " + std::to_string(k) + " is '" + unit_key(a) + "' where this model's is '" +
             unit_key(b) + "'";
    }
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
    }
  }
  return "";
}

// Which unit each optimizer parameter ("<group>.<index>.", optimizer_state's key prefix) steps,
// found by the shard it holds.
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
      const std::string key = std::to_string(g) + "." + std::to_string(i) + ".";
      auto it = unit_of_shard.find(groups[g].params()[i].unsafeGetTensorImpl());
      TORCH_CHECK(it != unit_of_shard.end(), "sharded checkpoint: the optimizer's parameter ", g,
                  ".", i,
                  " is not one of the FSDP model's shards; build the optimizer over "
                  "fsdp.parameters()");
      out[key] = it->second;
    }
  }
  return out;
}

// The old ranks whose files hold a piece of one of this rank's slices: the only files it reads.
std::vector<bool> needed_ranks(const Manifest& m, const FullyShardedDataParallel& fsdp) {
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

// The pieces of tensor `name` (of unit `unit`) over the old ranks: the files read, and for the
// others zeros that take no memory (reshard takes only their size from them).
std::vector<Tensor> pieces_of(const std::vector<TensorMap>& files,
                              const std::vector<bool>& read,
                              const Manifest& m,
                              size_t unit,
                              const std::string& name,
                              const std::string& dir) {
  const int64_t size = m.units[unit].padded / m.world;
  std::vector<Tensor> pieces(files.size());
  torch::ScalarType dtype = torch::kFloat;
  for (size_t r = 0; r < files.size(); ++r) {
    if (read[r]) {
      auto it = files[r].find(name);
      TORCH_CHECK(it != files[r].end() && it->second.dim() == 1 && it->second.numel() == size, dir,
                  "/", rank_file(static_cast<int>(r), m.world), " has no '", name, "' of ", size,
                  " elements, as the layout in ", kFsdpManifest,
                  " says it must: the file is damaged");
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

// The old ranks' files this rank reads: those that hold a piece of one of its slices (on the same
// world size, its own), the others left empty.
struct OldFiles {
  std::vector<TensorMap> files;
  std::vector<bool> read;
  // The file the optimizer's state that is the same on every rank (Adam's step) comes from: the
  // first one read, or rank 0's optimizer state alone when none is.
  size_t source = 0;
};

// Every file is read and checked before anything is loaded.
OldFiles read_old_files(const std::string& dir,
                        const Manifest& m,
                        const FullyShardedDataParallel& fsdp,
                        bool optimizer) {
  OldFiles old;
  old.read = needed_ranks(m, fsdp);
  old.files.resize(old.read.size());
  const auto first = std::find(old.read.begin(), old.read.end(), true);
  old.source = first == old.read.end() ? 0 : static_cast<size_t>(first - old.read.begin());
  for (size_t r = 0; r < old.files.size(); ++r) {
    if (old.read[r] || (optimizer && r == old.source)) {
      const bool weights = old.read[r];
      old.files[r] = read_rank_file(dir, m, static_cast<int>(r), [=](const std::string& name) {
        return detail::starts_with(name, "optim.") ? optimizer : weights;
      });
    }
  }
  return old;
}

// This rank's part of the saved optimizer state: the tensors laid out as the unit's shard
// resharded, the rest (Adam's step) as the source file has it.
TensorMap optimizer_slices(const OldFiles& old,
                           const Manifest& m,
                           const FullyShardedDataParallel& fsdp,
                           const std::string& dir) {
  TensorMap out;
  for (const auto& [key, t] : with_prefix(old.files[old.source], "optim.", /*strip=*/true)) {
    const std::string param = key.substr(0, key.find('.', key.find('.') + 1) + 1);
    auto owner = m.optimizer.find(param);
    TORCH_CHECK(owner != m.optimizer.end(), dir, "/",
                rank_file(static_cast<int>(old.source), m.world), " holds optimizer state '", key,
                "' of a parameter ", kFsdpManifest, " does not list: the file is damaged");
    const size_t unit = owner->second;
    if (t.dim() == 1 && t.numel() == m.units[unit].padded / m.world) {
      out[key] = fsdp.reshard(unit, pieces_of(old.files, old.read, m, unit, "optim." + key, dir));
    } else {
      out[key] = t;
    }
  }
  return out;
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

// A safetensors file written atomically; returns its size and CRC-32.
std::pair<int64_t, uint32_t> write_safetensors(const std::string& path,
                                               const TensorMap& tensors,
                                               const std::map<std::string, std::string>& meta) {
  const SafetensorsParts parts = encode_safetensors(tensors, meta);
  std::vector<FilePiece> pieces{{parts.header.data(), parts.header.size()}};
  int64_t bytes = static_cast<int64_t>(parts.header.size());
  for (const auto& t : parts.tensors) {
    pieces.push_back({t.data_ptr(), t.nbytes()});
    bytes += static_cast<int64_t>(t.nbytes());
  }
  return {bytes, write_pieces_atomic(path, pieces)};
}

// Rank files of another world size, which a save into a directory used by another job leaves:
// removed while the manifest is absent, so the directory holds one checkpoint.
void remove_other_worlds(const std::string& dir, int world) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    return;
  }
  const std::string ours = "-of-" + std::to_string(world) + ".safetensors";
  std::vector<std::string> stale;
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (detail::starts_with(name, "rank-") && name.find("-of-") != std::string::npos &&
        name.size() > 12 && name.compare(name.size() - 12, 12, ".safetensors") == 0 &&
        (name.size() < ours.size() ||
         name.compare(name.size() - ours.size(), ours.size(), ours) != 0)) {
      stale.push_back(dir + "/" + name);
    }
  }
  ::closedir(d);
  for (const auto& path : stale) {
    ::unlink(path.c_str());
  }
}

void make_directory(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TORCH_CHECK(!ec && ::access(dir.c_str(), W_OK | X_OK) == 0,
              "cannot write the checkpoint directory ", dir, ": ",
              ec ? ec.message() : std::string(std::strerror(errno)), "; give a writable directory");
}

}  // namespace

void save_sharded_checkpoint(const std::string& dir,
                             FullyShardedDataParallel& fsdp,
                             torch::optim::Optimizer* optimizer,
                             const std::map<std::string, std::string>& metadata) {
  for (const auto& kv : metadata) {
    TORCH_CHECK(kv.first != kLayoutKey && kv.first != "format", "save_sharded_checkpoint: '",
                kv.first, "' is a metadata name the checkpoint uses itself; give another name");
  }
  const int rank = fsdp.rank(), world = fsdp.world_size();
  const std::vector<Unit> units = fsdp.units();
  // Everything to write is made before the directory is touched: an optimizer that cannot be
  // saved must not leave the old checkpoint without its manifest.
  TensorMap tensors = with_prefix(fsdp.sharded_state(), "model.");
  Json owners = nullptr;
  if (optimizer != nullptr) {
    owners = optimizer_units(*optimizer, fsdp);
    for (auto& [key, t] : with_prefix(optimizer_state(*optimizer), "optim.")) {
      tensors[key] = t;
    }
  }
  std::map<std::string, std::string> file_metadata = metadata;
  file_metadata[kLayoutKey] =
      Json{{"world", world}, {"rank", rank}, {"units", layout_json(units)}}.dump();
  const std::string manifest = dir + "/" + kFsdpManifest;
  on_every_rank(fsdp, "prepare " + dir, 0, [&] {
    make_directory(dir);
    TORCH_CHECK(rank != 0 || ::unlink(manifest.c_str()) == 0 || errno == ENOENT,
                "cannot remove the old ", manifest, ": ", std::strerror(errno));
    return std::vector<int64_t>{};
  });
  const std::vector<int64_t> written = on_every_rank(fsdp, "write its shards to " + dir, 2, [&] {
    const auto [bytes, crc] =
        write_safetensors(dir + "/" + rank_file(rank, world), tensors, file_metadata);
    return std::vector<int64_t>{bytes, static_cast<int64_t>(crc)};
  });
  on_every_rank(fsdp, "write " + manifest, 0, [&] {
    if (rank == 0) {
      Json files = Json::array();
      for (int r = 0; r < world; ++r) {
        files.push_back(Json{{"file", rank_file(r, world)},
                             {"bytes", written[2 * r]},
                             {"crc32", written[2 * r + 1]}});
      }
      remove_other_worlds(dir, world);
      const std::string text =
          Json{{"format", kFormat},   {"world", world},       {"units", layout_json(units)},
               {"optimizer", owners}, {"metadata", metadata}, {"files", files}}
              .dump(1) +
          "\n";
      write_file_atomic(manifest, text.data(), text.size());
    }
    return std::vector<int64_t>{};
  });
}

std::map<std::string, std::string> load_sharded_checkpoint(const std::string& dir,
                                                           FullyShardedDataParallel& fsdp,
                                                           torch::optim::Optimizer* optimizer) {
  const Manifest m = read_manifest(dir);
  const std::string difference = layout_difference(m.units, fsdp.units());
  TORCH_CHECK(difference.empty(), "the checkpoint in ", dir, " is of another model: ", difference,
              "; load it into a model built as the one that saved it");
  check_rank_files_exist(dir, m);
  if (optimizer != nullptr) {
    const auto owners = optimizer_units(*optimizer, fsdp);
    for (const auto& [param, unit] : m.optimizer) {
      auto it = owners.find(param);
      TORCH_CHECK(it != owners.end() && it->second == unit, "the optimizer's parameter ",
                  param.substr(0, param.size() - 1), " steps unit '", unit_key(m.units.at(unit)),
                  "' in the checkpoint in ", dir, " but ",
                  it == owners.end() ? "is not there" : "'" + unit_key(m.units[it->second]) + "'",
                  " here; build the optimizer over fsdp.parameters(), as the saved one was");
    }
  }
  const bool optim = optimizer != nullptr && m.has_optimizer;
  OldFiles old = read_old_files(dir, m, fsdp, optim);
  std::vector<TensorMap> shards(old.files.size());
  const auto units = fsdp.units();
  for (size_t k = 0; k < units.size(); ++k) {
    if (units[k].padded > 0) {
      const auto pieces = pieces_of(old.files, old.read, m, k, "model." + unit_key(units[k]), dir);
      for (size_t r = 0; r < pieces.size(); ++r) {
        shards[r][unit_key(units[k])] = pieces[r];
      }
    }
  }
  const TensorMap state = optim ? optimizer_slices(old, m, fsdp, dir) : TensorMap();
  old = OldFiles();  // what was read and not kept in `shards` or `state`
  fsdp.load_sharded_state(shards);
  if (optimizer != nullptr) {
    load_optimizer_state(*optimizer, state);
  }
  return m.metadata;
}

namespace {

// The newest Trainer checkpoint's manifest in `dir` (ckpt-N.json), "" when there is none.
std::string newest_trainer_manifest(const std::string& dir) {
  int64_t best = -1;
  std::string file;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    return "";
  }
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;  // ckpt-0000000020.json; not ckpt-....rank-0.json
    const std::string digits = name.size() > 10 ? name.substr(5, name.size() - 10) : "";
    if (detail::starts_with(name, "ckpt-") && name.compare(name.size() - 5, 5, ".json") == 0 &&
        !digits.empty() && digits.find_first_not_of("0123456789") == std::string::npos &&
        std::stoll(digits) > best) {
      best = std::stoll(digits);
      file = name;
    }
  }
  ::closedir(d);
  return best < 0 ? "" : dir + "/" + file;
}

// A Trainer's checkpoint (paratrain train --strategy fsdp, TrainerOptions::checkpoint_dir): the
// newest one's manifest holds the layout (meta "fsdp"), each rank's own file its shards
// ("fsdp.<unit>").
ConsolidatedModel consolidate_trainer_checkpoint(
    const std::string& path, const std::function<std::string(const std::string&)>& name_map) {
  const CheckpointState shared = Checkpoint::load_shared(path, 0);
  const Json meta = Json::parse(shared.meta);
  TORCH_CHECK(meta.contains("fsdp"), "consolidate: ", path, " is a checkpoint of the ",
              meta.value("strategy", std::string("?")),
              " strategy, whose weights are whole already (model.* in its shared file); only "
              "fsdp checkpoints are sharded");
  const int world = Checkpoint::saved_world_size(path);
  const std::vector<Unit> units = layout_of(meta.at("fsdp").at("units"), world, path);
  std::vector<TensorMap> own;
  for (int r = 0; r < world; ++r) {
    own.push_back(Checkpoint::load_own(path, r, shared.step, world));
  }
  ConsolidatedModel model;
  TensorMap& out = model.tensors;
  ConsolidatedCheckpoint& c = model.counts;
  for (const Unit& u : units) {
    if (u.padded == 0) {
      continue;
    }
    std::vector<Tensor> pieces;
    for (int r = 0; r < world; ++r) {
      auto it = own[static_cast<size_t>(r)].find("fsdp." + unit_key(u));
      TORCH_CHECK(it != own[static_cast<size_t>(r)].end(), "consolidate: rank ", r, "'s file of ",
                  path, " has no shard of unit '", unit_key(u), "': the file is damaged");
      pieces.push_back(it->second.reshape({-1}));
    }
    const Tensor flat = torch::cat(pieces);
    for (size_t i = 0; i < u.params.size(); ++i) {
      const int64_t n = c10::multiply_integers(u.shapes[i]);
      out[name_map ? name_map(u.params[i]) : u.params[i]] =
          flat.narrow(0, u.offsets[i], n).view(u.shapes[i]);
      ++c.tensors;
      c.parameters += n;
    }
  }
  for (const auto& kv : shared.shared) {  // the buffers, not sharded
    if (detail::starts_with(kv.first, "model.")) {
      const std::string name = kv.first.substr(6);
      out[name_map ? name_map(name) : name] = kv.second;
    }
  }
  model.metadata = {{"step", std::to_string(shared.step)}};
  model.config = meta.contains("config") ? meta.at("config").dump() : "";
  return model;
}

bool all_digits(const std::string& text) {
  return !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
}

// Whether `name` is a file name that a checkpoint lists: a Trainer checkpoint's ckpt-N.json,
// ckpt-N.safetensors and ckpt-N.rank-R.safetensors (or .json), a sharded checkpoint's fsdp.json
// and rank-R-of-W.safetensors.
bool is_checkpoint_file_name(const std::string& name) {
  if (name == kFsdpManifest) {
    return true;
  }
  const std::string tensors = ".safetensors";
  auto ends_with = [&](const std::string& suffix) {
    return name.size() > suffix.size() &&
           name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (detail::starts_with(name, "rank-") && ends_with(tensors)) {
    const std::string middle = name.substr(5, name.size() - 5 - tensors.size());  // R-of-W
    const size_t of = middle.find("-of-");
    return of != std::string::npos && all_digits(middle.substr(0, of)) &&
           all_digits(middle.substr(of + 4));
  }
  if (!detail::starts_with(name, "ckpt-") || name.size() < 15 || !all_digits(name.substr(5, 10))) {
    return false;
  }
  std::string rest = name.substr(15);  // .json, .safetensors, .rank-R.safetensors, .rank-R.json
  if (detail::starts_with(rest, ".rank-")) {
    const size_t dot = rest.find('.', 6);
    if (dot == std::string::npos || !all_digits(rest.substr(6, dot - 6))) {
      return false;
    }
    rest = rest.substr(dot);
  }
  return rest == ".json" || rest == tensors;
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
  TORCH_CHECK(!is_checkpoint_file_name(name), "consolidate: the output file ", out_file,
              " has the name of a checkpoint's own file (", name,
              "), which it would replace or pass for: give it another name");
}

}  // namespace

namespace {

// The checkpoint in `dir`: a Trainer's manifest (ckpt-N.json) when it holds no sharded one, ""
// for save_sharded_checkpoint's (whose manifest is returned in `m`). Throws for a file, or a
// directory without a complete checkpoint.
std::string find_checkpoint(const std::string& dir, Manifest& m) {
  struct stat st;
  TORCH_CHECK(::stat(dir.c_str(), &st) != 0 || S_ISDIR(st.st_mode),
              "consolidate takes a checkpoint's directory, and ", dir,
              " is a file: give the directory that holds it, ", parent_directory(dir));
  const std::string trainer = newest_trainer_manifest(dir);
  const bool sharded = ::stat((dir + "/" + kFsdpManifest).c_str(), &st) == 0;
  // Without any checkpoint there, read_manifest says so.
  m = sharded || trainer.empty() ? read_manifest(dir) : Manifest();
  return sharded ? "" : trainer;
}

}  // namespace

ConsolidatedModel consolidate_sharded_model(
    const std::string& dir, const std::function<std::string(const std::string&)>& name_map) {
  Manifest m;
  const std::string trainer = find_checkpoint(dir, m);
  if (!trainer.empty()) {
    return consolidate_trainer_checkpoint(trainer, name_map);
  }
  check_rank_files_exist(dir, m);
  std::vector<TensorMap> files;
  for (int r = 0; r < m.world; ++r) {
    files.push_back(read_rank_file(dir, m, r, [](const std::string& name) {
      return detail::starts_with(name, "model.");  // the optimizer's state stays in the files
    }));
  }
  const std::vector<bool> all(files.size(), true);
  ConsolidatedModel model;
  std::map<std::string, std::string> source;  // each output name's parameter
  for (size_t k = 0; k < m.units.size(); ++k) {
    const Unit& u = m.units[k];
    if (u.padded == 0) {
      continue;
    }
    const std::string name = "model." + unit_key(u);
    const Tensor flat = torch::cat(pieces_of(files, all, m, k, name, dir));
    for (auto& f : files) {
      f.erase(name);  // one copy of the weights at a time: the pieces go as the units are made
    }
    for (size_t i = 0; i < u.params.size(); ++i) {
      const std::string to = name_map ? name_map(u.params[i]) : u.params[i];
      TORCH_CHECK(source.emplace(to, u.params[i]).second, "consolidate: '", u.params[i], "' and '",
                  source[to], "' would both be saved as '", to, "'");
      const int64_t n = c10::multiply_integers(u.shapes[i]);
      model.tensors[to] = flat.narrow(0, u.offsets[i], n).view(u.shapes[i]);
      ++model.counts.tensors;
      model.counts.parameters += n;
    }
  }
  model.metadata = m.metadata;
  return model;
}

ConsolidatedCheckpoint consolidate_sharded_checkpoint(
    const std::string& dir,
    const std::string& out_file,
    const std::function<std::string(const std::string&)>& name_map) {
  Manifest m;
  find_checkpoint(dir, m);  // a missing checkpoint is named before the output is looked at
  check_output(dir, out_file);
  const ConsolidatedModel model = consolidate_sharded_model(dir, name_map);
  write_safetensors(out_file, model.tensors, model.metadata);
  return model.counts;
}

}  // namespace paratrain
