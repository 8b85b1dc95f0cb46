#include "paratrain/io/tensorboard.h"

#include <c10/util/Exception.h>

#ifdef PARATRAIN_WITH_TENSORBOARD
#include "tensorboard_records.h"
#endif

#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

namespace paratrain {
namespace tensorboard {

namespace {

// CRC-32C by table, one byte at a time: zlib has only CRC-32 (another polynomial), Debian 12
// packages no CRC-32C library, and event files are a few records per log step.
const std::array<uint32_t, 256>& crc32c_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) {
        c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // Castagnoli's polynomial, reflected
      }
      t[i] = c;
    }
    return t;
  }();
  return table;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t masked_crc32c(const void* data, size_t size) {
  const auto& table = crc32c_table();
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < size; ++i) {
    crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  }
  crc ^= 0xFFFFFFFFu;
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

#ifdef PARATRAIN_WITH_TENSORBOARD

bool available() {
  return true;
}

struct SummaryWriter::Impl {
  std::string path;
  std::ofstream out;

  void write(const std::string& bytes) {
    // TFRecord framing, little-endian as on every machine libtorch runs on.
    const uint64_t length = bytes.size();
    const uint32_t length_crc = masked_crc32c(&length, sizeof(length));
    const uint32_t data_crc = masked_crc32c(bytes.data(), bytes.size());
    out.write(reinterpret_cast<const char*>(&length), sizeof(length));
    out.write(reinterpret_cast<const char*>(&length_crc), sizeof(length_crc));
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.write(reinterpret_cast<const char*>(&data_crc), sizeof(data_crc));
    TORCH_CHECK(out.good(), "cannot write the TensorBoard event file ", path, ": ",
                std::strerror(errno));
  }
};

SummaryWriter::SummaryWriter(const std::string& log_dir) : impl_(std::make_unique<Impl>()) {
  std::error_code ec;
  std::filesystem::create_directories(log_dir, ec);
  TORCH_CHECK(!ec, "cannot create the TensorBoard directory ", log_dir, ": ", ec.message());
  char host[HOST_NAME_MAX + 1] = {0};
  ::gethostname(host, sizeof(host) - 1);
  static std::atomic<int> counter{0};  // several writers of one process get distinct files
  char name[64];
  std::snprintf(name, sizeof(name), "events.out.tfevents.%010lld.",
                static_cast<long long>(now_seconds()));
  impl_->path = log_dir + "/" + name + host + "." + std::to_string(::getpid()) + "." +
                std::to_string(counter++);
  impl_->out.open(impl_->path, std::ios::binary | std::ios::trunc);
  TORCH_CHECK(impl_->out.is_open(), "cannot write the TensorBoard event file ", impl_->path, ": ",
              std::strerror(errno));
  impl_->write(detail::version_event(now_seconds()));
  flush();  // TensorBoard finds the file at once
}

SummaryWriter::~SummaryWriter() {
  if (impl_ && impl_->out.is_open()) {
    impl_->out.flush();
  }
}

void SummaryWriter::add_scalar(const std::string& tag, double value, int64_t step) {
  // TensorBoard's scalars are float32.
  impl_->write(detail::scalar_event(now_seconds(), step, tag, static_cast<float>(value)));
}

void SummaryWriter::purge(int64_t step) {
  impl_->write(detail::session_start_event(now_seconds(), step));
}

void SummaryWriter::flush() {
  impl_->out.flush();
  TORCH_CHECK(impl_->out.good(), "cannot write the TensorBoard event file ", impl_->path, ": ",
              std::strerror(errno));
}

const std::string& SummaryWriter::path() const {
  return impl_->path;
}

#else  // built without Protocol Buffers

bool available() {
  return false;
}

struct SummaryWriter::Impl {
  std::string path;
};

SummaryWriter::SummaryWriter(const std::string& log_dir) {
  TORCH_CHECK(false, "cannot write TensorBoard files to ", log_dir,
              ": this paratrain was built without Protocol Buffers; install libprotobuf-dev and "
              "protobuf-compiler and build it again");
}

SummaryWriter::~SummaryWriter() = default;
void SummaryWriter::add_scalar(const std::string&, double, int64_t) {}
void SummaryWriter::purge(int64_t) {}
void SummaryWriter::flush() {}
const std::string& SummaryWriter::path() const {
  return impl_->path;
}

#endif

}  // namespace tensorboard
}  // namespace paratrain
