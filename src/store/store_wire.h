#pragma once

// Internal to store/: the socket store's wire format and the socket helpers its server and its
// client share. Ours at both ends: no other program speaks it.

#include <fcntl.h>
#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

namespace paratrain {
namespace dist {
namespace detail {
namespace store_wire {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// The wire format, ours at both ends. A frame is a 4-byte big-endian length and its body.
// Request body: op (1 byte), how long a get/wait may be held in ms (8 bytes, -1: no limit), the
// number of fields (4 bytes), then each field as a length (4 bytes) and its bytes.
// Reply body: a status (1 byte) and the payload.
enum Op : uint8_t {
  kSet = 1,
  kGet,
  kAdd,
  kCompareSet,
  kCheck,
  kDelete,
  kNumKeys,
  kWait,
  kSetEphemeral  // a set whose key the server deletes when the setter's connection closes
};
enum Status : uint8_t { kOk = 0, kTimedOut = 1, kFailed = 2 };

// Frames beyond this are a foreign or broken peer, not a store value.
inline constexpr uint32_t kMaxFrame = 1u << 30;
// How long past a held get/wait's own limit a client waits for the server's answer, before it
// takes the server for gone.
inline constexpr milliseconds kReplyGrace{5000};
// Limits beyond this are taken as none: adding them to a clock's now() would overflow.
inline constexpr milliseconds kForever = std::chrono::hours(24 * 365 * 100);

// kNoStoreTimeout (0) and limits past kForever wait without end; a negative one has already passed.
inline bool limited(milliseconds timeout) {
  return timeout != milliseconds::zero() && timeout < kForever;
}

inline void put_u32(std::string& out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) {
    out.push_back(static_cast<char>((v >> shift) & 0xff));
  }
}

inline void put_i64(std::string& out, int64_t v) {
  const auto u = static_cast<uint64_t>(v);
  for (int shift = 56; shift >= 0; shift -= 8) {
    out.push_back(static_cast<char>((u >> shift) & 0xff));
  }
}

inline uint64_t get_be(const std::string& in, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) {
    v = (v << 8) | static_cast<unsigned char>(in[at + i]);
  }
  return v;
}

inline std::string frame(const std::string& body) {
  std::string out;
  put_u32(out, static_cast<uint32_t>(body.size()));
  return out + body;
}

inline std::string errno_text(int err) {
  return std::strerror(err);
}

inline bool parse_int64(const std::string& text, int64_t& out) {
  if (text.empty()) {
    return false;
  }
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || end != text.c_str() + text.size()) {
    return false;
  }
  out = v;
  return true;
}

// Milliseconds left until `deadline`, for poll(); -1 when there is none.
inline int poll_ms(bool has_deadline, Clock::time_point deadline) {
  if (!has_deadline) {
    return -1;
  }
  auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count() + 1;
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1 << 30));
}

// Waits until `fd` is ready for `events`; false at the deadline.
inline bool await(int fd, short events, bool has_deadline, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    int rc = ::poll(&p, 1, poll_ms(has_deadline, deadline));
    if (rc > 0) {
      return true;
    }
    // poll's limit is capped (poll_ms), so a quiet return before the deadline waits on.
    if ((rc == 0 && has_deadline && Clock::now() >= deadline) || (rc < 0 && errno != EINTR)) {
      return false;
    }
  }
}

inline void set_nonblocking(int fd) {
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
}

}  // namespace store_wire
}  // namespace detail
}  // namespace dist
}  // namespace paratrain
