#include "files.h"

#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fcntl.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

#include <c10/util/Exception.h>

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

thread_local std::string copy_from, copy_to;

std::string copy_file(const char* from, const std::string& to, mode_t mode) {
  const int in = ::open(from, O_RDONLY | O_CLOEXEC);
  if (in < 0) {
    return errno == ENOENT ? "" : std::string(from) + ": " + std::strerror(errno);
  }
  const int out = ::open(to.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode & 0777);
  if (out < 0) {
    const std::string why = to + ": " + std::strerror(errno);
    ::close(in);
    return why;
  }
  std::vector<char> buf(1 << 20);
  std::string why;
  while (why.empty()) {
    const ssize_t n = ::read(in, buf.data(), buf.size());
    if (n == 0) {
      break;
    }
    if (n < 0) {
      why = errno == EINTR ? "" : std::string(from) + ": " + std::strerror(errno);
      continue;
    }
    for (ssize_t done = 0; done < n && why.empty();) {
      const ssize_t w = ::write(out, buf.data() + done, static_cast<size_t>(n - done));
      if (w < 0 && errno != EINTR) {
        why = to + ": " + std::strerror(errno);
      }
      done += w > 0 ? w : 0;
    }
  }
  ::close(in);
  if (::close(out) != 0 && why.empty()) {
    why = to + ": " + std::strerror(errno);
  }
  return why;
}

int copy_entry(const char* path, const struct stat* st, int type, struct FTW*) {
  const std::string target = copy_to + (path + copy_from.size());
  std::string why;
  if (type == FTW_D) {
    if (::mkdir(target.c_str(), 0755) != 0 && errno != EEXIST) {
      why = target + ": " + std::strerror(errno);
    }
  } else if (type == FTW_F) {
    why = copy_file(path, target, st->st_mode);
  } else if (type == FTW_SL) {
    std::vector<char> link(4096);
    const ssize_t n = ::readlink(path, link.data(), link.size() - 1);
    if (n >= 0 &&
        ::symlink(std::string(link.data(), static_cast<size_t>(n)).c_str(), target.c_str()) != 0) {
      why = target + ": " + std::strerror(errno);
    }
  }  // FTW_NS, FTW_DNR: gone or unreadable while walking; an unreadable file fails on open
  if (!why.empty() && first_failure.empty()) {
    first_failure = why;
  }
  return 0;
}

}  // namespace

std::string copy_tree(const std::string& from, const std::string& to) {
  struct stat st;
  if (::lstat(to.c_str(), &st) == 0) {
    return to + ": exists";
  }
  first_failure.clear();
  copy_from = from;
  copy_to = to;
  if (::nftw(from.c_str(), copy_entry, 16, FTW_PHYS) != 0 && first_failure.empty()) {
    first_failure = from + ": " + std::strerror(errno);
  }
  return first_failure;
}

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

std::string read_whole_file(const std::string& path, const std::string& what) {
  // POSIX rather than an ifstream: `stream << rdbuf()` swallows read errors (EISDIR, EIO) and
  // returns what it got, which callers would then report as a damaged file. O_NONBLOCK: opening a
  // FIFO must not block (fstat then refuses it); cleared again for the reads.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  TORCH_CHECK(fd >= 0, "cannot read ", what, " ", path, ": ", std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  TORCH_CHECK(::fstat(fd, &st) == 0, "cannot read ", what, " ", path, ": ", std::strerror(errno));
  TORCH_CHECK(S_ISREG(st.st_mode), "cannot read ", what, " ", path, ": ",
              S_ISDIR(st.st_mode) ? "it is a directory" : "it is not a regular file");
  const int flags = ::fcntl(fd, F_GETFL);
  TORCH_CHECK(flags >= 0 && ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) == 0, "cannot read ", what,
              " ", path, ": ", std::strerror(errno));
  std::string bytes(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  char more[4096];  // past the size fstat gave, should the file have grown (or be /proc's)
  while (true) {
    const bool full = got == bytes.size();
    const ssize_t n =
        full ? ::read(fd, more, sizeof(more)) : ::read(fd, &bytes[got], bytes.size() - got);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    TORCH_CHECK(n >= 0, "cannot read ", what, " ", path, ": ", std::strerror(errno));
    if (n == 0) {
      break;
    }
    if (full) {
      bytes.append(more, static_cast<size_t>(n));
    }
    got += static_cast<size_t>(n);
  }
  bytes.resize(got);
  return bytes;
}

}  // namespace detail
}  // namespace paratrain
