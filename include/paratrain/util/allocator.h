#pragma once

// glibc's malloc and libtorch's CPU tensors. See Note [Freed memory on the CPU].
//
// Note [Freed memory on the CPU]
// libtorch's CPU allocator takes every tensor from malloc and frees it when the tensor dies, so a
// training step allocates and frees each activation and gradient again. By default glibc returns
// large freed blocks to the kernel: blocks above its mmap threshold (128 KiB, raised as blocks
// are freed, up to 32 MiB) are unmapped, and free memory above 128 KiB at the top of the heap is
// trimmed. The next step then faults the same pages in again, zeroed by the kernel. On the
// virtual machines measured this made a small CNN's step 4-5x slower (batch 32 of 1x28x28:
// libtorch 1.13, 96 ms a step in PyTorch and 18 ms with the settings below; paratrain's `train`
// 7.3 s an epoch against 1.8 s), with 5% more peak memory. PyTorch's performance guide suggests
// preloading jemalloc or tcmalloc for the same reason; glibc, told to keep freed memory, is
// enough here and needs no other library (README, Allocator).

namespace paratrain {
namespace cpu {

/// glibc's mmap threshold and trim threshold after keep_freed_memory(): blocks under 256 MiB come
/// from the heap, and up to 1 GiB of free memory stays at its top for the next step.
constexpr long kKeptMmapThreshold = 256L << 20;
constexpr long kKeptTrimThreshold = 1L << 30;

/// Makes glibc's malloc keep freed memory for reuse instead of returning it to the kernel
/// (mallopt M_MMAP_THRESHOLD and M_TRIM_THRESHOLD, as GLIBC_TUNABLES=glibc.malloc.mmap_threshold=
/// 268435456:glibc.malloc.trim_threshold=1073741824 would). Process-wide: the process keeps its
/// peak heap instead of shrinking after it. `paratrain` calls it at start-up; a program of its
/// own calls it once, before training. Leaves the settings alone, and returns false, where the
/// environment sets either threshold (GLIBC_TUNABLES, MALLOC_MMAP_THRESHOLD_ or
/// MALLOC_TRIM_THRESHOLD_) or asks for glibc's defaults (PARATRAIN_KEEP_FREED_MEMORY=0), or the
/// C library is not glibc; returns true once applied. Idempotent and thread-safe.
bool keep_freed_memory();

}  // namespace cpu
}  // namespace paratrain
