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
// library (docs/allocator.md).
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

/// glibc's mmap threshold after map_large_blocks().
constexpr int kLargeBlockThreshold = 32 << 20;

/// For training state that fills the machine (FullyShardedDataParallel calls it for CPU
/// shards): blocks of 32 MiB and more are mapped on their own again, as glibc's defaults map
/// them, and go back to the kernel when freed. In a heap kept whole (keep_freed_memory), the
/// blocks freed once (the unsharded model after sharding, a unit's gradient) are split by
/// smaller allocations and the next large block grows the heap instead. Smaller blocks keep
/// coming from the kept heap. Measured on a GPT of 0.2 billion parameters on 2 ranks, for 2.2 GB
/// of live tensors per rank: 3.7 GB resident with the heap kept whole, 2.8 GB with this and
/// release_free_memory() after sharding (docs/allocator.md). Changes nothing, and returns false,
/// unless keep_freed_memory() has applied its settings (a program on glibc's own settings
/// already maps large blocks); returns true once applied. Process-wide, as mallopt is.
bool map_large_blocks();

/// Gives the free pages of every malloc heap back to the kernel (glibc's malloc_trim(0)), also
/// those between blocks in use, which a kept heap otherwise holds: after freeing memory that will
/// not be needed again (a model's unsharded weights). Returns whether any memory was released.
bool release_free_memory();

}  // namespace cpu
}  // namespace paratrain
