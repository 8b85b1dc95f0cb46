#pragma once

// Internal: file-system helpers shared by the library, the CLI, the benchmarks and the tests.

#include <string>

namespace paratrain {
namespace detail {

/// Removes `path` and everything under it, as `rm -rf`, without following symbolic links; a
/// missing path is no error. Returns "" on success, else what could not be removed and why.
///
/// Why not std::filesystem::remove_all: the PyTorch wheels' libtorch.so (2.11 seen) exports its
/// own copy of it, built with an older libstdc++, and a program linked to that libtorch calls that
/// copy, which jumps to address 0 (seen: SIGSEGV in every test that cleaned up with it). POSIX
/// nftw does the walk instead.
std::string remove_tree(const std::string& path);

/// Copies the directory `from` to `to` (which must not exist): directories, regular files and
/// symbolic links (as links). A file that vanishes during the walk (a checkpoint its writer
/// rotated out) is skipped. Returns "" on success, else what could not be copied and why. POSIX
/// nftw walks it, as remove_tree.
std::string copy_tree(const std::string& from, const std::string& to);

/// The bytes of the regular file at `path`. Throws c10::Error "cannot read WHAT PATH: REASON" when
/// it cannot be opened or read, or is not a regular file (a directory, a FIFO); `what` says which
/// file the caller wanted: "the checkpoint manifest".
std::string read_whole_file(const std::string& path, const std::string& what);

}  // namespace detail
}  // namespace paratrain
