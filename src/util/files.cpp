#include "files.h"

#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace paratrain {
namespace detail {

namespace {

// nftw's callback has no user pointer: the first failure goes to a thread-local.
thread_local std::string first_failure;

int remove_entry(const char* path, const struct stat*, int type, struct FTW*) {
  const int rc = type == FTW_DP ? ::rmdir(path) : ::unlink(path);
  if (rc != 0 && errno != ENOENT && first_failure.empty()) {
    first_failure = std::string(path) + ": " + std::strerror(errno);
  }
  return 0;  // go on: remove as much as possible
}

}  // namespace

std::string remove_tree(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    return errno == ENOENT ? "" : path + ": " + std::strerror(errno);
  }
  first_failure.clear();
  // Children before their directory (FTW_DEPTH), links as links (FTW_PHYS), within one file
  // system (FTW_MOUNT): a bind mount left inside a test's directory is not emptied.
  if (::nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS | FTW_MOUNT) != 0 &&
      first_failure.empty()) {
    first_failure = path + ": " + std::strerror(errno);
  }
  return first_failure;
}

}  // namespace detail
}  // namespace paratrain
