// paratrain info: what this build and this machine offer.

#include "args.h"
#include "commands.h"
#include "json_line.h"

#include "paratrain/paratrain.h"

#include <torch/torch.h>

#include <fstream>
#include <iostream>
#include <thread>

namespace paratrain {
namespace cli {

namespace {
// Which BLAS the dynamic loader picked for libtorch: Debian's alternatives decide at run time, and
// the reference BLAS is several times slower than OpenBLAS.
std::string loaded_blas() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  std::string found;
  while (std::getline(maps, line)) {
    auto slash = line.find('/');
    if (slash == std::string::npos) {
      continue;
    }
    std::string path = line.substr(slash);
    if (path.find("openblas") != std::string::npos) {
      return path.substr(0, path.rfind('/')).find("pthread") != std::string::npos
                 ? "OpenBLAS (pthread) " + path
                 : "OpenBLAS " + path;
    }
    if (path.find("libmkl") != std::string::npos) {
      return "MKL " + path;
    }
    if (path.find("/blas/libblas.so") != std::string::npos) {
      found = "reference BLAS " + path + " (slow: install libopenblas0-pthread)";
    }
  }
  return found.empty() ? "unknown" : found;
}
}  // namespace

int run_info(const std::vector<std::string>& argv) {
  static const CommandSpec spec{
      "paratrain info",
      "Prints the versions, the backends of this build, the CPU threads and the CUDA devices.",
      {{"json", "", "print one JSON object"}}};
  Args args(argv, spec);
  if (args.has("help")) {
    std::cout << args.help();
    return 0;
  }
  std::string backends;
  for (const auto& b : dist::available_backends()) {
    backends += (backends.empty() ? "" : ", ") + b;
  }
  const int cuda_devices = static_cast<int>(torch::cuda::device_count());
  try {
    cpu::ensure_bf16_convolutions();  // so that describe() says how bf16 convolutions run
  } catch (const c10::Error&) {
    // describe() says why they fail
  }
  if (args.has("json")) {
    std::cout << json_line({{"paratrain", PARATRAIN_VERSION},
                            {"libtorch", TORCH_VERSION},
                            {"backends", dist::available_backends()},
                            {"cpu_threads", at::get_num_threads()},
                            {"cpu_cores", std::thread::hardware_concurrency()},
                            {"cuda_devices", cuda_devices},
                            {"cpu_caches_described", cpu::reports_caches()},
                            {"onednn_in_aten", at::globalContext().userEnabledMkldnn()},
                            {"malloc_keeps_freed_memory", cpu::keep_freed_memory()},
                            {"fused_optimizer_isa", optim::fused_isa()}})
              << std::endl;
    return 0;
  }
  std::cout << "paratrain     " << PARATRAIN_VERSION << "\n"
            << "libtorch      " << TORCH_VERSION << "\n"
            << "backends      " << backends
#ifndef PARATRAIN_WITH_GLOO
            << " (no gloo: built without gloo's headers; see docs/building.md, \"Using an "
               "official libtorch (CUDA)\")"
#endif
            << "\n"
            << "cpu threads   " << at::get_num_threads() << " intra-op (of "
            << std::thread::hardware_concurrency() << " cores)\n"
            << "blas          " << loaded_blas() << "\n"
            << "fused optim   " << optim::fused_isa()
            << " (--fused-optimizer; ATEN_CPU_CAPABILITY caps it)\n"
            << "malloc        "
            << (cpu::keep_freed_memory()
                    ? "glibc keeps freed memory (mmap threshold " +
                          std::to_string(cpu::kKeptMmapThreshold >> 20) + " MiB, no trimming)"
                    : std::string("glibc's defaults, or the environment's (GLIBC_TUNABLES, "
                                  "MALLOC_*_, PARATRAIN_KEEP_FREED_MEMORY=0), or not glibc"))
            << "\n"
            << cpu::describe() << "cuda devices  " << cuda_devices;
  for (int i = 0; i < cuda_devices; ++i) {
    std::cout << (i ? ", " : " (") << "cuda:" << i << (i + 1 == cuda_devices ? ")" : "");
  }
  std::cout << std::endl;
  return 0;
}

}  // namespace cli
}  // namespace paratrain
