// TensorBoard event files, written as torch.utils.tensorboard.SummaryWriter writes them: a file
// events.out.tfevents.<seconds>.<host>.<pid>.<n> in the log directory, holding TFRecords (a
// little-endian uint64 length, its masked CRC-32C, the bytes, their masked CRC-32C) of Event
// protobufs: a "brain.Event:2" version record, then one Summary per scalar.
//
//   paratrain::tensorboard::SummaryWriter tb("runs/resnet18");
//   tb.add_scalar("train/loss", loss, step);
//
// Needs a build with Protocol Buffers (Debian's libprotobuf-dev and protobuf-compiler); without
// them the constructor throws, saying so (tensorboard::available() tells beforehand).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace paratrain {
namespace tensorboard {

/// Whether this build writes event files (it was built with Protocol Buffers).
bool available();

/// TFRecord's checksum of `size` bytes: CRC-32C (Castagnoli), rotated right by 15 bits plus
/// 0xa282ead8.
uint32_t masked_crc32c(const void* data, size_t size);

class SummaryWriter {
 public:
  /// Creates `log_dir` if needed and a new event file in it; c10::Error naming the path when it
  /// cannot be written.
  explicit SummaryWriter(const std::string& log_dir);
  ~SummaryWriter();
  SummaryWriter(const SummaryWriter&) = delete;
  SummaryWriter& operator=(const SummaryWriter&) = delete;

  /// One scalar at `step`, stamped with the current time (seconds since the epoch).
  void add_scalar(const std::string& tag, double value, int64_t step);
  /// As SummaryWriter(purge_step=step): TensorBoard discards what earlier files logged at or
  /// after `step`, so a resumed run's repeated steps are not shown twice.
  void purge(int64_t step);
  /// Hands the records to the operating system (add_scalar buffers).
  void flush();
  const std::string& path() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tensorboard
}  // namespace paratrain
