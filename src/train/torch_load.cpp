#include "paratrain/train/torch_load.h"

#include "paratrain/train/safetensors.h"

#include <torch/serialize.h>

#include <fstream>
#include <iterator>

namespace paratrain {

namespace {

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "cannot open weights file ", path);
  return std::vector<char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

bool is_zip(const std::vector<char>& bytes) {
  return bytes.size() >= 4 && bytes[0] == 'P' && bytes[1] == 'K' && bytes[2] == 3 && bytes[3] == 4;
}

}  // namespace

std::map<std::string, torch::Tensor> load_torch_state_dict(const std::string& path) {
  const std::vector<char> bytes = read_file(path);
  TORCH_CHECK(is_zip(bytes), path,
              " is not a torch.save file (no zip header); PyTorch >= 1.6 writes zip archives, "
              "older files need torch.save(..., _use_new_zipfile_serialization=True)");
  torch::IValue value;
  try {
    value = torch::pickle_load(bytes);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "cannot read ", path,
                ": libtorch 1.13 cannot unpickle it (an OrderedDict from model.state_dict() "
                "carries attributes it does not read); save a plain dict instead, "
                "torch.save(dict(model.state_dict()), path), or safetensors (libtorch said: ",
                e.what_without_backtrace(), ")");
  }
  TORCH_CHECK(value.isGenericDict(), path, " holds a ", value.tagKind(),
              ", not a dict of tensors; save torch.save(dict(model.state_dict()), path)");
  std::map<std::string, torch::Tensor> out;
  for (const auto& kv : value.toGenericDict()) {
    TORCH_CHECK(kv.key().isString(), path, ": a key is a ", kv.key().tagKind(), ", not a name");
    TORCH_CHECK(kv.value().isTensor(), path, ": '", kv.key().toStringRef(), "' is a ",
                kv.value().tagKind(), ", not a tensor");
    out[kv.key().toStringRef()] = kv.value().toTensor();
  }
  return out;
}

std::map<std::string, torch::Tensor> load_weights(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "cannot open weights file ", path);
  char head[4] = {0, 0, 0, 0};
  in.read(head, 4);
  if (in.gcount() == 4 && head[0] == 'P' && head[1] == 'K' && head[2] == 3 && head[3] == 4) {
    return load_torch_state_dict(path);
  }
  return load_safetensors(path);
}

}  // namespace paratrain
