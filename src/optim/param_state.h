#pragma once

// Internal: the key of a parameter's state in libtorch's Optimizer::state(), for the fused
// optimizers (which keep libtorch's state objects) and for checkpoints (which save and load them).

#include <torch/types.h>

#include <sstream>
#include <string>
#include <type_traits>

namespace paratrain {
namespace optim {
namespace detail {

// libtorch keys an optimizer's per-parameter state by the parameter's TensorImpl address: as
// text in 1.x (c10::guts::to_string, an ostream of the pointer), as the pointer in 2.x.
template <typename Map>
typename Map::key_type state_key(const Map&, const torch::Tensor& p) {
  if constexpr (std::is_same<typename Map::key_type, std::string>::value) {
    std::ostringstream text;
    text << p.unsafeGetTensorImpl();
    return text.str();
  } else {
    return p.unsafeGetTensorImpl();
  }
}

}  // namespace detail
}  // namespace optim
}  // namespace paratrain
