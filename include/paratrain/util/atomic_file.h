#pragma once

// Files that must never be seen half-written (checkpoints, their manifests, traces): written to a
// temporary name in the same directory, fsynced, renamed over the target, and the directory
// fsynced, so a crash at any point leaves either the old file or the new one.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace paratrain {

/// One piece of a file written by write_pieces_atomic (e.g. a header, then tensor data).
struct FilePiece {
  const void* data;
  size_t size;
};

/// How write_pieces_atomic finishes a file.
struct AtomicWriteOptions {
  /// fsync the directory after the rename. False when the caller writes several files into one
  /// directory and fsyncs it once after the last (fsync_directory): each fsync costs a journal
  /// commit, and the renames are durable together at that one fsync.
  bool sync_directory = true;
  /// Compute the CRC-32 of the bytes as they are written (returned; 0 when false).
  bool checksum = true;
  /// Once the file is on disk, drop its pages from the page cache (POSIX_FADV_DONTNEED): for
  /// large files not read again soon (checkpoints). The memory is free at once for the next
  /// write, where an atomic write (the old file stays until the new one is whole) would
  /// otherwise make the kernel reclaim other pages, and the cache keeps what training reads.
  bool drop_cache = false;
};

/// Writes the pieces, in order, to `path` atomically; returns the CRC-32 (zlib's) of the bytes.
/// Throws c10::Error naming the path and errno's text.
uint32_t write_pieces_atomic(const std::string& path,
                             const std::vector<FilePiece>& pieces,
                             const AtomicWriteOptions& options = {});

/// fsyncs a directory, making the renames into it durable. Throws c10::Error naming it.
void fsync_directory(const std::string& dir);

/// The CRC-32 (zlib's) of the pieces' bytes, in order.
uint32_t crc32_of(const std::vector<FilePiece>& pieces);

/// The directory that holds `path`: "." for a bare name, "/" for a file in the root.
std::string parent_directory(const std::string& path);

/// Writes `size` bytes to `path` atomically (write_pieces_atomic with one piece).
void write_file_atomic(const std::string& path, const void* data, size_t size);

}  // namespace paratrain
