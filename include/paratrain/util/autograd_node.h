#pragma once
// How libtorch holds autograd graph nodes, for code that makes or keeps them across versions:
// std::shared_ptr up to libtorch 2.14, c10::intrusive_ptr (Node derives from
// c10::intrusive_ptr_target) from 2.15 on.

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <memory>
#include <type_traits>
#include <utility>

namespace paratrain {
namespace autograd_graph {

/// What libtorch's graph holds a node by: the type `grad_fn()` and `grad_accumulator()` return.
using NodePtr = decltype(torch::autograd::impl::grad_accumulator(
    std::declval<const torch::autograd::Variable&>()));

/// A new node of type T, held as libtorch's graph holds nodes. Before 2.15, through
/// torch::autograd::deleteNode, which frees long chains of nodes without deep recursion.
template <class T, class... Args>
auto make_node(Args&&... args) {
  static_assert(std::is_base_of_v<torch::autograd::Node, T>, "make_node makes autograd nodes");
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, T>) {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  } else {
    // deleteNode is found through T's base (argument-dependent lookup, when T is known), so this
    // branch names nothing that libtorch 2.15 lacks.
    return std::shared_ptr<T>(new T(std::forward<Args>(args)...),
                              [](T* node) { deleteNode(node); });
  }
}

}  // namespace autograd_graph
}  // namespace paratrain
