#pragma once

// Offload tiers, as DeepSpeed's ZeRO-Offload (optimizer state in host memory, the step on the
// CPU) and ZeRO-Infinity (state in files on a disk): state that does not fit in memory lives in
// a lower tier and is streamed through a small buffer in the order a step needs it.
//
//   paratrain::optim::OffloadStore store(paratrain::optim::OffloadOptions().dir("/scratch"));
//   paratrain::optim::FusedAdam opt(fsdp.parameters(), torch::optim::AdamOptions(3e-4));
//   opt.offload(store);    // Adam's moments leave memory; each step reads and writes them
//
// An OffloadStore holds blocks by name:
// - in host memory (OffloadOptions::dir empty): the tier of ZeRO-Offload, whose optimizer state
//   moves from a device to the host, the fused optimizer stepping the device's parameters there
//   (FSDP's offload of shards and gradients takes CPU shards; on the CPU the state moves within
//   memory, as the same code path);
// - in one file in OffloadOptions::dir: the tier for training on the host. The file has no name
//   (made and unlinked at once), so it goes when the store closes or the process dies and is never
//   taken for a checkpoint; checkpoints hold the state itself. It is read and written with
//   O_DIRECT where the file system allows it (else with posix_fadvise), so the page cache does
//   not take back the memory offloading saves. Each block's disk space is allocated when the
//   block is reserved (fallocate): a disk that is too full fails then, in one line, not halfway
//   through a step.
// - every block carries a CRC-32 (zlib's) of what was written; a read that does not match throws
//   one line naming the file and the block.
//
// Reads and writes run in order on one I/O thread of the store's: a caller queues the read of the
// next block (prefetch) and the write of the last (write-behind) and computes meanwhile. A queued
// operation's buffer must stay alive and untouched until its future is waited on.
//
// Threads: call a store from one thread at a time (its I/O thread is its own business).

#include <torch/arg.h>
#include <torch/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace paratrain {
namespace optim {

struct OffloadOptions {
  /// The directory of the files tier; "" keeps the blocks in host memory. It must exist, be
  /// writable and be on a disk: tmpfs and ramfs are memory, and are refused.
  TORCH_ARG(std::string, dir) = "";
  /// Who owns the store, for its file's name and its messages ("rank 1").
  TORCH_ARG(std::string, owner) = "this process";
};

/// Why `dir` cannot hold offloaded state, in one line ("" when it can): missing, not a
/// directory, not writable, or on tmpfs or ramfs.
std::string offload_dir_problem(const std::string& dir);
/// The bytes an unprivileged process may still write on `dir`'s file system (statvfs).
int64_t offload_free_bytes(const std::string& dir);
/// The disk a block of `bytes` takes in the files tier (whole 4 KiB pages, for direct I/O).
int64_t offload_block_bytes(int64_t bytes);

class OffloadStore {
 public:
  /// Throws c10::Error with offload_dir_problem's line for a directory that cannot hold state.
  explicit OffloadStore(OffloadOptions options = {});
  ~OffloadStore();
  OffloadStore(const OffloadStore&) = delete;
  OffloadStore& operator=(const OffloadStore&) = delete;

  /// Makes room for block `key` of `bytes` (disk space allocated now in the files tier). A
  /// block never written reads as zeros. Reserving a key again with its size is a no-op; with
  /// another size, c10::Error. Throws one line when the disk has no room.
  void reserve(const std::string& key, int64_t bytes);
  bool has(const std::string& key) const;
  /// Whether `key` was written since it was reserved or discarded (else it reads as zeros).
  bool written(const std::string& key) const;
  /// Makes `key` read as zeros again (its space stays reserved); no-op for an unknown key. Waits
  /// for the queued operations first.
  void discard(const std::string& key);

  /// Says that `param`'s `part` ("param": its values, "grad": its gradient) lives in block
  /// `key`: FSDP binds its offloaded shards and gradients so that the fused optimizer's step
  /// reads and writes them there. The store holds `param` only by address: unbind before it dies.
  void bind(const torch::Tensor& param, const std::string& part, const std::string& key);
  void unbind(const torch::Tensor& param);
  /// The block bound to `param`'s `part`; "" when none.
  std::string bound(const torch::Tensor& param, const std::string& part) const;

  /// Queues a read of block `key` into `dst` (a buffer from buffer(), of at least the block's
  /// size), checked against the block's checksum.
  std::shared_future<void> read(const std::string& key, void* dst);
  /// Queues a write of the block's size from `src` (a buffer from buffer()) into block `key`.
  std::shared_future<void> write(const std::string& key, const void* src);
  /// Waits for a queued operation and rethrows its error; the time spent waiting counts in
  /// io_wait_seconds().
  void wait(const std::shared_future<void>& done);

  /// An uninitialized 1-D tensor of `numel` elements whose memory suits direct I/O (aligned to
  /// 4 KiB, whole pages).
  static torch::Tensor buffer(int64_t numel, torch::ScalarType dtype);

  /// Whether the blocks are in a file (the files tier).
  bool on_disk() const { return fd_ >= 0; }
  /// The file's name as made (it is unlinked at once), for messages; "host memory" otherwise.
  const std::string& file() const { return file_; }
  /// A path this process can open the unnamed file by (/proc/self/fd/N), for tools and tests.
  std::string descriptor_path() const;
  /// Bytes the blocks take (on disk, or in host memory).
  int64_t stored_bytes() const;
  int64_t bytes_read() const { return bytes_read_.load(); }
  int64_t bytes_written() const { return bytes_written_.load(); }
  /// Seconds callers spent in wait(): the I/O a step did not hide.
  double io_wait_seconds() const { return io_wait_seconds_; }

 private:
  struct Block {
    int64_t offset = 0;  // in the file
    int64_t bytes = 0;
    uint32_t crc = 0;
    bool written = false;
    std::unique_ptr<char[]> host;  // the host tier's copy
  };
  std::shared_future<void> queue(std::function<void()> job);
  void run_io();
  Block& block(const std::string& key);
  void read_block(const std::string& key, Block& b, void* dst);
  void write_block(const std::string& key, Block& b, const void* src);

  OffloadOptions options_;
  int fd_ = -1;
  bool direct_ = false;
  std::string file_;
  int64_t end_ = 0;  // the file's reserved size
  std::map<std::string, Block> blocks_;
  std::map<std::pair<const void*, std::string>, std::string> bindings_;
  std::atomic<int64_t> bytes_read_{0}, bytes_written_{0};
  double io_wait_seconds_ = 0;
  mutable std::mutex mutex_;  // the queue, and the blocks' crc and written
  std::condition_variable ready_;
  std::deque<std::packaged_task<void()>> jobs_;
  bool stopping_ = false;
  std::thread io_;
};

}  // namespace optim
}  // namespace paratrain
