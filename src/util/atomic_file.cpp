#include "paratrain/util/atomic_file.h"

#include <c10/util/Exception.h>

#include <zlib.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace paratrain {

namespace {

std::string last_error_text() {
  return std::strerror(errno);
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  TORCH_CHECK(fd >= 0, "cannot open directory ", dir, ": ", last_error_text());
  const int rc = ::fsync(fd);
  const int saved = errno;
  ::close(fd);
  TORCH_CHECK(rc == 0, "fsync of directory ", dir, " failed: ", std::strerror(saved));
}

}  // namespace

std::string parent_directory(const std::string& path) {
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
}

uint32_t write_pieces_atomic(const std::string& path, const std::vector<FilePiece>& pieces) {
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, "cannot create ", tmp, ": ", last_error_text());
  uLong crc = crc32(0L, Z_NULL, 0);
  auto fail = [&](const char* what) {
    const int saved = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    TORCH_CHECK(false, "", what, " ", tmp, " failed: ", std::strerror(saved));
  };
  for (const FilePiece& p : pieces) {
    const char* at = static_cast<const char*>(p.data);
    size_t left = p.size;
    while (left > 0) {
      // zlib's crc32 takes a uInt length: feed it at most 1 GiB at a time.
      const size_t chunk = std::min<size_t>(left, size_t(1) << 30);
      const ssize_t n = ::write(fd, at, chunk);
      if (n < 0 && errno == EINTR) {
        continue;
      }
      if (n <= 0) {
        fail("writing");
      }
      crc = crc32(crc, reinterpret_cast<const Bytef*>(at), static_cast<uInt>(n));
      at += n;
      left -= static_cast<size_t>(n);
    }
  }
  if (::fsync(fd) != 0) {
    fail("fsync of");
  }
  if (::close(fd) != 0) {
    const int saved = errno;
    ::unlink(tmp.c_str());
    TORCH_CHECK(false, "closing ", tmp, " failed: ", std::strerror(saved));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int saved = errno;
    ::unlink(tmp.c_str());
    TORCH_CHECK(false, "renaming ", tmp, " to ", path, " failed: ", std::strerror(saved));
  }
  fsync_dir(parent_directory(path));
  return static_cast<uint32_t>(crc);
}

void write_file_atomic(const std::string& path, const void* data, size_t size) {
  write_pieces_atomic(path, {{data, size}});
}

}  // namespace paratrain
