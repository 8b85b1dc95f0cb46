#include "paratrain/optim/offload.h"

#include "util/strings.h"

#include <c10/util/Exception.h>
#include <zlib.h>

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <utility>

namespace paratrain {
namespace optim {
namespace {

// Direct I/O moves whole logical blocks between page-aligned memory and aligned file offsets;
// 4 KiB covers every disk's logical block here.
constexpr int64_t kPage = 4096;

int64_t round_up(int64_t n) {
  return (n + kPage - 1) / kPage * kPage;
}

// zlib's crc32 takes a uInt length: a large block is summed in pieces.
uint32_t checksum(const void* data, int64_t bytes) {
  uLong crc = crc32(0L, Z_NULL, 0);
  const auto* p = static_cast<const Bytef*>(data);
  while (bytes > 0) {
    const auto piece = static_cast<uInt>(std::min<int64_t>(bytes, int64_t{1} << 30));
    crc = crc32(crc, p, piece);
    p += piece;
    bytes -= piece;
  }
  return static_cast<uint32_t>(crc);
}

// pread or pwrite of all `bytes`, through short transfers and signals.
template <typename Op>
void transfer_all(Op op,
                  char* data,
                  int64_t bytes,
                  int64_t offset,
                  const char* what,
                  const std::string& file,
                  const std::string& key) {
  while (bytes > 0) {
    const ssize_t n = op(data, static_cast<size_t>(bytes), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) {
      continue;
    }
    TORCH_CHECK(
        n > 0, "offload: cannot ", what, " block '", key, "' of ", file, ": ",
        n == 0 ? "end of file" : std::strerror(errno),
        errno == ENOSPC ? " (the disk is full: free space or choose another --offload-dir)" : "");
    data += n;
    bytes -= n;
    offset += n;
  }
}

}  // namespace

std::string offload_dir_problem(const std::string& dir) {
  struct stat st {};
  if (dir.empty() || ::stat(dir.c_str(), &st) != 0) {
    return "offload directory '" + dir + "' does not exist; create it on a disk with room for " +
           "the offloaded state";
  }
  if (!S_ISDIR(st.st_mode)) {
    return "offload directory '" + dir + "' is not a directory";
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    return "offload directory '" + dir + "' is not writable by this process (" +
           std::strerror(errno) + "); choose one it can write";
  }
  struct statfs fs {};
  if (::statfs(dir.c_str(), &fs) == 0 &&
      (fs.f_type == TMPFS_MAGIC || fs.f_type == static_cast<decltype(fs.f_type)>(RAMFS_MAGIC))) {
    return "offload directory '" + dir + "' is on " +
           (fs.f_type == TMPFS_MAGIC ? "tmpfs" : "ramfs") +
           ", which is memory: offloading there saves none; choose a directory on a disk";
  }
  return "";
}

int64_t offload_free_bytes(const std::string& dir) {
  struct statvfs fs {};
  TORCH_CHECK(::statvfs(dir.c_str(), &fs) == 0, "offload: cannot read the free space of '", dir,
              "': ", std::strerror(errno));
  return static_cast<int64_t>(fs.f_bavail) * static_cast<int64_t>(fs.f_frsize);
}

int64_t offload_block_bytes(int64_t bytes) {
  return round_up(bytes);
}

OffloadStore::OffloadStore(OffloadOptions options) : options_(std::move(options)) {
  if (!options_.dir().empty()) {
    const std::string problem = offload_dir_problem(options_.dir());
    TORCH_CHECK(problem.empty(), "offload: ", problem);
    static std::atomic<int> made{0};
    file_ = options_.dir() + "/.paratrain-offload." + std::to_string(::getpid()) + "." +
            std::to_string(made++);
    fd_ = ::open(file_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_DIRECT, 0600);
    direct_ = fd_ >= 0;
    if (fd_ < 0 && errno == EINVAL) {  // a file system without direct I/O
      fd_ = ::open(file_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    }
    TORCH_CHECK(fd_ >= 0, "offload: cannot create ", file_, ": ", std::strerror(errno));
    ::unlink(file_.c_str());  // nameless from now on: gone when closed, whatever happens
  } else {
    file_ = "host memory";
  }
  io_ = std::thread([this] { run_io(); });
}

OffloadStore::~OffloadStore() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  ready_.notify_all();
  io_.join();  // runs what was queued: a buffer handed to a write is the caller's until then
  if (fd_ >= 0) {
    ::close(fd_);
  }
}

void OffloadStore::run_io() {
  for (;;) {
    std::packaged_task<void()> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      ready_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) {
        return;
      }
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();  // an error lands in the job's future
  }
}

std::shared_future<void> OffloadStore::queue(std::function<void()> job) {
  std::packaged_task<void()> task(std::move(job));
  std::shared_future<void> done = task.get_future().share();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    jobs_.push_back(std::move(task));
  }
  ready_.notify_one();
  return done;
}

void OffloadStore::reserve(const std::string& key, int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "offload: block '", key, "' of ", bytes, " bytes");
  auto it = blocks_.find(key);
  if (it != blocks_.end()) {
    TORCH_CHECK(it->second.bytes == bytes, "offload: block '", key, "' holds ", it->second.bytes,
                " bytes, not ", bytes);
    return;
  }
  Block b;
  b.bytes = bytes;
  if (on_disk()) {
    b.offset = end_;
    const int64_t size = round_up(bytes);
    if (size > 0) {
      const int err = ::posix_fallocate(fd_, static_cast<off_t>(end_), static_cast<off_t>(size));
      TORCH_CHECK(err == 0, "offload: cannot make room for block '", key, "' (",
                  paratrain::detail::gib(size), ") in ", options_.dir(), " for ", options_.owner(),
                  ": ", std::strerror(err),
                  err == ENOSPC
                      ? "; " + paratrain::detail::gib(offload_free_bytes(options_.dir())) +
                            " free: free space or choose another --offload-dir"
                      : std::string());
    }
    end_ += size;
  } else {
    b.host.reset(new char[static_cast<size_t>(std::max<int64_t>(bytes, 1))]);
  }
  blocks_.emplace(key, std::move(b));
}

bool OffloadStore::has(const std::string& key) const {
  return blocks_.count(key) > 0;
}

bool OffloadStore::written(const std::string& key) const {
  const auto it = blocks_.find(key);
  std::lock_guard<std::mutex> lock(mutex_);
  return it != blocks_.end() && it->second.written;
}

void OffloadStore::discard(const std::string& key) {
  const auto it = blocks_.find(key);
  if (it == blocks_.end()) {
    return;
  }
  queue([] {}).wait();  // the I/O thread runs in order: nothing queued before touches it now
  std::lock_guard<std::mutex> lock(mutex_);
  it->second.written = false;
}

void OffloadStore::bind(const torch::Tensor& param,
                        const std::string& part,
                        const std::string& key) {
  TORCH_CHECK(has(key), "offload: bind to block '", key, "', which is not reserved");
  bindings_[{param.unsafeGetTensorImpl(), part}] = key;
}

void OffloadStore::unbind(const torch::Tensor& param) {
  for (auto it = bindings_.begin(); it != bindings_.end();) {
    it = it->first.first == param.unsafeGetTensorImpl() ? bindings_.erase(it) : std::next(it);
  }
}

std::string OffloadStore::bound(const torch::Tensor& param, const std::string& part) const {
  const auto it = bindings_.find({param.unsafeGetTensorImpl(), part});
  return it == bindings_.end() ? "" : it->second;
}

OffloadStore::Block& OffloadStore::block(const std::string& key) {
  const auto it = blocks_.find(key);
  TORCH_CHECK(it != blocks_.end(), "offload: no block '", key, "' in ", file_);
  return it->second;
}

std::shared_future<void> OffloadStore::read(const std::string& key, void* dst) {
  Block& b = block(key);
  TORCH_CHECK(!on_disk() || !direct_ || reinterpret_cast<uintptr_t>(dst) % kPage == 0,
              "offload: read into memory not from OffloadStore::buffer()");
  return queue([this, key, &b, dst] { read_block(key, b, dst); });
}

std::shared_future<void> OffloadStore::write(const std::string& key, const void* src) {
  Block& b = block(key);
  TORCH_CHECK(!on_disk() || !direct_ || reinterpret_cast<uintptr_t>(src) % kPage == 0,
              "offload: write from memory not from OffloadStore::buffer()");
  return queue([this, key, &b, src] { write_block(key, b, src); });
}

void OffloadStore::read_block(const std::string& key, Block& b, void* dst) {
  bool written = false;
  uint32_t crc = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    written = b.written;
    crc = b.crc;
  }
  if (!written) {
    std::memset(dst, 0, static_cast<size_t>(b.bytes));
    return;
  }
  if (on_disk()) {
    const int64_t size = direct_ ? round_up(b.bytes) : b.bytes;
    transfer_all([this](char* d, size_t n, off_t o) { return ::pread(fd_, d, n, o); },
                 static_cast<char*>(dst), size, b.offset, "read", file_, key);
    if (!direct_) {
      ::posix_fadvise(fd_, b.offset, b.bytes, POSIX_FADV_DONTNEED);  // advice: keep no copy
    }
  } else {
    std::memcpy(dst, b.host.get(), static_cast<size_t>(b.bytes));
  }
  const uint32_t got = checksum(dst, b.bytes);
  TORCH_CHECK(got == crc, "offload: block '", key, "' of ", file_, " (", options_.owner(),
              ") fails its checksum (crc32 ", got, ", written ", crc,
              "): the file was changed or the disk corrupted it; resume from the last checkpoint");
  bytes_read_ += b.bytes;
}

void OffloadStore::write_block(const std::string& key, Block& b, const void* src) {
  const uint32_t crc = checksum(src, b.bytes);
  if (on_disk()) {
    const int64_t size = direct_ ? round_up(b.bytes) : b.bytes;
    transfer_all([this](char* d, size_t n, off_t o) { return ::pwrite(fd_, d, n, o); },
                 const_cast<char*>(static_cast<const char*>(src)), size, b.offset, "write", file_,
                 key);
    if (!direct_) {
      // Written back now and dropped from the page cache, which would otherwise hold the
      // memory the offload saves.
      ::sync_file_range(
          fd_, b.offset, b.bytes,
          SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
      ::posix_fadvise(fd_, b.offset, b.bytes, POSIX_FADV_DONTNEED);
    }
  } else {
    std::memcpy(b.host.get(), src, static_cast<size_t>(b.bytes));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  b.crc = crc;
  b.written = true;
  bytes_written_ += b.bytes;
}

void OffloadStore::wait(const std::shared_future<void>& done) {
  const auto start = std::chrono::steady_clock::now();
  done.wait();
  io_wait_seconds_ +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  done.get();
}

torch::Tensor OffloadStore::buffer(int64_t numel, torch::ScalarType dtype) {
  const int64_t bytes = round_up(std::max<int64_t>(numel, 1) * c10::elementSize(dtype));
  void* data = std::aligned_alloc(kPage, static_cast<size_t>(bytes));
  TORCH_CHECK(data != nullptr, "offload: cannot allocate a buffer of ",
              paratrain::detail::gib(bytes));
  return torch::from_blob(
      data, {numel}, [](void* p) { std::free(p); }, torch::TensorOptions().dtype(dtype));
}

std::string OffloadStore::descriptor_path() const {
  return on_disk() ? "/proc/self/fd/" + std::to_string(fd_) : "";
}

int64_t OffloadStore::stored_bytes() const {
  if (on_disk()) {
    return end_;
  }
  int64_t total = 0;
  for (const auto& kv : blocks_) {
    total += kv.second.bytes;
  }
  return total;
}

}  // namespace optim
}  // namespace paratrain
