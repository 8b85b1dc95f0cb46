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

/// Writes the pieces, in order, to `path` atomically; returns the CRC-32 (zlib's) of the bytes.
/// Throws c10::Error naming the path and errno's text.
uint32_t write_pieces_atomic(const std::string& path, const std::vector<FilePiece>& pieces);

/// The directory that holds `path`: "." for a bare name, "/" for a file in the root.
std::string parent_directory(const std::string& path);

/// Writes `size` bytes to `path` atomically (write_pieces_atomic with one piece).
void write_file_atomic(const std::string& path, const void* data, size_t size);

}  // namespace paratrain
