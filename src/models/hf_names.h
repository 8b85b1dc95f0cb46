#pragma once

// Internal: Hugging Face's names for GPT-2's tensors, shared by the model's own names (gpt.cpp)
// and the loader and saver of Hugging Face directories (gpt_pretrained.cpp).

namespace paratrain {
namespace detail {

/// GPT2LMHeadModel's prefix of the transformer's tensors; GPT2Model's names lack it.
inline constexpr const char* kHfTransformerPrefix = "transformer.";

}  // namespace detail
}  // namespace paratrain
