#pragma once

// glibc's malloc and libtorch's CPU tensors. See Note [Freed memory on the CPU].
//
// Note [Freed memory on the CPU]
// libtorch's CPU allocator takes every tensor from malloc and frees it when the tensor dies, so a
// training step allocates and frees each activation and gradient again. By default glibc returns
// large freed blocks to the kernel: blocks above its mmap threshold (128 KiB, raised as blocks
// are freed, up to 32 MiB) are unmapped, and free memory above 128 KiB at the top of the heap is
// trimmed. The next step then faults the same pages in again, zeroed by the kernel. On the
// virtual machines measured this made a small CNN's step 3-6x slower (batch 32 of 1x28x28,
// libtorch 1.13: PyTorch 61 ms a step, 20 ms with the settings below; paratrain's `train` 10.1 s
// an epoch, 1.8 s), with 6% more peak memory. PyTorch's performance guide suggests preloading
// jemalloc or tcmalloc for the same reason; glibc, told to keep freed memory, needs no other
// library (README, Allocator).
// Threads other than the main one allocate from heaps of their own, which glibc caps at 64 MiB:
// their blocks above that are still mapped and unmapped each time, whatever the threshold.

namespace paratrain {
namespace cpu {

/// glibc's mmap threshold after keep_freed_memory(): blocks under 256 MiB come from the heap.
constexpr int kKeptMmapThreshold = 256 << 20;

/// Makes glibc's malloc keep freed memory for reuse instead of returning it to the kernel:
/// mallopt(M_MMAP_THRESHOLD, 256 MiB), and M_TRIM_THRESHOLD -1, which turns trimming off (see
/// mallopt(3)). The process then keeps its peak heap instead of shrinking after it. `paratrain`
/// calls it at start-up; a program of its own calls it once, at start-up, before it starts
/// threads. Leaves the settings alone, and returns false, where the environment sets either
/// threshold (GLIBC_TUNABLES, MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_) or asks for
/// glibc's defaults (PARATRAIN_KEEP_FREED_MEMORY=0), or where mallopt refuses (not glibc, or
/// AddressSanitizer's malloc); returns true once applied. Under ThreadSanitizer the settings reach
/// glibc, whose malloc then serves nothing. Calls after the first return its result.
bool keep_freed_memory();

}  // namespace cpu
}  // namespace paratrain
