#include "store_monitor.h"

#include <map>
#include <sstream>
#include <vector>

namespace paratrain {
namespace dist {
namespace detail {

namespace {

std::string heartbeat_key(int rank) {
  return "paratrain/heartbeat/" + std::to_string(rank);
}

struct Beat {
  int64_t issued = -1;
  int64_t count = -1;
};

// Reads every rank's heartbeat; throws when the store cannot be reached.
std::map<int, Beat> read_all(c10d::Store& store, int size) {
  std::map<int, Beat> beats;
  for (int r = 0; r < size; ++r) {
    if (!store.check({heartbeat_key(r)})) {
      continue;
    }
    auto bytes = store.get(heartbeat_key(r));
    std::istringstream in(std::string(bytes.begin(), bytes.end()));
    Beat b;
    char colon = 0;
    in >> b.issued >> colon >> b.count;
    beats[r] = b;
  }
  return beats;
}

}  // namespace

StoreMonitor::StoreMonitor(std::function<c10::intrusive_ptr<c10d::Store>()> make_client,
                           int rank,
                           int size)
    : make_client_(std::move(make_client)), rank_(rank), size_(size) {
  thread_ = std::thread([this] { run(); });
}

StoreMonitor::~StoreMonitor() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void StoreMonitor::run() {
  c10::intrusive_ptr<c10d::Store> store;
  int64_t count = 0;
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    lock.unlock();
    try {
      if (!store) {
        store = make_client_();
        store->setTimeout(std::chrono::seconds(5));
      }
      std::string value =
          std::to_string(issued_.load(std::memory_order_relaxed)) + ":" + std::to_string(count++);
      store->set(heartbeat_key(rank_), std::vector<uint8_t>(value.begin(), value.end()));
    } catch (const std::exception&) {
      // The store's host (rank 0) is gone or shutting down: nothing left to tell anyone.
      lock.lock();
      break;
    }
    lock.lock();
    cv_.wait_for(lock, kHeartbeatInterval, [this] { return stop_; });
  }
}

std::string StoreMonitor::explain(int64_t seq) {
  std::map<int, Beat> first;
  std::map<int, Beat> second;
  try {
    auto store = make_client_();
    store->setTimeout(std::chrono::seconds(3));
    first = read_all(*store, size_);
    std::this_thread::sleep_for(kHeartbeatInterval * 5 / 2);
    second = read_all(*store, size_);
  } catch (const std::exception&) {
    if (rank_ == 0) {
      return "";
    }
    return "; the job's store on rank 0 cannot be reached: rank 0 has probably exited";
  }
  std::ostringstream missing;
  int n = 0;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) {
      continue;
    }
    std::string why;
    auto a = first.find(r);
    auto b = second.find(r);
    if (b == second.end()) {
      why = "never joined the heartbeat";
    } else if (a != first.end() && a->second.count == b->second.count) {
      why = "stopped responding, its process has probably exited";
    } else if (b->second.issued <= seq) {
      why = "has not issued this collective; it has issued " + std::to_string(b->second.issued) +
            " so far";
    }
    if (!why.empty()) {
      missing << (n++ ? ", " : "") << "rank " << r << " (" << why << ")";
    }
  }
  if (n == 0) {
    return "";
  }
  return "; ranks that did not arrive: " + missing.str();
}

}  // namespace detail
}  // namespace dist
}  // namespace paratrain
