#include "paratrain/io/checkpoint.h"

#include "optim/param_state.h"
#include "paratrain/base/option_error.h"
#include "paratrain/io/safetensors.h"
#include "paratrain/optim/fused.h"
#include "paratrain/util/atomic_file.h"
#include "paratrain/util/trace.h"
#include "util/files.h"

#include <ATen/Context.h>
#include <torch/cuda.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <zlib.h>
#include <nlohmann/json.hpp>

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iostream>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace paratrain {

namespace {

using Json = nlohmann::json;

std::string errno_text() {
  return std::strerror(errno);
}

// A checkpoint's files are fsynced one by one and renamed into place; the directory is fsynced
// once, after the last (Checkpoint::write).
const AtomicWriteOptions kDirectorySyncedLater{/*sync_directory=*/false};
// Tensor files, besides: their pages leave the page cache once on disk (a checkpoint is read back
// only by a restart), so that the next save's pages need not be reclaimed from elsewhere.
const AtomicWriteOptions kTensorFile{/*sync_directory=*/false, /*checksum=*/true,
                                     /*drop_cache=*/true};

// The tensor data of encoded safetensors, as pieces.
std::vector<FilePiece> data_pieces(const SafetensorsParts& parts) {
  std::vector<FilePiece> pieces;
  for (const auto& t : parts.tensors) {
    pieces.push_back({t.data_ptr(), t.nbytes()});
  }
  return pieces;
}

// A safetensors file written atomically; returns {"file", "bytes", "crc32"} for its manifest.
Json write_tensors(const std::string& dir, const std::string& name, const TensorMap& tensors) {
  const SafetensorsParts parts = encode_safetensors(tensors);
  std::vector<FilePiece> pieces{{parts.header.data(), parts.header.size()}};
  size_t bytes = parts.header.size();
  for (const auto& p : data_pieces(parts)) {
    pieces.push_back(p);
    bytes += p.size;
  }
  const uint32_t crc = write_pieces_atomic(dir + "/" + name, pieces, kTensorFile);
  return Json{{"file", name}, {"bytes", bytes}, {"crc32", crc}};
}

void write_json(const std::string& path, const Json& j) {
  const std::string text = j.dump(1) + "\n";
  write_pieces_atomic(path, {{text.data(), text.size()}}, kDirectorySyncedLater);
}

// What a rank file's header says of it: it replaces the separate ckpt-N.rank-R.json of earlier
// versions (one file, so one fsync, per rank). The CRC-32 covers the tensor data after the header.
constexpr const char* kRankFormat = "paratrain-checkpoint-rank-1";

// A rank's own tensors, with its step, rank, world size and the data's checksum in the header.
void write_rank_file(
    const std::string& path, const TensorMap& tensors, int64_t step, int rank, int world_size) {
  // Encoded once to checksum the data, then again with the checksum in the header, from the host
  // tensors of the first encoding (which must outlive `data`).
  const SafetensorsParts plain = encode_safetensors(tensors);
  const std::vector<FilePiece> data = data_pieces(plain);
  size_t bytes = 0;
  for (const auto& p : data) {
    bytes += p.size;
  }
  TensorMap host;
  auto it = plain.tensors.begin();
  for (const auto& kv : tensors) {  // encode_safetensors keeps the map's order
    host.emplace(kv.first, *it++);
  }
  const SafetensorsParts parts =
      encode_safetensors(host, {{"paratrain", kRankFormat},
                                {"step", std::to_string(step)},
                                {"rank", std::to_string(rank)},
                                {"world_size", std::to_string(world_size)},
                                {"data_bytes", std::to_string(bytes)},
                                {"data_crc32", std::to_string(crc32_of(data))}});
  std::vector<FilePiece> pieces{{parts.header.data(), parts.header.size()}};
  for (const auto& p : data_pieces(parts)) {
    pieces.push_back(p);
  }
  write_pieces_atomic(path, pieces,
                      AtomicWriteOptions{/*sync_directory=*/false, /*checksum=*/false,
                                         /*drop_cache=*/true});
}

Json read_json(const std::string& path) {
  const std::string text = detail::read_whole_file(path, "the checkpoint manifest");
  try {
    return Json::parse(text);
  } catch (const Json::exception& e) {
    TORCH_CHECK(false, path, " is not valid JSON (", e.what(), "): the file is damaged");
  }
}

// Reads a tensor file named by a manifest entry and checks its size and CRC-32.
TensorMap read_tensors(const std::string& dir, const Json& entry) {
  const std::string path = dir + "/" + entry.at("file").get<std::string>();
  const std::string bytes = detail::read_whole_file(path, "the checkpoint's tensor file");
  const size_t want = entry.at("bytes").get<size_t>();
  TORCH_CHECK(bytes.size() == want, path, " has ", bytes.size(), " bytes, its manifest says ", want,
              ": the file is truncated or damaged");
  const uint32_t crc = crc32_of({{bytes.data(), bytes.size()}});  // in pieces of zlib's uInt
  TORCH_CHECK(crc == entry.at("crc32").get<uint32_t>(), path, " fails its CRC-32 check (", crc,
              " against ", entry.at("crc32").get<uint32_t>(), "): the file is damaged");
  return load_safetensors_bytes(bytes.data(), bytes.size(), path);
}

std::string stem(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "ckpt-%010lld", static_cast<long long>(step));
  return buf;
}

std::string rank_stem(int64_t step, int rank) {
  return stem(step) + ".rank-" + std::to_string(rank);
}

// "ckpt-0000000012.json" -> 12; other names -> -1.
int64_t manifest_step(const std::string& name) {
  const std::string pre = "ckpt-";
  const std::string post = ".json";
  if (name.size() != pre.size() + 10 + post.size() || name.compare(0, pre.size(), pre) != 0 ||
      name.compare(name.size() - post.size(), post.size(), post) != 0) {
    return -1;
  }
  const std::string digits = name.substr(pre.size(), 10);
  if (digits.find_first_not_of("0123456789") != std::string::npos) {
    return -1;
  }
  return std::stoll(digits);
}

// The step of any file of a checkpoint: its manifest ckpt-N.json (`manifest` set), its shared
// ckpt-N.safetensors, and the ckpt-N.rank-R.safetensors (and earlier versions' ckpt-N.rank-R.json)
// of any rank R. -1 for other names, temporaries (NAME.tmp-PID) included.
int64_t checkpoint_file_step(const std::string& name, bool& manifest) {
  manifest = false;
  const std::string digits = "0123456789";
  if (name.size() < 15 || name.compare(0, 5, "ckpt-") != 0 ||
      name.substr(5, 10).find_first_not_of(digits) != std::string::npos) {
    return -1;
  }
  const std::string rest = name.substr(15);
  bool ours = rest == ".json" || rest == ".safetensors";
  if (!ours && rest.compare(0, 6, ".rank-") == 0) {
    const size_t dot = rest.find('.', 6);
    const std::string rank = dot == std::string::npos ? "" : rest.substr(6, dot - 6);
    const std::string kind = dot == std::string::npos ? "" : rest.substr(dot);
    ours = !rank.empty() && rank.size() <= 9 &&
           rank.find_first_not_of(digits) == std::string::npos &&
           (kind == ".safetensors" || kind == ".json");
  }
  if (!ours) {
    return -1;
  }
  manifest = rest == ".json";
  return std::stoll(name.substr(5, 10));
}

void make_dirs(const std::string& dir) {
  std::string at;
  std::stringstream parts(dir);
  std::string part;
  if (!dir.empty() && dir[0] == '/') {
    at = "/";
  }
  while (std::getline(parts, part, '/')) {
    if (part.empty()) {
      continue;
    }
    at += (at.empty() || at.back() == '/' ? "" : "/") + part;
    if (::mkdir(at.c_str(), 0755) != 0 && errno != EEXIST) {
      TORCH_CHECK(false, "cannot create the checkpoint directory ", dir, " (at ", at,
                  "): ", errno_text(), "; give a writable directory");
    }
  }
}

}  // namespace

Checkpoint::Checkpoint(CheckpointOptions options, dist::ProcessGroupPtr pg)
    : options_(std::move(options)), pg_(std::move(pg)), rank_(pg_ ? pg_->rank() : 0) {
  TORCH_CHECK(!options_.dir().empty(), "Checkpoint: the directory is empty");
  TORCH_CHECK(options_.keep() >= 1, "the number of checkpoints to keep must be >= 1, got ",
              options_.keep(), " (keeping none could not resume)");
  TORCH_CHECK(!pg_ || pg_->size() == 1 || options_.keep() >= 2,
              "keep at least 2 checkpoints with several ranks, got ", options_.keep(),
              ": a rank killed while writing the newest leaves only the one before to resume from");
  make_dirs(options_.dir());
  struct stat st;
  TORCH_CHECK(::stat(options_.dir().c_str(), &st) == 0 && S_ISDIR(st.st_mode),
              "the checkpoint directory ", options_.dir(), " is not a directory");
  TORCH_CHECK(::access(options_.dir().c_str(), W_OK | X_OK) == 0, "the checkpoint directory ",
              options_.dir(), " is not writable: ", errno_text(), "; give a writable directory");
  remove_stale_temporaries();
}

// A process killed while writing leaves "<name>.tmp-<pid>" behind. Each rank removes its own
// (rank 0 also the shared files'): no one else writes them, and this rank writes none yet.
void Checkpoint::remove_stale_temporaries() {
  DIR* d = ::opendir(options_.dir().c_str());
  if (d == nullptr) {
    return;
  }
  const std::string mine = ".rank-" + std::to_string(rank_) + ".";
  std::vector<std::string> stale;
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.compare(0, 5, "ckpt-") != 0 || name.find(".tmp-") == std::string::npos) {
      continue;
    }
    const bool ranked = name.find(".rank-") != std::string::npos;
    if ((ranked && name.find(mine) != std::string::npos) || (!ranked && rank_ == 0)) {
      stale.push_back(options_.dir() + "/" + name);
    }
  }
  ::closedir(d);
  for (const auto& path : stale) {
    ::unlink(path.c_str());
  }
}

Checkpoint::~Checkpoint() {
  try {
    wait();
  } catch (const std::exception& e) {
    std::cerr << "paratrain: a checkpoint write failed: " << e.what() << std::endl;
  }
}

void Checkpoint::wait() {
  if (writer_.joinable()) {
    writer_.join();
  }
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

void Checkpoint::save(CheckpointState state) {
  wait();
  // Host copies now: training goes on changing the originals while the writer runs.
  auto to_host = [](TensorMap& m) {
    for (auto& kv : m) {
      kv.second =
          kv.second.detach().to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true).contiguous();
    }
  };
  if (rank_ != 0) {
    state.shared.clear();
  }
  if (!options_.background()) {
    write(state);  // nothing changes the tensors while this thread writes them: no copy
    return;
  }
  to_host(state.shared);
  to_host(state.own);
  writer_ = std::thread([this, s = std::move(state)] {
    try {
      write(s);
    } catch (...) {
      error_ = std::current_exception();
    }
  });
}

void Checkpoint::write(const CheckpointState& s) {
  Json meta;
  try {
    meta = Json::parse(s.meta);  // before any file: a bad one must not leave orphans
  } catch (const Json::exception& e) {
    TORCH_CHECK(false, "checkpoint: the metadata is not JSON: ", e.what());
  }
  trace::Span span("checkpoint write", "checkpoint");
  const auto start = std::chrono::steady_clock::now();
  const std::string& dir = options_.dir();
  // Own files first: rank 0's manifest, written last, is what makes a checkpoint visible. The
  // world size too: a rank file left by an attempt of another size at the same step must not pass
  // for this one's (its shards split the optimizer differently).
  // A rank manifest of an earlier version at this step would be taken over the new file's header.
  ::unlink((dir + "/" + rank_stem(s.step, rank_) + ".json").c_str());
  write_rank_file(dir + "/" + rank_stem(s.step, rank_) + ".safetensors", s.own, s.step, rank_,
                  pg_ ? pg_->size() : 1);
  if (rank_ == 0) {
    Json shared = write_tensors(dir, stem(s.step) + ".safetensors", s.shared);
    write_json(dir + "/" + stem(s.step) + ".json", Json{{"format", "paratrain-checkpoint-1"},
                                                        {"step", s.step},
                                                        {"world_size", pg_ ? pg_->size() : 1},
                                                        {"own_read_by_all", s.own_read_by_all},
                                                        {"meta", meta},
                                                        {"tensors", shared}});
  }
  // One fsync makes every rename above durable. Should the machine fail before it, a manifest
  // whose files did not all reach the disk fails its checks on load, and load_latest takes the
  // checkpoint before it (every file was itself fsynced before its rename).
  fsync_directory(dir);
  written_.insert(s.step);
  prune(s.step);
  last_write_seconds_ =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

std::vector<int64_t> Checkpoint::steps() const {
  return steps_in(options_.dir());
}

std::vector<int64_t> Checkpoint::steps_in(const std::string& dir) {
  std::vector<int64_t> out;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    return out;
  }
  while (dirent* e = ::readdir(d)) {
    const int64_t step = manifest_step(e->d_name);
    if (step >= 0) {
      out.push_back(step);
    }
  }
  ::closedir(d);
  std::sort(out.rbegin(), out.rend());
  return out;
}

std::string Checkpoint::manifest_path(const std::string& dir, int64_t step) {
  return dir + "/" + stem(step) + ".json";
}

std::string Checkpoint::rank_file_name(int64_t step, int rank) {
  return rank_stem(step, rank) + ".safetensors";
}

bool Checkpoint::is_checkpoint_file(const std::string& name) {
  return file_step(name) >= 0;
}

int64_t Checkpoint::file_step(const std::string& name) {
  bool manifest = false;
  return checkpoint_file_step(name, manifest);
}

// Deletes the checkpoints beyond the `keep` newest, counting only the ones rotation may delete:
// steps up to `newest` (the one just written) that this object wrote or that are not newer than
// the step resumed from. The newer ones it did not write were skipped as damaged, or are of the
// run the caller went back from: they stay. Rank 0 deletes every file of a pruned step, the
// manifest first (a half-deleted checkpoint is never listed), then the shared file and the rank
// files of every rank, whichever world size wrote them: the directory is shared by the ranks, and
// an elastic job that shrank leaves rank files that no rank of its own would delete. The files of
// a step older than this one that has no manifest (a save that did not finish: no checkpoint) go
// too. The other ranks' writes under way are of this step or the one before (each save waits for
// its previous one), whose manifests rank 0 wrote, and which are kept: keep >= 2 with several
// ranks.
void Checkpoint::prune(int64_t newest) {
  if (rank_ != 0) {
    return;
  }
  const std::vector<int64_t> listed = steps();  // newest first
  const std::set<int64_t> manifests_of(listed.begin(), listed.end());
  auto counted = [&](int64_t step) {
    return step <= newest && (step <= resumed_step_ || written_.count(step) != 0);
  };
  std::set<int64_t> kept;
  for (int64_t step : listed) {
    if (counted(step) && kept.size() < static_cast<size_t>(options_.keep())) {
      kept.insert(step);
    }
  }
  auto pruned = [&](int64_t step) {
    return manifests_of.count(step) != 0 ? counted(step) && kept.count(step) == 0 : step < newest;
  };
  DIR* d = ::opendir(options_.dir().c_str());
  if (d == nullptr) {
    return;
  }
  std::vector<std::string> manifests;
  std::vector<std::string> others;
  while (dirent* e = ::readdir(d)) {
    bool manifest = false;
    const int64_t step = checkpoint_file_step(e->d_name, manifest);
    if (step >= 0 && pruned(step)) {
      (manifest ? manifests : others).push_back(options_.dir() + "/" + e->d_name);
    }
  }
  ::closedir(d);
  for (const auto& path : manifests) {
    ::unlink(path.c_str());
  }
  for (const auto& path : others) {
    ::unlink(path.c_str());
  }
}

void Checkpoint::set_resumed_step(int64_t step) {
  wait();  // the writer's rotation reads it
  resumed_step_ = step;
}

int Checkpoint::saved_world_size(const std::string& path) {
  struct stat st;
  TORCH_CHECK(::stat(path.c_str(), &st) == 0, "checkpoint ", path,
              " does not exist: give the path of a ckpt-N.json manifest");
  const Json manifest = read_json(path);
  TORCH_CHECK(manifest.is_object() && manifest.contains("world_size") &&
                  manifest.at("world_size").is_number_integer(),
              path, " is not a paratrain checkpoint manifest (it has no world_size)");
  return manifest.at("world_size").get<int>();
}

CheckpointState Checkpoint::load_shared(const std::string& path, int rank) {
  const Json manifest = read_json(path);
  const int saved_world = manifest.is_object() ? manifest.value("world_size", 1) : 1;
  return load(path, rank < saved_world ? rank : -1);
}

CheckpointState Checkpoint::load(const std::string& path, int rank) {
  struct stat st;
  TORCH_CHECK(::stat(path.c_str(), &st) == 0, "checkpoint ", path,
              " does not exist: give the path of a ckpt-N.json manifest");
  const std::string dir = parent_directory(path);
  const Json manifest = read_json(path);
  TORCH_CHECK(manifest.is_object() && manifest.value("format", "") == "paratrain-checkpoint-1",
              path, " is not a paratrain checkpoint manifest");
  CheckpointState s;
  s.path = path;
  try {
    s.step = manifest.at("step").get<int64_t>();
    s.world_size = manifest.at("world_size").get<int>();
    s.own_read_by_all = manifest.value("own_read_by_all", false);
    s.meta = manifest.at("meta").dump();
    s.shared = read_tensors(dir, manifest.at("tensors"));
  } catch (const Json::exception& e) {
    TORCH_CHECK(false, path, " is missing a field (", e.what(), "): the manifest is damaged");
  }
  if (rank >= 0) {  // load_shared's ranks beyond the saved world have none
    s.own = load_own(path, rank, s.step, s.world_size);
    s.rank = rank;
  }
  return s;
}

namespace {

// Rank `rank`'s file of step `step`, verified against its header.
TensorMap load_rank_file(const std::string& file,
                         int rank,
                         int64_t step,
                         int world_size,
                         const std::function<bool(const std::string&)>& keep) {
  const std::string bytes = detail::read_whole_file(file, "the checkpoint's rank file");
  const auto meta = safetensors_metadata_bytes(bytes.data(), bytes.size(), file);
  auto field = [&](const char* name) -> int64_t {
    const auto it = meta.find(name);
    TORCH_CHECK(it != meta.end() && !it->second.empty() && it->second.size() <= 19 &&
                    it->second.find_first_not_of("0123456789") == std::string::npos,
                file, " has no valid '", name, "' in its header: the file is damaged");
    return std::stoll(it->second);
  };
  TORCH_CHECK(meta.count("paratrain") != 0 && meta.at("paratrain") == kRankFormat, file,
              " is not a paratrain checkpoint rank file");
  TORCH_CHECK(field("step") == step && field("rank") == rank, file,
              " belongs to another step or rank");
  TORCH_CHECK(world_size < 0 || field("world_size") == world_size, file,
              " was written by a job of ", field("world_size"),
              " ranks, but the checkpoint's manifest says ", world_size,
              ": it is left over from another attempt");
  uint64_t header = 0;
  std::memcpy(&header, bytes.data(), sizeof(header));  // the metadata's reader checked 8 bytes
  TORCH_CHECK(header <= bytes.size() - 8, file,
              " is shorter than its header: the file is truncated");
  const size_t data = bytes.size() - 8 - static_cast<size_t>(header);
  TORCH_CHECK(static_cast<int64_t>(data) == field("data_bytes"), file, " has ", data,
              " bytes of tensor data, its header says ", field("data_bytes"),
              ": the file is truncated or damaged");
  const uint32_t crc = crc32_of({{bytes.data() + 8 + header, data}});
  TORCH_CHECK(crc == field("data_crc32"), file, " fails its CRC-32 check (", crc, " against ",
              field("data_crc32"), "): the file is damaged");
  return load_safetensors_bytes(bytes.data(), bytes.size(), file, keep);
}

}  // namespace

TensorMap Checkpoint::load_own(const std::string& path,
                               int rank,
                               int64_t step,
                               int world_size,
                               const std::function<bool(const std::string&)>& keep) {
  const std::string own_path = parent_directory(path) + "/" + rank_stem(step, rank) + ".json";
  struct stat st;
  if (::stat(own_path.c_str(), &st) != 0) {
    return load_rank_file(parent_directory(path) + "/" + rank_stem(step, rank) + ".safetensors",
                          rank, step, world_size, keep);
  }
  // Written by an earlier version: the rank's manifest in a file of its own.
  try {
    const Json own = read_json(own_path);
    TORCH_CHECK(own.at("step").get<int64_t>() == step && own.at("rank").get<int>() == rank,
                own_path, " belongs to another step or rank");
    // Files written before the world size was recorded are taken as they are.
    const int own_world = own.value("world_size", world_size);
    TORCH_CHECK(world_size < 0 || own_world == world_size, own_path, " was written by a job of ",
                own_world, " ranks, but the checkpoint's manifest says ", world_size,
                ": it is left over from another attempt");
    return read_tensors(parent_directory(path), own.at("tensors"));
  } catch (const Json::exception& e) {
    TORCH_CHECK(false, own_path, " is missing a field (", e.what(), "): the file is damaged");
  }
}

// Rank 0's listing of the steps, on every rank: all vote on the same steps in the same order.
std::vector<int64_t> Checkpoint::agreed_steps() const {
  std::vector<int64_t> candidates = steps();
  if (!pg_) {
    return candidates;
  }
  const torch::Device where = options_.collective_device();
  at::Tensor count = torch::tensor({static_cast<int64_t>(candidates.size())}).to(where);
  pg_->broadcast(count, 0)->wait();
  at::Tensor list = torch::zeros({count.cpu().item<int64_t>()}, torch::kLong);
  if (rank_ == 0 && list.numel() > 0) {
    list.copy_(torch::tensor(candidates, torch::kLong));
  }
  list = list.to(where);
  if (list.numel() > 0) {
    pg_->broadcast(list, 0)->wait();
  }
  list = list.cpu();
  candidates.assign(list.data_ptr<int64_t>(), list.data_ptr<int64_t>() + list.numel());
  return candidates;
}

std::optional<CheckpointState> Checkpoint::load_latest(
    const std::function<void(const std::string&)>& warn) {
  wait();
  const std::vector<int64_t> candidates = agreed_steps();
  const torch::Device where = options_.collective_device();
  const int world = pg_ ? pg_->size() : 1;
  std::string newest_fault;  // why this rank skipped the newest checkpoint
  auto skip = [&](int64_t step, const std::string& what) {
    if (step == candidates.front()) {
      newest_fault = what;
    }
    const std::string line = std::string("skipping checkpoint ") + stem(step) + ": " + what +
                             (step != candidates.back() ? "; trying the one before" : "");
    if (warn) {
      warn(line);
    } else {
      std::cerr << "paratrain: warning: " << line << std::endl;
    }
  };
  for (int64_t step : candidates) {
    std::optional<CheckpointState> s;
    const std::string path = options_.dir() + "/" + stem(step) + ".json";
    try {
      // From the manifest, which every rank reads alike, before any rank file: a rank beyond the
      // saved world would otherwise fail alone on its missing file and vote while the others
      // throw.
      const int saved_world = saved_world_size(path);
      PARATRAIN_CHECK_OPTION(saved_world == world || options_.any_world_size(), "any_world_size",
                             "checkpoint ", path, " was made by ", saved_world,
                             " ranks and this job has ", world,
                             ": start as many ranks, or set any_world_size to reshard it");
      s = options_.any_world_size() ? load_shared(path, rank_) : load(path, rank_);
      // A smaller world, where every rank's own tensors are needed (ZeRO's shards): the saving
      // ranks this world lacks are checked too, by rank r for ranks r + world, r + 2 world, ...,
      // so that every file the resume will read was verified before the vote.
      for (int r = rank_ + world; s->own_read_by_all && r < saved_world; r += world) {
        load_own(path, r, s->step, saved_world);
      }
    } catch (const OptionError&) {
      throw;  // another world size: the same on every rank, not a damaged file to skip
    } catch (const c10::Error& e) {
      s.reset();
      skip(step, e.what_without_backtrace());
    } catch (const std::exception& e) {
      s.reset();
      skip(step, e.what());
    }
    if (pg_) {
      // Every rank must resume from the same step: take it only if it verified everywhere.
      at::Tensor ok = torch::tensor({s ? 1 : 0}, torch::kInt).to(where);
      pg_->allreduce(ok, dist::ReduceOp::kMin)->wait();
      if (ok.cpu().item<int>() == 0) {
        continue;
      }
    }
    if (s) {
      resumed_step_ = s->step;
      return s;
    }
  }
  if (candidates.empty()) {
    return std::nullopt;  // no checkpoint yet
  }
  // Checkpoints, and none verifies: a start from step 0 would go on beside them, and rotation
  // would delete them (intact rank files included), so it takes the caller's explicit choice.
  PARATRAIN_CHECK_OPTION(
      options_.start_fresh_if_damaged(), "start_fresh_if_damaged", "every checkpoint in '",
      options_.dir(), "' is damaged (", candidates.size(), " of them; the newest, ",
      stem(candidates.front()), ": ",
      newest_fault.empty() ? "its files failed their checks on another rank" : newest_fault,
      "): none was loaded and none deleted; move them out of the directory, or set "
      "start_fresh_if_damaged to start from step 0 with them left in place");
  resumed_step_ = -1;  // every damaged one stays
  return std::nullopt;
}

TensorMap with_prefix(const TensorMap& tensors, const std::string& prefix, bool strip) {
  TensorMap out;
  for (const auto& kv : tensors) {
    if (!strip) {
      out[prefix + kv.first] = kv.second;
    } else if (kv.first.compare(0, prefix.size(), prefix) == 0) {
      out[kv.first.substr(prefix.size())] = kv.second;
    }
  }
  return out;
}

namespace {

using optim::detail::state_key;

template <typename Fn>
void for_each_param(torch::optim::Optimizer& optimizer, Fn fn) {
  auto& groups = optimizer.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t i = 0; i < groups[g].params().size(); ++i) {
      fn(std::to_string(g) + "." + std::to_string(i) + ".", groups[g].params()[i]);
    }
  }
}

// A fused optimizer's moments may be offloaded (an empty tensor here, the values in its store):
// they are read back, so that a checkpoint holds them whatever the tier.
template <typename AdamState>
void save_adam(const AdamState& st,
               const std::string& key,
               const torch::Tensor& p,
               optim::FusedOptimizer* fused,
               TensorMap& out) {
  auto values = [&](const char* name, const torch::Tensor& held) {
    return fused != nullptr ? fused->state_tensor(p, name, held) : held;
  };
  out[key + "step"] = torch::tensor(static_cast<int64_t>(st.step()), torch::kLong);
  out[key + "exp_avg"] = values("exp_avg", st.exp_avg());
  out[key + "exp_avg_sq"] = values("exp_avg_sq", st.exp_avg_sq());
  if (st.max_exp_avg_sq().defined()) {
    out[key + "max_exp_avg_sq"] = values("max_exp_avg_sq", st.max_exp_avg_sq());
  }
}

// A copy on the parameter's device and dtype: the optimizer updates its state in place, so it
// must never alias the caller's tensors (two optimizers loaded from one map would share them).
torch::Tensor own_copy(const torch::Tensor& t, const torch::Tensor& p) {
  return t.to(p.options(), /*non_blocking=*/false, /*copy=*/true);
}

// The moments of an optimizer whose state is offloaded stay on the host, in `p`'s dtype, until its
// next step moves them into its store: on a GPU's parameters, the device never holds them (it
// would not fit them, in the models ZeRO-Offload is for).
template <typename AdamState>
std::unique_ptr<AdamState> load_adam(const TensorMap& in,
                                     const std::string& key,
                                     const torch::Tensor& p,
                                     bool offloaded) {
  const torch::Tensor like = offloaded ? torch::empty({0}, p.options().device(torch::kCPU)) : p;
  auto st = std::make_unique<AdamState>();
  st->step(in.at(key + "step").template item<int64_t>());
  st->exp_avg(own_copy(in.at(key + "exp_avg"), like));
  st->exp_avg_sq(own_copy(in.at(key + "exp_avg_sq"), like));
  if (in.count(key + "max_exp_avg_sq")) {
    st->max_exp_avg_sq(own_copy(in.at(key + "max_exp_avg_sq"), like));
  }
  return st;
}

const char* optimizer_kind(torch::optim::Optimizer& o) {
  if (dynamic_cast<torch::optim::SGD*>(&o)) {
    return "sgd";
  }
  if (dynamic_cast<torch::optim::AdamW*>(&o)) {
    return "adamw";
  }
  if (dynamic_cast<torch::optim::Adam*>(&o)) {
    return "adam";
  }
  TORCH_CHECK(false, "checkpoints hold the state of SGD, Adam and AdamW; this optimizer is none");
}

}  // namespace

TensorMap optimizer_state(torch::optim::Optimizer& optimizer) {
  const std::string kind = optimizer_kind(optimizer);
  auto* fused = dynamic_cast<optim::FusedOptimizer*>(&optimizer);
  TensorMap out;
  auto& state = optimizer.state();
  for_each_param(optimizer, [&](const std::string& key, const torch::Tensor& p) {
    auto it = state.find(state_key(state, p));
    if (it == state.end()) {
      return;  // no step yet (or no gradient): nothing to keep
    }
    if (kind == "sgd") {
      const auto& st = static_cast<const torch::optim::SGDParamState&>(*it->second);
      if (st.momentum_buffer().defined()) {
        out[key + "momentum_buffer"] = st.momentum_buffer();
      }
    } else if (kind == "adam") {
      save_adam(static_cast<const torch::optim::AdamParamState&>(*it->second), key, p, fused, out);
    } else {
      save_adam(static_cast<const torch::optim::AdamWParamState&>(*it->second), key, p, fused, out);
    }
  });
  return out;
}

void load_optimizer_state(torch::optim::Optimizer& optimizer, const TensorMap& in) {
  const std::string kind = optimizer_kind(optimizer);
  const auto* fused = dynamic_cast<const optim::FusedOptimizer*>(&optimizer);
  const bool offloaded = fused != nullptr && fused->offload_store() != nullptr;
  auto& state = optimizer.state();
  state.clear();
  size_t used = 0;
  for_each_param(optimizer, [&](const std::string& key, const torch::Tensor& p) {
    if (kind == "sgd") {
      auto it = in.find(key + "momentum_buffer");
      if (it == in.end()) {
        return;
      }
      TORCH_CHECK(it->second.sizes() == p.sizes(), "optimizer state ", key,
                  "momentum_buffer has shape ", it->second.sizes(), ", its parameter ", p.sizes());
      auto st = std::make_unique<torch::optim::SGDParamState>();
      st->momentum_buffer(own_copy(it->second, p));
      state[state_key(state, p)] = std::move(st);
      ++used;
    } else if (in.count(key + "step")) {
      TORCH_CHECK(in.at(key + "exp_avg").sizes() == p.sizes(), "optimizer state ", key,
                  "exp_avg has shape ", in.at(key + "exp_avg").sizes(), ", its parameter ",
                  p.sizes());
      if (kind == "adam") {
        state[state_key(state, p)] = load_adam<torch::optim::AdamParamState>(in, key, p, offloaded);
      } else {
        state[state_key(state, p)] =
            load_adam<torch::optim::AdamWParamState>(in, key, p, offloaded);
      }
      ++used;
    }
  });
  TORCH_CHECK(used > 0 || in.empty(),
              "the optimizer state in the checkpoint matches none of the "
              "optimizer's parameters (another optimizer or model?)");
}

TensorMap rng_state() {
  TensorMap out;
  {
    at::Generator g = at::globalContext().defaultGenerator(at::kCPU);
    std::lock_guard<std::mutex> lock(g.mutex());
    out["rng.cpu"] = g.get_state();
  }
  if (torch::cuda::is_available()) {
    // device_count() is size_t in libtorch 1.13 and c10::DeviceIndex (signed) in 2.x.
    const auto devices = static_cast<size_t>(torch::cuda::device_count());
    for (size_t d = 0; d < devices; ++d) {
      at::Generator g = at::globalContext().defaultGenerator(
          at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(d)));
      std::lock_guard<std::mutex> lock(g.mutex());
      out["rng.cuda." + std::to_string(d)] = g.get_state();
    }
  }
  return out;
}

void set_rng_state(const TensorMap& state) {
  for (const auto& kv : state) {
    if (kv.first == "rng.cpu") {
      at::Generator g = at::globalContext().defaultGenerator(at::kCPU);  // a handle to it
      std::lock_guard<std::mutex> lock(g.mutex());
      g.set_state(kv.second);
    } else if (kv.first.compare(0, 9, "rng.cuda.") == 0 && torch::cuda::is_available()) {
      const auto d = static_cast<c10::DeviceIndex>(std::stoi(kv.first.substr(9)));
      if (d < static_cast<c10::DeviceIndex>(torch::cuda::device_count())) {
        at::Generator g = at::globalContext().defaultGenerator(at::Device(at::kCUDA, d));
        std::lock_guard<std::mutex> lock(g.mutex());
        g.set_state(kv.second);
      }
    }
  }
}

}  // namespace paratrain
