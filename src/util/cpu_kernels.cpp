#include "paratrain/util/cpu_kernels.h"

#include "base/errors.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>  // at::init_num_threads
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <torch/version.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <atomic>
#include <cctype>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>

namespace paratrain {
namespace cpu {

namespace {

std::atomic<bool> pretend_no_caches{false};

// What was decided, under `mutex`.
struct State {
  std::mutex mutex;
  bool usable_checked = false;
  std::string onednn_off_because;  // "" while oneDNN is on in ATen, or was off already
  bool bf16_checked = false;
  std::string bf16_path;   // how bf16 convolutions run, once checked
  std::string bf16_error;  // why they cannot, when even ATen's kernels fail
};

State& state() {
  static State s;
  return s;
}

// One bf16 convolution, forward and backward; "" when it runs, else the error's first line.
// Inputs from ones(): no draw from the random generators, so the caller's training is unchanged.
// On a thread of its own, whose thread-local state is libtorch's default: the caller's may have
// gradients off (InferenceMode, a custom autograd function's forward) or autocast on, and the
// backward would then fail for reasons that are not oneDNN's.
std::string try_bf16_convolution() {
  std::string error;
  auto convolve = [&error] {
    try {
      const auto bf16 = at::TensorOptions().dtype(at::kBFloat16);
      at::Tensor x = at::ones({2, 16, 8, 8}, bf16).requires_grad_();
      at::Tensor w = at::ones({16, 16, 3, 3}, bf16).requires_grad_();
      at::conv2d(x, w, {}, 1, 1).sum().backward();
    } catch (const std::exception& e) {
      error = paratrain::detail::error_message(e);
    }
  };
  std::thread probe;
  try {
    probe = std::thread([&convolve] {
      at::init_num_threads();  // the process's intra-op thread count, not OpenMP's default
      convolve();
    });
  } catch (const std::system_error&) {
    // No thread to be had (a process limit): on the caller's, with gradients on whatever its
    // state (bf16 inputs make autocast's casts no-ops).
    c10::InferenceMode not_inference(false);
    at::AutoGradMode grad(true);
    convolve();
    return error;
  }
  probe.join();
  return error;
}

// ONEDNN_MAX_CPU_ISA, or its older name DNNL_MAX_CPU_ISA, in capitals; "" when neither is set
// (an empty value counts as unset, as oneDNN reads it).
std::string onednn_max_isa() {
  const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA");
  if (cap == nullptr || *cap == '\0') {
    cap = std::getenv("DNNL_MAX_CPU_ISA");
  }
  std::string isa = cap != nullptr ? cap : "";
  for (char& c : isa) {
    c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  }
  return isa;
}

bool cpu_has_avx512_bw_vl_dq() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

// Whether ONEDNN_MAX_CPU_ISA keeps oneDNN below AVX512_CORE, where it has no bf16 convolutions.
bool onednn_capped_below_avx512() {
  const std::string isa = onednn_max_isa();
  return isa == "SSE41" || isa == "AVX" || isa.rfind("AVX2", 0) == 0;  // AVX2, AVX2_VNNI, ...
}

// Records why oneDNN is off, and says so once on stderr.
void say_onednn_off(const std::string& why) {
  state().onednn_off_because = why;
  std::cerr << "paratrain: warning: " << why
            << "; oneDNN is turned off in ATen (as torch.backends.mkldnn.enabled = False), so "
               "ATen's own convolution kernels run instead, fp32 ones too (slower)"
            << std::endl;
}

void turn_onednn_off(const std::string& why) {
  at::globalContext().setUserEnabledMkldnn(false);
  say_onednn_off(why);
}

// ensure_usable_kernels() with the state's mutex held.
bool ensure_usable_locked() {
  State& s = state();
  if (!s.usable_checked) {
    s.usable_checked = true;
    if (onednn_needs_cache_sizes() && !reports_caches() && onednn_max_isa() != "SSE41" &&
        at::globalContext().userEnabledMkldnn()) {
      turn_onednn_off(
          "this CPU does not describe its caches through CPUID, and oneDNN 3.x divides by zero "
          "(SIGFPE) planning convolutions there");
    }
  }
  return at::globalContext().userEnabledMkldnn();
}

}  // namespace

bool reports_caches() {
  if (pretend_no_caches.load()) {
    return false;
  }
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  for (unsigned leaf : {4u, 0x8000001Du}) {
    if (__get_cpuid_count(leaf, 0, &a, &b, &c, &d) != 0 && (a & 0x1f) != 0) {
      return true;  // the first cache's type is not "null"
    }
  }
  return false;
#else
  return true;  // oneDNN reads cache sizes elsewhere on other architectures
#endif
}

bool onednn_needs_cache_sizes() {
  // libtorch 2.1 moved to oneDNN 3.x; 1.13 and 2.0 have oneDNN 2.x.
  return TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1);
}

bool ensure_usable_kernels() {
  std::lock_guard<std::mutex> lock(state().mutex);
  return ensure_usable_locked();
}

namespace {

bool bf16_convolutions_use_onednn() {
  // libtorch 1.13 asks the CPU (at::native::mkldnn_bf16_device_check); 2.x asks oneDNN, which
  // also honours ONEDNN_MAX_CPU_ISA.
  return at::globalContext().userEnabledMkldnn() && cpu_has_avx512_bw_vl_dq() &&
         (TORCH_VERSION_MAJOR < 2 || !onednn_capped_below_avx512());
}

// ensure_bf16_convolutions()'s check, with the state's mutex held.
void check_bf16_locked() {
  State& s = state();
  const bool onednn = ensure_usable_locked();
  std::string error = try_bf16_convolution();
  s.bf16_checked = true;
  if (error.empty()) {
    s.bf16_path = bf16_convolutions_use_onednn()
                      ? "runs on oneDNN"
                      : (onednn ? "runs on ATen's own kernels (this CPU lacks AVX512BW, VL or DQ"
                                  ", or ONEDNN_MAX_CPU_ISA keeps oneDNN below them)"
                                : "runs on ATen's own kernels (oneDNN is off)");
    return;
  }
  if (onednn) {
    at::globalContext().setUserEnabledMkldnn(false);
    const std::string retry = try_bf16_convolution();
    if (retry.empty()) {
      const std::string cap = onednn_max_isa();
      say_onednn_off("oneDNN cannot run bf16 convolutions here" +
                     (cap.empty() ? std::string(" (it needs AVX512BW, VL and DQ)")
                                  : " (ONEDNN_MAX_CPU_ISA=" + cap + ")") +
                     ": " + error);
      s.bf16_path = "runs on ATen's own kernels (oneDNN refused them)";
      return;
    }
    // ATen's kernels fail too: turning oneDNN off did not help, so it goes back on.
    at::globalContext().setUserEnabledMkldnn(true);
    error = retry;
  }
  s.bf16_error = error;
  s.bf16_path = "fail: " + error;
}

}  // namespace

bool bf16_convolutions_run_on_onednn() {
  std::lock_guard<std::mutex> lock(state().mutex);
  return bf16_convolutions_use_onednn();
}

void ensure_bf16_convolutions() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.bf16_checked) {
    check_bf16_locked();
  }
  TORCH_CHECK(s.bf16_error.empty(), "bf16 convolutions do not run on this CPU, neither in oneDNN ",
              "nor in ATen's own kernels (", s.bf16_error,
              "): train in fp32 (opt level O0, --amp O0); fp16 is no option on the CPU");
}

std::string describe() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  ensure_usable_locked();
  std::string out = std::string("cpu caches    ") +
                    (reports_caches() ? "described through CPUID" : "not described through CPUID") +
                    "\n";
  out += std::string("onednn        ") +
         (at::globalContext().userEnabledMkldnn()
              ? "on in ATen"
              : "off in ATen" +
                    (s.onednn_off_because.empty() ? std::string() : ": " + s.onednn_off_because));
  const std::string cap = onednn_max_isa();
  if (!cap.empty() && s.onednn_off_because.empty()) {
    out += " (ONEDNN_MAX_CPU_ISA=" + cap + ")";
  }
  out += "\n";
  if (s.bf16_checked) {
    out += "bf16 conv     " + s.bf16_path + "\n";
  }
  return out;
}

void reset_for_testing(bool pretend) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  pretend_no_caches.store(pretend);
  s.usable_checked = false;
  s.onednn_off_because.clear();
  s.bf16_checked = false;
  s.bf16_path.clear();
  s.bf16_error.clear();
}

}  // namespace cpu
}  // namespace paratrain
