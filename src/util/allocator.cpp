#include "paratrain/util/allocator.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace paratrain {
namespace cpu {
namespace {

// A user who set glibc's thresholds in the environment chose them: keep theirs. So does one who
// asks for glibc's defaults (PARATRAIN_KEEP_FREED_MEMORY=0).
bool environment_sets_thresholds() {
  const char* keep = std::getenv("PARATRAIN_KEEP_FREED_MEMORY");
  if (keep != nullptr && std::strcmp(keep, "0") == 0) {
    return true;
  }
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr ||
      std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr) {
    return true;
  }
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  return tunables != nullptr && (std::strstr(tunables, "glibc.malloc.mmap_threshold") != nullptr ||
                                 std::strstr(tunables, "glibc.malloc.trim_threshold") != nullptr);
}

}  // namespace

// Whether keep_freed_memory() applied its settings: map_large_blocks() adjusts only those.
std::atomic<bool> g_kept{false};

bool keep_freed_memory() {
#if defined(__GLIBC__)
  // Once per process (a static's initialisation is thread-safe); mallopt returns 1 on success.
  static const bool applied = [] {
    if (environment_sets_thresholds()) {
      return false;
    }
    // The mmap threshold first: a glibc that refuses it (older ones capped it at 32 MiB) is then
    // left as it was.
    const bool set =
        mallopt(M_MMAP_THRESHOLD, kKeptMmapThreshold) == 1 && mallopt(M_TRIM_THRESHOLD, -1) == 1;
    g_kept = set;
    return set;
  }();
  return applied;
#else
  return false;
#endif
}

bool release_free_memory() {
#if defined(__GLIBC__)
  return malloc_trim(0) == 1;
#else
  return false;
#endif
}

bool map_large_blocks() {
#if defined(__GLIBC__)
  // A program that kept glibc's own settings (it never called keep_freed_memory) already has
  // large blocks mapped: nothing to change.
  return g_kept && mallopt(M_MMAP_THRESHOLD, kLargeBlockThreshold) == 1;
#else
  return false;
#endif
}

}  // namespace cpu
}  // namespace paratrain
