// Note [CPU kernels that do not run] (paratrain/util/cpu_kernels.h): both workarounds, on every
// machine. The suite runs in a process of its own (tests/CMakeLists.txt), so turning oneDNN off
// here reaches no other suite; the fixture leaves it after each test as a new process has it.

#include "paratrain/util/cpu_kernels.h"
#include "paratrain/amp/autocast.h"
#include "test_util.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>
#include <torch/version.h>

#include <cctype>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

namespace paratrain {
namespace testing {
namespace {

// A convolution's output and gradients, forward and backward, in fp32.
std::vector<at::Tensor> conv_step(at::ScalarType dtype) {
  at::AutoGradMode grad(true);
  // Inputs exact in bf16, so that fp32 and bf16 differ only in how they compute.
  at::Tensor x = at::linspace(-1, 1, 2 * 8 * 12 * 12).reshape({2, 8, 12, 12});
  at::Tensor w = at::linspace(-0.5, 0.5, 16 * 8 * 3 * 3).reshape({16, 8, 3, 3});
  x = x.to(at::kBFloat16).to(dtype);
  w = w.to(at::kBFloat16).to(dtype);
  x.requires_grad_();
  w.requires_grad_();
  at::Tensor y = at::conv2d(x, w, {}, 1, 1);
  (y * y).sum().backward();
  return {y.detach().to(at::kFloat), x.grad().to(at::kFloat), w.grad().to(at::kFloat)};
}

// The CPU flags the kernel reports, from /proc/cpuinfo (independent of CPUID as paratrain reads
// it, and of oneDNN's and libtorch's own checks).
std::set<std::string> cpu_flags() {
  std::ifstream in("/proc/cpuinfo");
  std::set<std::string> flags;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("flags", 0) == 0) {
      std::istringstream words(line.substr(line.find(':') + 1));
      for (std::string w; words >> w;) {
        flags.insert(w);
      }
      break;
    }
  }
  return flags;
}

// The cap oneDNN honours: ONEDNN_MAX_CPU_ISA or its older name DNNL_MAX_CPU_ISA, in capitals.
std::string onednn_cap() {
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

// Each test starts, and leaves the next one, as a new process does (oneDNN on, nothing checked
// yet), whatever other tests of this process turned off (--gtest_repeat, shuffle, other suites).
class CpuKernels : public ::testing::Test {
 protected:
  void SetUp() override { as_a_new_process(); }
  void TearDown() override { as_a_new_process(); }
  static void as_a_new_process() {
    at::globalContext().setUserEnabledMkldnn(true);
    cpu::reset_for_testing(false);
  }
};

TEST_F(CpuKernels, ACpuWithoutCacheDescriptionsRunsConvolutionsWithoutOneDnn3) {
  // The real path of such a CPU, pretended here: with oneDNN 3.x (libtorch 2.1+) it is turned
  // off, with one warning, and the convolutions give what oneDNN gave; with oneDNN 2.x (1.13),
  // which needs no cache sizes, nothing changes.
  // ONEDNN_MAX_CPU_ISA=SSE41: kernels that need no cache sizes, so oneDNN may stay on.
  const bool sse41 = onednn_cap() == "SSE41";
  // Where the real CPU describes no caches, oneDNN 3.x cannot run here at all, and the fp32
  // comparison below is left to machines that do.
  const bool real_cpu_is_safe = cpu::reports_caches() || !cpu::onednn_needs_cache_sizes() || sse41;
  std::vector<at::Tensor> with_onednn;
  if (real_cpu_is_safe) {
    with_onednn = conv_step(at::kFloat);
  }
  cpu::reset_for_testing(/*pretend_no_caches=*/true);
  EXPECT_FALSE(cpu::reports_caches());
  ::testing::internal::CaptureStderr();
  const bool onednn_on = cpu::ensure_usable_kernels();
  cpu::ensure_usable_kernels();  // once only
  const std::string said = ::testing::internal::GetCapturedStderr();
  if (cpu::onednn_needs_cache_sizes() && !sse41) {
    EXPECT_FALSE(onednn_on);
    EXPECT_FALSE(at::globalContext().userEnabledMkldnn());
    EXPECT_NE(said.find("paratrain: warning: this CPU does not describe its caches through "
                        "CPUID, and oneDNN 3.x divides by zero"),
              std::string::npos)
        << said;
    EXPECT_EQ(said.find("warning", said.find("warning") + 1), std::string::npos) << said;
    EXPECT_NE(cpu::describe().find("off in ATen: this CPU does not describe its caches"),
              std::string::npos)
        << cpu::describe();
  } else {
    EXPECT_TRUE(onednn_on);
    EXPECT_EQ(said, "");
  }
  const auto without = conv_step(at::kFloat);
  for (size_t i = 0; i < with_onednn.size(); ++i) {
    // The same fp32 sums in another order (72 products per output, 288 per weight gradient):
    // measured at most 6.5e-7 of the largest value (libtorch 2.6, ATen's kernels against
    // oneDNN's, with and without ONEDNN_MAX_CPU_ISA=AVX2).
    const double scale = with_onednn[i].abs().max().item<double>();
    const double error = (without[i] - with_onednn[i]).abs().max().item<double>();
    EXPECT_LE(error, 2e-5 * scale) << "conv output/grad " << i << ": " << error / scale;
  }
}

TEST_F(CpuKernels, Bf16ConvolutionsRunWhereverOneDnnLacksThem) {
  // libtorch 1.13 hands bf16 convolutions to oneDNN when the CPU has AVX512BW, VL and DQ, even
  // if ONEDNN_MAX_CPU_ISA keeps oneDNN below AVX512_CORE; only then must paratrain turn oneDNN
  // off. libtorch 2.x asks oneDNN itself and needs nothing. The expectation comes from the
  // environment and /proc/cpuinfo, not from the code under test.
  const auto flags = cpu_flags();
  const bool cpu_has_avx512 =
      flags.count("avx512bw") && flags.count("avx512vl") && flags.count("avx512dq");
  const std::string cap = onednn_cap();
  const bool capped_below_avx512 =
      cap == "SSE41" || cap == "AVX" || cap.rfind("AVX2", 0) == 0;  // AVX2, AVX2_VNNI, ...
  const bool expect_fallback = TORCH_VERSION_MAJOR < 2 && cpu_has_avx512 && capped_below_avx512;
  cpu::reset_for_testing(false);  // checked afresh, whatever ran before in this process

  ::testing::internal::CaptureStderr();
  EXPECT_NO_THROW(cpu::ensure_bf16_convolutions());
  EXPECT_NO_THROW(amp::Autocast(at::kCPU));  // Autocast checks too, silently after the first
  const std::string said = ::testing::internal::GetCapturedStderr();
  if (expect_fallback) {
    EXPECT_FALSE(at::globalContext().userEnabledMkldnn());
    EXPECT_NE(said.find("paratrain: warning: oneDNN cannot run bf16 convolutions here "
                        "(ONEDNN_MAX_CPU_ISA=" +
                        cap + ")"),
              std::string::npos)
        << said;
    EXPECT_NE(cpu::describe().find("bf16 conv     runs on ATen's own kernels"), std::string::npos)
        << cpu::describe();
  } else if (cpu::reports_caches() || !cpu::onednn_needs_cache_sizes()) {
    EXPECT_TRUE(at::globalContext().userEnabledMkldnn()) << said;
    EXPECT_EQ(said, "");
  }
  // Where libtorch sends them: oneDNN with AVX512BW, VL and DQ that the cap does not hide (1.13
  // looks at the CPU alone), else ATen's own kernels, which MixedPrecision's long test skips.
  const bool expect_onednn = at::globalContext().userEnabledMkldnn() && cpu_has_avx512 &&
                             (TORCH_VERSION_MAJOR < 2 || !capped_below_avx512);
  EXPECT_EQ(cpu::bf16_convolutions_run_on_onednn(), expect_onednn) << cpu::describe();
  EXPECT_NE(cpu::describe().find(expect_onednn ? "bf16 conv     runs on oneDNN"
                                               : "bf16 conv     runs on ATen's own kernels"),
            std::string::npos)
      << cpu::describe();
  // Either way bf16 convolutions now run and compute this convolution. Bound: the largest error
  // relative to the largest fp32 value, measured here for output, input and weight gradients:
  // oneDNN 0.33%, 0.24%, 0.36% (both libtorch versions); libtorch 2.6's own kernels 0.33%, 0.92%,
  // 0.43%; libtorch 1.13's own kernels, which accumulate in bf16, 5.3%, 3.0%, 2.0% (PyTorch 1.13
  // with torch.backends.mkldnn.enabled = False gives the same numbers).
  const auto bf16 = conv_step(at::kBFloat16);
  const auto fp32 = conv_step(at::kFloat);
  for (size_t i = 0; i < bf16.size(); ++i) {
    const double scale = fp32[i].abs().max().item<double>();
    EXPECT_LT((bf16[i] - fp32[i]).abs().max().item<double>(), 0.1 * scale) << "tensor " << i;
  }
}

TEST_F(CpuKernels, TheCheckIgnoresTheCallersThreadState) {
  // The first Autocast of a process may come inside InferenceMode (or a custom autograd
  // function's forward), where the probe's backward cannot run: that must not count as oneDNN
  // refusing bf16 convolutions, nor turn oneDNN off.
  cpu::reset_for_testing(false);
  const bool onednn_before = cpu::ensure_usable_kernels();
  {
    c10::InferenceMode inference;
    ::testing::internal::CaptureStderr();
    EXPECT_NO_THROW(cpu::ensure_bf16_convolutions());
    const std::string said = ::testing::internal::GetCapturedStderr();
    if (onednn_cap().empty()) {  // nothing keeps oneDNN from bf16: no reason to turn it off
      EXPECT_EQ(at::globalContext().userEnabledMkldnn(), onednn_before) << said;
      EXPECT_EQ(said.find("cannot run bf16"), std::string::npos) << said;
    }
  }
  EXPECT_EQ(cpu::describe().find("fail:"), std::string::npos) << cpu::describe();
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
