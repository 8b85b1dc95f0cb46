// keep_freed_memory(): glibc's malloc keeps the memory of freed tensors for the next step (Note
// [Freed memory on the CPU]), unless the environment chose its own thresholds.

#include "test_util.h"

#include "paratrain/util/allocator.h"

#include <torch/torch.h>

#include <gtest/gtest.h>

#include <malloc.h>

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <vector>

namespace paratrain {
namespace testing {
namespace {

// Sanitizers bring their own malloc (AddressSanitizer's mallopt refuses; ThreadSanitizer's heap
// is not glibc's), so there is nothing of glibc's to check.
#if defined(__has_feature)  // clang says so here, GCC through __SANITIZE_*__
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define PARATRAIN_UNDER_SANITIZER 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__) || \
    defined(PARATRAIN_UNDER_SANITIZER)
#define PARATRAIN_SKIP_UNDER_SANITIZERS() GTEST_SKIP() << "a sanitizer's malloc replaces glibc's"
#else
#define PARATRAIN_SKIP_UNDER_SANITIZERS() (void)0
#endif

TEST(Allocator, FreedTensorsStayForTheNextStep) {
  PARATRAIN_SKIP_UNDER_SANITIZERS();
  if (std::getenv("PARATRAIN_KEEP_FREED_MEMORY") != nullptr ||
      std::getenv("GLIBC_TUNABLES") != nullptr ||
      std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr ||
      std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr) {
    GTEST_SKIP() << "the environment sets glibc's malloc tunables; this checks paratrain's";
  }
  ASSERT_TRUE(cpu::keep_freed_memory());
  EXPECT_TRUE(cpu::keep_freed_memory());  // idempotent
  // 64 MiB, above the largest mmap threshold glibc would pick by itself (32 MiB): by default the
  // block is mapped for the tensor and unmapped when it dies, every step.
  const size_t bytes = 64u << 20;
  const size_t mapped_before = mallinfo2().hblkhd;
  {
    at::Tensor t = torch::ones({static_cast<int64_t>(bytes / sizeof(float))});
    EXPECT_EQ(t.sum().item<double>(), static_cast<double>(bytes / sizeof(float)));
    EXPECT_EQ(mallinfo2().hblkhd, mapped_before) << "the tensor's block was mapped on its own";
  }
  // Freed, it stays in the heap as free memory for the next tensor (by default free memory above
  // 128 KiB at the top of the heap goes back to the kernel; here the heap is never trimmed).
  EXPECT_GE(mallinfo2().fordblks, bytes) << "the freed block left the heap";
}

// Resident memory of this process, from /proc/self/statm.
size_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  size_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * static_cast<size_t>(::sysconf(_SC_PAGESIZE));
}

// What FSDP sets on the CPU, after keep_freed_memory(): blocks of 32 MiB and more mapped on their
// own and unmapped when freed, smaller ones still from the kept heap, and release_free_memory()
// giving the heap's free pages back to the kernel. Runs after the test above: both change the
// process's settings for good.
TEST(Allocator, LargeBlocksAreMappedAndFreePagesReleased) {
  PARATRAIN_SKIP_UNDER_SANITIZERS();
  if (!cpu::keep_freed_memory()) {
    GTEST_SKIP() << "the environment sets glibc's malloc tunables; this checks paratrain's";
  }
  ASSERT_TRUE(cpu::map_large_blocks());
  EXPECT_TRUE(cpu::map_large_blocks());  // again: the same setting
  const size_t bytes = 64u << 20;
  const size_t mapped_before = mallinfo2().hblkhd;
  {
    at::Tensor t = torch::ones({static_cast<int64_t>(bytes / sizeof(float))});
    EXPECT_GE(mallinfo2().hblkhd, mapped_before + bytes) << "the large block came from the heap";
    at::Tensor small = torch::ones({1 << 20});  // 4 MiB: from the heap
    EXPECT_LT(mallinfo2().hblkhd, mapped_before + bytes + (4u << 20));
  }
  EXPECT_EQ(mallinfo2().hblkhd, mapped_before) << "the large block stayed mapped after it died";

  // 160 MiB of small tensors, touched and freed: the kept heap holds them until released.
  std::vector<at::Tensor> pieces;
  for (int i = 0; i < 20; ++i) {
    pieces.push_back(torch::ones({2 << 20}));  // 8 MiB each
  }
  pieces.clear();
  const size_t kept = resident_bytes();
  EXPECT_TRUE(cpu::release_free_memory());
  EXPECT_LT(resident_bytes() + (100u << 20), kept) << "the heap's free pages stayed resident";
}

TEST(Info, MallocFollowsTheEnvironment) {
  PARATRAIN_SKIP_UNDER_SANITIZERS();
  // paratrain info says which settings the process runs with: its own, or the environment's.
  auto r = run_process({cli_path(), "info", "--json"},
                       {{"GLIBC_TUNABLES", "<unset>"},
                        {"MALLOC_MMAP_THRESHOLD_", "<unset>"},
                        {"MALLOC_TRIM_THRESHOLD_", "<unset>"},
                        {"PARATRAIN_KEEP_FREED_MEMORY", "<unset>"}},
                       120);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("\"malloc_keeps_freed_memory\": true"), std::string::npos) << r.output;
  for (const auto& env : std::vector<std::pair<std::string, std::string>>{
           {"GLIBC_TUNABLES", "glibc.malloc.trim_threshold=131072"},
           {"MALLOC_MMAP_THRESHOLD_", "131072"},
           {"PARATRAIN_KEEP_FREED_MEMORY", "0"}}) {
    r = run_process({cli_path(), "info", "--json"}, {{env.first, env.second}}, 120);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("\"malloc_keeps_freed_memory\": false"), std::string::npos)
        << env.first << "=" << env.second << ": " << r.output;
  }
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
