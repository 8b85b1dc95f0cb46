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

}  // namespace

void fsync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  TORCH_CHECK(fd >= 0, "cannot open directory ", dir, ": ", last_error_text());
  const int rc = ::fsync(fd);
  const int saved = errno;
  ::close(fd);
  TORCH_CHECK(rc == 0, "fsync of directory ", dir, " failed: ", std::strerror(saved));
}

namespace {

// zlib's crc32 takes a uInt length: it is fed at most 1 GiB at a time.
constexpr size_t kCrcChunk = size_t(1) << 30;

}  // namespace

uint32_t crc32_of(const std::vector<FilePiece>& pieces) {
  uLong crc = crc32(0L, Z_NULL, 0);
  for (const FilePiece& p : pieces) {
    const auto* at = static_cast<const Bytef*>(p.data);
    for (size_t left = p.size; left > 0;) {
      const size_t n = std::min(left, kCrcChunk);
      crc = crc32(crc, at, static_cast<uInt>(n));
      at += n;
      left -= n;
    }
  }
  return static_cast<uint32_t>(crc);
}

std::string parent_directory(const std::string& path) {
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
}

namespace {

// Bytes written, then checksummed, at a time: the checksum reads them while write() has left
// them in the cache.
constexpr size_t kWriteChunk = size_t(1) << 20;
// Bytes after which the kernel is asked to start writing them out, so that the disk works while
// the rest is copied and the final fsync has less left to wait for.
constexpr off_t kWritebackChunk = off_t(16) << 20;

// Writes the pieces to `fd` (updating *crc when given); false with errno set on failure.
bool write_all(int fd, const std::vector<FilePiece>& pieces, uLong* crc) {
  off_t written = 0;
  off_t flushed = 0;
  for (const FilePiece& p : pieces) {
    const char* at = static_cast<const char*>(p.data);
    size_t left = p.size;
    while (left > 0) {
      const size_t chunk = std::min(left, kWriteChunk);
      const ssize_t n = ::write(fd, at, chunk);
      if (n < 0 && errno == EINTR) {
        continue;
      }
      if (n <= 0) {
        errno = n == 0 ? EIO : errno;  // write() returning 0 sets no errno
        return false;
      }
      if (crc != nullptr) {
        *crc = crc32(*crc, reinterpret_cast<const Bytef*>(at), static_cast<uInt>(n));
      }
      at += n;
      left -= static_cast<size_t>(n);
      written += n;
      if (written - flushed >= kWritebackChunk) {
        // A hint (Linux): its failure only leaves the work to fsync.
        (void)::sync_file_range(fd, flushed, written - flushed, SYNC_FILE_RANGE_WRITE);
        flushed = written;
      }
    }
  }
  return true;
}

}  // namespace

uint32_t write_pieces_atomic(const std::string& path,
                             const std::vector<FilePiece>& pieces,
                             const AtomicWriteOptions& options) {
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
  if (!write_all(fd, pieces, options.checksum ? &crc : nullptr)) {
    fail("writing");
  }
  if (::fsync(fd) != 0) {
    fail("fsync of");
  }
  if (options.drop_cache) {
    // Advice only: a kernel that ignores it leaves the pages cached, which is no error.
    (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
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
  if (options.sync_directory) {
    fsync_directory(parent_directory(path));
  }
  return options.checksum ? static_cast<uint32_t>(crc) : 0;
}

void write_file_atomic(const std::string& path, const void* data, size_t size) {
  write_pieces_atomic(path, {{data, size}});
}

}  // namespace paratrain
