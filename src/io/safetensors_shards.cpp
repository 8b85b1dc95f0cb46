#include "paratrain/io/safetensors_shards.h"

#include "paratrain/util/atomic_file.h"
#include "util/files.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <system_error>
#include <utility>

namespace paratrain {

namespace {

using Json = nlohmann::json;

// "model-00002-of-00005.safetensors": save_pretrained's pattern, five digits each.
std::string shard_name(size_t index, size_t count) {
  char name[64];
  std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", index + 1, count);
  return name;
}

void write_safetensors_file(const std::string& path,
                            const std::map<std::string, torch::Tensor>& tensors,
                            const std::map<std::string, std::string>& metadata) {
  const SafetensorsParts parts = encode_safetensors(tensors, metadata);
  std::vector<FilePiece> pieces{{parts.header.data(), parts.header.size()}};
  for (const auto& t : parts.tensors) {
    pieces.push_back({t.data_ptr(), t.nbytes()});
  }
  write_pieces_atomic(path, pieces,
                      AtomicWriteOptions{/*sync_directory=*/false,
                                         /*checksum=*/false,
                                         /*drop_cache=*/true});
}

// Whether `name` is a file of a saved model's weights: model.safetensors, its index, or a shard.
bool is_weights_file(const std::string& name) {
  return name == kSafetensorsWeightsFile || name == kSafetensorsIndexFile ||
         (name.rfind("model-", 0) == 0 && name.find("-of-") != std::string::npos &&
          name.size() > 12 && name.compare(name.size() - 12, 12, ".safetensors") == 0);
}

// Makes `dir`, or checks that an existing one holds no model weights: writing shards over another
// save's would leave a mix of both that loads (the same tensor names), or stale files that loaders
// prefer (model.safetensors over an index).
void make_shards_directory(const std::string& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) == 0) {
    TORCH_CHECK(S_ISDIR(st.st_mode), "safetensors: ", dir,
                " is a file, not a directory to write a model's shards into");
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
      const std::string name = entry.path().filename().string();
      TORCH_CHECK(!is_weights_file(name), "safetensors: ", dir, " already holds model weights (",
                  name, "); nothing was written: give a new or empty directory, or remove them");
    }
    TORCH_CHECK(!ec, "safetensors: cannot list ", dir, ": ", ec.message());
    return;
  }
  TORCH_CHECK(::mkdir(dir.c_str(), 0755) == 0 || errno == EEXIST, "safetensors: cannot make ", dir,
              ": ", std::strerror(errno));
}

// The index's weight_map: each tensor's shard file.
std::map<std::string, std::string> read_weight_map(const std::string& index_path) {
  Json index;
  try {
    index = Json::parse(detail::read_whole_file(index_path, "the safetensors index"));
  } catch (const Json::exception& e) {
    TORCH_CHECK(false, "safetensors: ", index_path, " is not JSON (", e.what(),
                "); a sharded checkpoint's index is model.safetensors.index.json");
  }
  const auto map = index.is_object() ? index.find("weight_map") : index.end();
  TORCH_CHECK(map != index.end() && map->is_object() && !map->empty(), "safetensors: ", index_path,
              " has no weight_map naming each tensor's shard, so it is not the index of a "
              "sharded checkpoint");
  std::map<std::string, std::string> out;
  for (const auto& item : map->items()) {
    TORCH_CHECK(item.value().is_string(), "safetensors: ", index_path, ": the weight_map's '",
                item.key(), "' is not a file name");
    const std::string file = item.value().get<std::string>();
    TORCH_CHECK(!file.empty() && file.find('/') == std::string::npos && file != "." && file != "..",
                "safetensors: ", index_path, " places '", item.key(), "' in '", file,
                "', which is not a file beside the index; only shards in the index's own "
                "directory are read");
    out[item.key()] = file;
  }
  return out;
}

}  // namespace

std::vector<std::vector<std::string>> plan_safetensors_shards(
    const std::map<std::string, torch::Tensor>& tensors, int64_t max_shard_bytes) {
  TORCH_CHECK(max_shard_bytes >= 1, "safetensors: the largest shard must be at least 1 byte, got ",
              max_shard_bytes);
  std::vector<std::vector<std::string>> shards;
  std::vector<std::string> current;
  int64_t current_bytes = 0;
  for (const auto& kv : tensors) {
    const int64_t bytes = static_cast<int64_t>(kv.second.nbytes());
    if (bytes > max_shard_bytes) {  // alone, and the shard being filled goes on
      shards.push_back({kv.first});
      continue;
    }
    if (current_bytes + bytes > max_shard_bytes) {
      shards.push_back(std::move(current));
      current.clear();
      current_bytes = 0;
    }
    current.push_back(kv.first);
    current_bytes += bytes;
  }
  if (!current.empty()) {
    shards.push_back(std::move(current));
  }
  return shards;
}

std::vector<std::string> save_safetensors_shards(
    const std::string& dir,
    const std::map<std::string, torch::Tensor>& tensors,
    int64_t max_shard_bytes,
    const std::map<std::string, std::string>& metadata) {
  const auto plan = plan_safetensors_shards(tensors, max_shard_bytes);
  make_shards_directory(dir);
  std::vector<std::string> written;
  if (plan.size() <= 1) {
    write_safetensors_file(dir + "/" + kSafetensorsWeightsFile, tensors, metadata);
    fsync_directory(dir);
    return {kSafetensorsWeightsFile};
  }
  Json weight_map = Json::object();
  int64_t total_size = 0, total_parameters = 0;
  for (size_t i = 0; i < plan.size(); ++i) {
    const std::string name = shard_name(i, plan.size());
    std::map<std::string, torch::Tensor> shard;
    for (const auto& tensor : plan[i]) {
      const torch::Tensor& t = tensors.at(tensor);
      shard[tensor] = t;
      weight_map[tensor] = name;
      total_size += static_cast<int64_t>(t.nbytes());
      total_parameters += t.numel();
    }
    write_safetensors_file(dir + "/" + name, shard, metadata);
    written.push_back(name);
  }
  // The index last, once the shards' renames are durable: a directory with an index holds every
  // shard it names.
  fsync_directory(dir);
  const Json index{
      {"metadata", {{"total_parameters", total_parameters}, {"total_size", total_size}}},
      {"weight_map", weight_map}};
  const std::string text = index.dump(2) + "\n";
  write_file_atomic(dir + "/" + kSafetensorsIndexFile, text.data(), text.size());
  written.push_back(kSafetensorsIndexFile);
  return written;
}

std::map<std::string, torch::Tensor> load_safetensors_shards(const std::string& index_path,
                                                             const SafetensorsFilter& keep) {
  const std::map<std::string, std::string> weight_map = read_weight_map(index_path);
  const std::string dir = parent_directory(index_path);
  std::map<std::string, std::vector<std::string>> by_shard;
  for (const auto& kv : weight_map) {
    if (!keep || keep(kv.first)) {
      by_shard[kv.second].push_back(kv.first);
    }
  }
  std::set<std::string> shards;
  for (const auto& kv : weight_map) {
    shards.insert(kv.second);
  }
  for (const auto& kv : weight_map) {  // every shard is there before any is read
    struct stat st {};
    const std::string path = dir + "/" + kv.second;
    TORCH_CHECK(::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode), "safetensors: the index ",
                index_path, " names the shard ", kv.second, " (holding '", kv.first,
                "'), which is missing from ", dir, ": copy every file the index lists (",
                shards.size(), " shards) beside it");
  }
  std::map<std::string, torch::Tensor> out;
  for (const auto& kv : by_shard) {
    const std::string path = dir + "/" + kv.first;
    const std::set<std::string> wanted(kv.second.begin(), kv.second.end());
    auto tensors =
        load_safetensors(path, [&wanted](const std::string& name) { return wanted.count(name); });
    for (const auto& name : kv.second) {
      auto it = tensors.find(name);
      TORCH_CHECK(it != tensors.end(), "safetensors: ", path, " has no tensor '", name,
                  "', which the index ", index_path,
                  " places in it: the shard is of another save; copy the whole checkpoint again");
      out.emplace(name, std::move(it->second));
    }
  }
  return out;
}

int64_t parse_shard_size(const std::string& text) {
  static const std::pair<const char*, double> kUnits[] = {{"TiB", 1099511627776.0},
                                                          {"GiB", 1073741824.0},
                                                          {"MiB", 1048576.0},
                                                          {"KiB", 1024.0},
                                                          {"TB", 1e12},
                                                          {"GB", 1e9},
                                                          {"MB", 1e6},
                                                          {"KB", 1e3},
                                                          {"B", 1.0}};
  size_t digits = 0;
  while (digits < text.size() &&
         (std::isdigit(static_cast<unsigned char>(text[digits])) || text[digits] == '.')) {
    ++digits;
  }
  const std::string number = text.substr(0, digits), unit = text.substr(digits);
  double scale = unit.empty() ? 1.0 : 0.0;
  for (const auto& u : kUnits) {
    scale = unit == u.first ? u.second : scale;
  }
  double value = 0;
  bool read = false;
  if (!number.empty() && number.find('.') == number.rfind('.') && number != ".") {
    std::istringstream in(number);
    read = static_cast<bool>(in >> value) && in.eof();
  }
  const double bytes = value * scale;
  TORCH_CHECK(read && scale > 0 && bytes >= 1 && bytes < 9e18, "'", text,
              "' is not a shard size: write it as save_pretrained's max_shard_size takes it, "
              "e.g. 500KB, 5GB (powers of 1000), 4MiB (of 1024) or 4096 (bytes)");
  return static_cast<int64_t>(bytes);
}

}  // namespace paratrain
