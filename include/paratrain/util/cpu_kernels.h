#pragma once

// What the CPU kernels of this process can run, and the two cases where paratrain changes which
// kernels libtorch uses so that training runs at all. See Note [CPU kernels that do not run].
//
// Note [CPU kernels that do not run]
// ATen runs convolutions through oneDNN on the CPU. Two things make oneDNN fail where ATen's own
// kernels work:
//  1. oneDNN 3.x (libtorch 2.1 and later) divides by zero (SIGFPE: the process dies) while it
//     plans convolutions on CPUs that do not describe their caches through CPUID (leaf 4 on
//     Intel, 0x8000001D on AMD; some virtual machines read zeros there). Plain PyTorch 2.6 dies
//     the same way (torchvision's resnet50, one backward of 8x3x128x128). ensure_usable_kernels()
//     turns oneDNN off in ATen on such a CPU (as torch.backends.mkldnn.enabled = False), unless
//     ONEDNN_MAX_CPU_ISA=SSE41 is set (oneDNN's SSE4.1 kernels need no cache sizes).
//  2. bf16 convolutions need oneDNN's AVX512 kernels. libtorch 2.x asks oneDNN whether it has
//     them and otherwise runs ATen's own bf16 kernels; libtorch 1.13 asks the CPU instead, so with
//     ONEDNN_MAX_CPU_ISA capped below AVX512_CORE it hands bf16 convolutions to a oneDNN that
//     cannot run them ("could not create a primitive descriptor iterator"). PyTorch 1.13 fails
//     the same way there. ensure_bf16_convolutions() tries one small bf16 convolution, forward and
//     backward; if oneDNN refuses it, it turns oneDNN off in ATen, as libtorch 2.x would have
//     chosen ATen's kernels, and says so once.
// Turning oneDNN off is process-wide and also moves fp32 convolutions to ATen's kernels (slower).
// Each change is said once on stderr ("paratrain: warning: ...") and shown by `paratrain info`.
// paratrain calls these where it sets up convolutions or bf16 compute (the model zoo, Autocast and
// MixedPrecision on the CPU, the Trainer); a program with its own models and its own loop may call
// them itself.

#include <string>

namespace paratrain {
namespace cpu {

/// Whether the CPU describes its caches through CPUID (leaf 4 on Intel, 0x8000001D on AMD).
bool reports_caches();

/// Whether this libtorch's oneDNN is 3.x, which needs the cache sizes (libtorch 2.1 and later).
bool onednn_needs_cache_sizes();

/// Case 1 of the Note: turns oneDNN off in ATen where it would divide by zero. Idempotent and
/// thread-safe; returns whether oneDNN is (still) on in ATen.
bool ensure_usable_kernels();

/// Case 2 of the Note: makes bf16 convolutions run on this CPU, turning oneDNN off in ATen if
/// oneDNN refuses them. Throws c10::Error naming the failure and the way out (fp32, opt level O0)
/// when not even ATen's own kernels run them. Idempotent and thread-safe; a convolution is tried
/// once per process (its inputs come from no random generator, so training draws stay the same).
void ensure_bf16_convolutions();

/// Whether libtorch hands bf16 convolutions to oneDNN here (oneDNN on in ATen, and a CPU with
/// AVX512BW, VL and DQ that ONEDNN_MAX_CPU_ISA does not hide on libtorch 2.x); otherwise ATen's own
/// bf16 kernels run them, about 14x slower on libtorch 1.13.
bool bf16_convolutions_run_on_onednn();

/// One line per fact, for `paratrain info`: cache description, oneDNN in ATen on or off and why,
/// and how bf16 convolutions run (when ensure_bf16_convolutions() has run).
std::string describe();

/// For tests: forget what was checked and decided, and whether to pretend that the CPU reports no
/// caches. Does not turn oneDNN back on.
void reset_for_testing(bool pretend_no_caches);

}  // namespace cpu
}  // namespace paratrain
