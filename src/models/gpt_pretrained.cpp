#include "paratrain/models/gpt_pretrained.h"

#include "hf_names.h"
#include "paratrain/io/safetensors.h"
#include "paratrain/io/safetensors_shards.h"
#include "paratrain/io/torch_load.h"
#include "paratrain/util/atomic_file.h"
#include "util/files.h"
#include "util/strings.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <set>
#include <sstream>
#include <utility>
#include <vector>

namespace paratrain {
namespace models {

namespace {

using Json = nlohmann::json;

using detail::kHfTransformerPrefix;

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool is_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// "transformer.h.0.ln_1.weight" -> "h.0.ln_1.weight"; a bare name stays as it is.
std::string bare_name(const std::string& name) {
  return detail::starts_with(name, kHfTransformerPrefix)
             ? name.substr(std::strlen(kHfTransformerPrefix))
             : name;
}

// config.json's fields, with GPT2Config's defaults for those it leaves out (or sets to null).
class ConfigFields {
 public:
  ConfigFields(Json config, std::string file)
      : config_(std::move(config)), file_(std::move(file)) {}

  int64_t integer(const char* key, int64_t fallback) const {
    const Json* v = find(key);
    if (v == nullptr) {
      return fallback;
    }
    TORCH_CHECK(v->is_number_integer() && v->get<int64_t>() >= 1, "gpt: ", file_, ": ", key, " is ",
                v->dump(), ", not a positive integer");
    return v->get<int64_t>();
  }
  double number(const char* key, double fallback) const {
    const Json* v = find(key);
    TORCH_CHECK(v == nullptr || v->is_number(), "gpt: ", file_, ": ", key, " is ", v->dump(),
                ", not a number");
    return v == nullptr ? fallback : v->get<double>();
  }
  std::string text(const char* key, const std::string& fallback) const {
    const Json* v = find(key);
    TORCH_CHECK(v == nullptr || v->is_string(), "gpt: ", file_, ": ", key, " is ", v->dump(),
                ", not text");
    return v == nullptr ? fallback : v->get<std::string>();
  }
  // A setting paratrain's GPT-2 has one way only: `key` must be `wanted` (or left out).
  void require(const char* key, bool wanted, const char* why) const {
    const Json* v = find(key);
    TORCH_CHECK(v == nullptr || (v->is_boolean() && v->get<bool>() == wanted), "gpt: ", file_,
                " sets ", key, " to ", v->dump(), ", but paratrain's GPT-2 ", why);
  }
  const std::string& file() const { return file_; }

 private:
  const Json* find(const char* key) const {
    const auto it = config_.find(key);
    return it == config_.end() || it->is_null() ? nullptr : &*it;
  }
  Json config_;
  std::string file_;
};

Json read_config(const std::string& file, const std::string& path) {
  struct stat st {};
  TORCH_CHECK(::stat(file.c_str(), &st) == 0 || (errno != ENOENT && errno != ENOTDIR),
              "gpt: ", path,
              " has no config.json, so it is not a Hugging Face model directory (save_pretrained "
              "writes one beside the weights); give the directory that holds config.json, or load "
              "the weights file itself into a model of its shape");
  const std::string text = detail::read_whole_file(file, "the model's config");
  try {
    Json config = Json::parse(text);
    TORCH_CHECK(config.is_object(), "gpt: ", file, " is not a JSON object");
    return config;
  } catch (const Json::exception& e) {
    TORCH_CHECK(false, "gpt: ", file, " is not JSON: ", e.what());
  }
}

// The expected shape of each tensor of a GPT-2 of `o`'s shape, by its name without "transformer.".
std::map<std::string, std::vector<int64_t>> gpt2_shapes(const GptOptions& o) {
  const int64_t w = o.width();
  std::map<std::string, std::vector<int64_t>> shapes{{"wte.weight", {o.vocab(), w}},
                                                     {"wpe.weight", {o.context(), w}},
                                                     {"ln_f.weight", {w}},
                                                     {"ln_f.bias", {w}}};
  const std::pair<const char*, std::vector<int64_t>> block[] = {{"ln_1.weight", {w}},
                                                                {"ln_1.bias", {w}},
                                                                {"attn.c_attn.weight", {w, 3 * w}},
                                                                {"attn.c_attn.bias", {3 * w}},
                                                                {"attn.c_proj.weight", {w, w}},
                                                                {"attn.c_proj.bias", {w}},
                                                                {"ln_2.weight", {w}},
                                                                {"ln_2.bias", {w}},
                                                                {"mlp.c_fc.weight", {w, 4 * w}},
                                                                {"mlp.c_fc.bias", {4 * w}},
                                                                {"mlp.c_proj.weight", {4 * w, w}},
                                                                {"mlp.c_proj.bias", {w}}};
  for (int64_t i = 0; i < o.layers(); ++i) {
    for (const auto& b : block) {
      shapes["h." + std::to_string(i) + "." + b.first] = b.second;
    }
  }
  return shapes;
}

// Whether `name` (without "transformer.") is one that Hugging Face saves besides the weights: the
// tied head, and older versions' attention masks.
bool is_hf_extra(const std::string& name) {
  return name == "lm_head.weight" ||
         (detail::starts_with(name, "h.") &&
          (detail::ends_with(name, ".attn.bias") || detail::ends_with(name, ".attn.masked_bias")));
}

// What in `dir` is a model's file: its config, weights in any of Hugging Face's formats.
bool is_model_file(const std::string& name) {
  return name == kHfConfigFile || name == "generation_config.json" ||
         detail::ends_with(name, ".safetensors") ||
         detail::ends_with(name, ".safetensors.index.json") ||
         detail::starts_with(name, "pytorch_model") || detail::starts_with(name, "tf_model") ||
         detail::starts_with(name, "flax_model");
}

void check_no_model_files(const std::string& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    return;  // made by the save
  }
  TORCH_CHECK(S_ISDIR(st.st_mode), "gpt: ", dir,
              " is a file; a Hugging Face model is a directory: give a new directory's path");
  DIR* d = ::opendir(dir.c_str());
  TORCH_CHECK(d != nullptr, "gpt: cannot read the directory ", dir, ": ", std::strerror(errno));
  std::set<std::string> found;
  while (const dirent* e = ::readdir(d)) {
    if (is_model_file(e->d_name)) {
      found.insert(e->d_name);
    }
  }
  ::closedir(d);
  std::string names;  // the first three, sorted, then how many more
  size_t listed = 0;
  for (auto it = found.begin(); it != found.end() && listed < 3; ++it, ++listed) {
    names += (names.empty() ? "" : ", ") + *it;
  }
  if (found.size() > 3) {
    names += " and " + std::to_string(found.size() - 3) + " more";
  }
  TORCH_CHECK(found.empty(), "gpt: ", dir, " already holds a model's files (", names,
              "); writing there would replace them or mix two models' files, so nothing was "
              "written: give a new or empty directory, or remove those files first");
}

// The weights of a model directory: model.safetensors, else the index of its shards.
std::string weights_in(const std::string& dir) {
  for (const char* name : {kSafetensorsWeightsFile, kSafetensorsIndexFile}) {
    if (is_file(dir + "/" + name)) {
      return dir + "/" + name;
    }
  }
  TORCH_CHECK(false, "gpt: ", dir, " holds neither ", kSafetensorsWeightsFile, " nor ",
              kSafetensorsIndexFile,
              "; save the model with save_pretrained's safetensors (its default), or give the "
              "weights file itself");
}

// The model must be config.json's shape, but may take a shorter context.
void check_model_follows_config(const GptOptions& model,
                                const GptOptions& config,
                                const std::string& file) {
  const std::pair<const char*, std::pair<int64_t, int64_t>> fields[] = {
      {"n_layer", {model.layers(), config.layers()}},
      {"n_embd", {model.width(), config.width()}},
      {"n_head", {model.heads(), config.heads()}},
      {"vocab_size", {model.vocab(), config.vocab()}}};
  for (const auto& f : fields) {
    TORCH_CHECK(f.second.first == f.second.second, "gpt: the model's ", f.first, " is ",
                f.second.first, " but ", file, " gives ", f.second.second,
                "; build the model from gpt2_config_options(", file, ")");
  }
  TORCH_CHECK(model.context() <= config.context(), "gpt: the model's context ", model.context(),
              " is longer than ", file, "'s n_positions ", config.context(),
              ": the weights hold that many positions");
}

std::string describe(const GptOptions& o) {
  std::ostringstream s;
  s << "n_layer " << o.layers() << ", n_embd " << o.width() << ", n_head " << o.heads()
    << ", n_positions " << o.context() << ", vocab_size " << o.vocab();
  return s.str();
}

}  // namespace

GptOptions gpt2_config_options(const std::string& path) {
  const std::string file = is_directory(path) ? path + "/" + kHfConfigFile : path;
  const ConfigFields c(read_config(file, path), file);
  const std::string type = c.text("model_type", "gpt2");
  TORCH_CHECK(type == "gpt2", "gpt: ", file, " is the config of a '", type,
              "' model, not of GPT-2 (model_type gpt2)");
  const std::string activation = c.text("activation_function", "gelu_new");
  TORCH_CHECK(activation == "gelu_new" || activation == "gelu_pytorch_tanh", "gpt: ", file,
              " sets activation_function to '", activation,
              "', but paratrain's GPT-2 uses GPT-2's gelu_new (the tanh GELU)");
  const double eps = c.number("layer_norm_epsilon", 1e-5);
  TORCH_CHECK(std::abs(eps - 1e-5) < 1e-12, "gpt: ", file, " sets layer_norm_epsilon to ", eps,
              ", but paratrain's GPT-2 uses GPT-2's 1e-05");
  GptOptions o;
  o.layers(c.integer("n_layer", 12)).width(c.integer("n_embd", 768)).heads(c.integer("n_head", 12));
  o.vocab(c.integer("vocab_size", 50257)).context(c.integer("n_positions", 1024));
  TORCH_CHECK(c.integer("n_inner", 4 * o.width()) == 4 * o.width(), "gpt: ", file,
              " sets n_inner to ", c.integer("n_inner", 0),
              ", but paratrain's GPT-2 has GPT-2's MLP of 4 n_embd = ", 4 * o.width());
  TORCH_CHECK(o.width() % o.heads() == 0, "gpt: ", file, ": n_embd ", o.width(),
              " is not divisible by n_head ", o.heads());
  c.require("scale_attn_weights", true, "divides the attention scores by sqrt(head size)");
  c.require("scale_attn_by_inverse_layer_idx", false, "scales no layer's attention by its index");
  c.require("add_cross_attention", false, "is a decoder without cross-attention");
  c.require("tie_word_embeddings", true, "ties its output head to transformer.wte");
  c.require("reorder_and_upcast_attn", false, "computes attention in the model's dtype");
  // One rate for the embeddings, attention and residuals: GPT-2's configs give 0.1 to all three.
  o.dropout(c.number("resid_pdrop", 0.1));
  for (const char* other : {"embd_pdrop", "attn_pdrop"}) {
    TORCH_CHECK(c.number(other, o.dropout()) == o.dropout(), "gpt: ", file, " sets ", other, " to ",
                c.number(other, o.dropout()), " and resid_pdrop to ", o.dropout(),
                ", but paratrain's GPT-2 applies one dropout rate: make them equal");
  }
  TORCH_CHECK(o.dropout() >= 0 && o.dropout() < 1, "gpt: ", file, ": resid_pdrop ", o.dropout(),
              " is not in [0, 1)");
  return o;
}

std::string gpt2_config_json(const GptOptions& o, at::ScalarType dtype) {
  const bool has_endoftext = o.vocab() > 50256;  // GPT-2's <|endoftext|>
  const Json endoftext = has_endoftext ? Json(50256) : Json(nullptr);
  std::string dtype_name = c10::toString(dtype);  // "Float", "BFloat16", "Half"
  dtype_name = dtype == at::kFloat      ? "float32"
               : dtype == at::kBFloat16 ? "bfloat16"
               : dtype == at::kHalf     ? "float16"
                                        : dtype_name;
  const Json config{{"activation_function", "gelu_new"},
                    {"add_cross_attention", false},
                    {"architectures", {"GPT2LMHeadModel"}},
                    {"attn_pdrop", o.dropout()},
                    {"bos_token_id", endoftext},
                    {"dtype", dtype_name},
                    {"embd_pdrop", o.dropout()},
                    {"eos_token_id", endoftext},
                    {"initializer_range", 0.02},
                    {"layer_norm_epsilon", 1e-05},
                    {"model_type", "gpt2"},
                    {"n_embd", o.width()},
                    {"n_head", o.heads()},
                    {"n_inner", nullptr},
                    {"n_layer", o.layers()},
                    {"n_positions", o.context()},
                    {"reorder_and_upcast_attn", false},
                    {"resid_pdrop", o.dropout()},
                    {"scale_attn_by_inverse_layer_idx", false},
                    {"scale_attn_weights", true},
                    {"tie_word_embeddings", true},
                    {"use_cache", true},
                    {"vocab_size", o.vocab()}};
  return config.dump(2) + "\n";
}

GptOptions gpt2_options_of_weights(const std::map<std::string, torch::Tensor>& tensors,
                                   int64_t heads) {
  std::map<std::string, torch::Tensor> bare;
  int64_t layers = 0;
  for (const auto& kv : tensors) {
    const std::string name = bare_name(kv.first);
    if (detail::starts_with(name, "h.")) {
      layers = std::max<int64_t>(layers, std::atoll(name.c_str() + 2) + 1);
    }
    bare[name] = kv.second;
  }
  for (const char* name : {"wte.weight", "wpe.weight"}) {
    TORCH_CHECK(bare.count(name) && bare.at(name).dim() == 2, "gpt: the weights have no 2-D '",
                kHfTransformerPrefix, name, "', so they are not GPT-2's");
  }
  const torch::Tensor& wte = bare.at("wte.weight");
  GptOptions o;
  o.layers(layers).width(wte.size(1)).heads(heads).vocab(wte.size(0));
  o.context(bare.at("wpe.weight").size(0));
  TORCH_CHECK(layers >= 1 && layers <= static_cast<int64_t>(bare.size()) && heads >= 1 &&
                  o.width() % heads == 0,
              "gpt: weights of ", layers, " blocks and width ", o.width(), " make no GPT-2 of ",
              heads, " heads (width must be a multiple of heads)");
  const auto shapes = gpt2_shapes(o);
  for (const auto& kv : shapes) {
    auto it = bare.find(kv.first);
    TORCH_CHECK(it != bare.end(), "gpt: the weights have no '", kHfTransformerPrefix, kv.first,
                "', which a GPT-2 of ", describe(o), " has");
    TORCH_CHECK(it->second.sizes() == c10::IntArrayRef(kv.second), "gpt: '", kHfTransformerPrefix,
                kv.first, "' has shape ", it->second.sizes(), " but a GPT-2 of ", describe(o),
                " has it ", c10::IntArrayRef(kv.second));
  }
  for (const auto& kv : bare) {
    TORCH_CHECK(shapes.count(kv.first) || is_hf_extra(kv.first), "gpt: '", kv.first,
                "' is not a tensor of GPT-2 (a GPT-2 of ", describe(o), ")");
  }
  return o;
}

std::vector<int64_t> hf_eos_token_ids(const std::string& dir) {
  std::string file = dir + "/generation_config.json";
  file = is_file(file) ? file : dir + "/" + kHfConfigFile;
  const Json config = read_config(file, dir);
  const auto it = config.find("eos_token_id");
  std::vector<int64_t> out;
  if (it == config.end() || it->is_null()) {
    return out;
  }
  for (const Json& id : it->is_array() ? *it : Json::array({*it})) {
    TORCH_CHECK(id.is_number_integer(), "gpt: ", file, ": eos_token_id holds ", id.dump(),
                ", not a token id");
    out.push_back(id.get<int64_t>());
  }
  return out;
}

void check_gpt2_pretrained_target(const std::string& dir) {
  check_no_model_files(dir);
}

void load_gpt2_safetensors(const torch::nn::Sequential& model, const std::string& path) {
  const GptOptions shape = gpt_options_of(model);
  const bool from_directory = is_directory(path);
  GptOptions config;
  if (from_directory) {
    config = gpt2_config_options(path);
    check_model_follows_config(shape, config, path + "/" + kHfConfigFile);
  }
  const std::string weights = from_directory ? weights_in(path) : path;
  const auto expected = gpt2_shapes(from_directory ? config : shape);
  std::set<std::string> wanted;  // only these are read: Hugging Face's extras stay on disk
  for (const auto& kv : expected) {
    wanted.insert(kv.first);
    wanted.insert(kHfTransformerPrefix + kv.first);
  }
  const auto keep = [&wanted](const std::string& name) { return wanted.count(name) > 0; };
  const std::map<std::string, torch::Tensor> file = detail::ends_with(weights, ".index.json")
                                                        ? load_safetensors_shards(weights, keep)
                                                        : load_safetensors(weights, keep);
  // Every tensor is found and checked before any is copied: a failed load leaves the model as it
  // was.
  std::vector<std::pair<torch::Tensor, torch::Tensor>> copies;
  for (const auto& p : model->named_parameters()) {
    const std::string hf = hf_gpt2_name(p.key());
    const std::string bare = bare_name(hf);
    auto it = file.find(hf);
    it = it == file.end() ? file.find(bare) : it;
    TORCH_CHECK(it != file.end(), "gpt: ", weights, " has no tensor '", hf, "' (nor '", bare,
                "') for the model's '", p.key(), "'; ",
                from_directory ? "config.json describes another GPT-2 than these weights"
                               : "is it a GPT-2 checkpoint?");
    const c10::IntArrayRef want(expected.at(bare));
    TORCH_CHECK(!from_directory || it->second.sizes() == want, "gpt: ", path,
                "/config.json does not match the weights beside it: tensor '", it->first,
                "' has shape ", it->second.sizes(), " in ", weights, ", but config.json (",
                describe(config), ") makes it ", want,
                "; fix config.json, or use the one saved with these weights");
    TORCH_CHECK(it->second.sizes() == want, "gpt: tensor '", it->first, "' of ", weights,
                " has shape ", it->second.sizes(), ", but the model's '", p.key(), "' has shape ",
                p.value().sizes(), "; the file holds a GPT-2 of another shape");
    // A shorter context keeps the first positions (nanoGPT's crop_block_size).
    copies.emplace_back(p.value(), it->second.narrow(0, 0, p.value().size(0)));
  }
  torch::NoGradGuard no_grad;
  for (auto& c : copies) {
    c.first.copy_(c.second);
  }
}

void load_gpt_weights(const torch::nn::Sequential& model, const std::string& path) {
  bool hugging_face = is_directory(path) || detail::ends_with(path, ".index.json");
  try {
    if (!hugging_face) {
      load_safetensors(path, [&hugging_face](const std::string& name) {
        hugging_face = hugging_face || name == "transformer.wte.weight" || name == "wte.weight";
        return false;  // the names tell; no tensor is read
      });
    }
  } catch (const c10::Error&) {
    // Not safetensors: load_weights below reads torch.save files, and names what is wrong.
  }
  if (hugging_face) {
    load_gpt2_safetensors(model, path);
  } else {
    load_module_state(*model.ptr(), load_weights(path));  // strict, as PyTorch
  }
}

void save_gpt2_pretrained(const std::string& dir,
                          const std::map<std::string, torch::Tensor>& tensors,
                          const GptOptions& options,
                          int64_t max_shard_bytes) {
  check_no_model_files(dir);
  const GptOptions got = gpt2_options_of_weights(tensors, options.heads());
  TORCH_CHECK(got.layers() == options.layers() && got.width() == options.width() &&
                  got.vocab() == options.vocab() && got.context() == options.context(),
              "gpt: the weights are a GPT-2 of ", describe(got), ", not of ", describe(options));
  std::map<std::string, torch::Tensor> weights;  // by GPT2LMHeadModel's names, extras left out
  for (const auto& kv : tensors) {
    const std::string name = bare_name(kv.first);
    if (!is_hf_extra(name)) {
      weights[kHfTransformerPrefix + name] = kv.second;
    }
  }
  save_safetensors_shards(dir, weights, max_shard_bytes);
  // config.json last: a directory that has one holds the weights it describes.
  const std::string config = gpt2_config_json(
      options, weights.at(std::string(kHfTransformerPrefix) + "wte.weight").scalar_type());
  write_file_atomic(dir + "/" + kHfConfigFile, config.data(), config.size());
}

void save_gpt2_pretrained(const std::string& dir,
                          const torch::nn::Sequential& model,
                          int64_t max_shard_bytes) {
  std::map<std::string, torch::Tensor> tensors;
  for (const auto& p : model->named_parameters()) {
    tensors[hf_gpt2_name(p.key())] = p.value().detach();
  }
  save_gpt2_pretrained(dir, tensors, gpt_options_of(model), max_shard_bytes);
}

}  // namespace models
}  // namespace paratrain
