#pragma once

// Internal: the one-pass kernels of the fused optimizers (include/paratrain/optim/fused.h), in a
// scalar, an AVX2 and an AVX512 build, and the choice among them. Every build does the same
// IEEE operations in the same order (fma where ATen's kernels compute a + s * b, true sqrt and
// division), so all three give the same bits.

#include <cstdint>

namespace paratrain {
namespace optim {
namespace detail {

/// The low-precision copy a step may write beside the fp32 parameter.
enum class CopyKind { kNone, kBFloat16, kHalf };

/// One Adam or AdamW parameter: fp32 and contiguous, all `n` elements.
struct AdamArgs {
  float* param = nullptr;
  const float* grad = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  float* max_exp_avg_sq = nullptr;  ///< amsgrad; null otherwise
  uint16_t* copy = nullptr;         ///< bf16 or fp16 bits; null for none
  CopyKind copy_kind = CopyKind::kNone;
  // Scalars computed in double from the step, as libtorch's Adam does, then rounded once.
  float beta1 = 0, one_minus_beta1 = 0, beta2 = 0, one_minus_beta2 = 0;
  float bias_correction2_sqrt = 1, eps = 0;
  float neg_step_size = 0;  ///< -lr / bias_correction1
  float weight_decay = 0;   ///< Adam's L2 term (added to the gradient); 0 for none
  float decay = 1;          ///< AdamW's 1 - lr * weight_decay; 1 for none
  bool decoupled = false;   ///< AdamW
};

/// One SGD parameter: fp32 and contiguous.
struct SgdArgs {
  float* param = nullptr;
  const float* grad = nullptr;
  float* momentum_buffer = nullptr;  ///< null without momentum
  uint16_t* copy = nullptr;
  CopyKind copy_kind = CopyKind::kNone;
  bool first = false;  ///< the buffer's first step: it takes the gradient as it is
  bool nesterov = false;
  float momentum = 0, one_minus_dampening = 1, weight_decay = 0, neg_lr = 0;
};

/// Elements [begin, end) of one parameter.
using AdamKernel = void (*)(const AdamArgs&, int64_t begin, int64_t end);
using SgdKernel = void (*)(const SgdArgs&, int64_t begin, int64_t end);

struct Kernels {
  const char* isa;  ///< "avx512", "avx2" or "scalar"
  AdamKernel adam;
  SgdKernel sgd;
};

/// The widest build this CPU runs, capped by ATEN_CPU_CAPABILITY as ATen's own kernels are
/// ("default": scalar; "avx2"; "avx512..."); decided once.
const Kernels& kernels();

/// The build named `isa` ("avx512", "avx2", "scalar"), for tests that compare them; throws
/// c10::Error when this CPU cannot run it.
const Kernels& kernels_for(const char* isa);

}  // namespace detail
}  // namespace optim
}  // namespace paratrain
