#include "paratrain/models/registry.h"

#include <torch/torch.h>

namespace paratrain {
namespace models {

std::vector<std::string> names() {
  return {"linear", "mlp"};
}

torch::nn::Sequential make(const std::string& name, int64_t num_classes) {
  namespace nn = torch::nn;
  TORCH_CHECK(num_classes >= 1, "a model needs at least one class, got ", num_classes);
  if (name == "linear") {
    nn::Sequential net;
    net->push_back("flatten", nn::Flatten());
    net->push_back("fc", nn::Linear(784, num_classes));
    return net;
  }
  if (name == "mlp") {
    nn::Sequential net;
    net->push_back("flatten", nn::Flatten());
    net->push_back("linear0", nn::Linear(784, 512));
    net->push_back("bn0", nn::BatchNorm1d(512));
    net->push_back("relu0", nn::ReLU());
    net->push_back("dropout0", nn::Dropout(0.5));  // nn.Dropout()'s default, as in the notes
    net->push_back("linear1", nn::Linear(512, 256));
    net->push_back("bn1", nn::BatchNorm1d(256));
    net->push_back("relu1", nn::ReLU());
    net->push_back("dropout1", nn::Dropout(0.5));
    net->push_back("linear2", nn::Linear(256, num_classes));
    return net;
  }
  std::string known;
  for (const auto& n : names()) {
    known += (known.empty() ? "" : ", ") + n;
  }
  TORCH_CHECK(false, "unknown model '", name, "': choose one of ", known);
}

}  // namespace models
}  // namespace paratrain
