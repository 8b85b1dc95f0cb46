// The mpi backend: Open MPI called directly. Debian's libtorch is built without c10d's MPI backend,
// and on CPU MPI is the fast path (shared-memory transport between local ranks), and the one that
// mpirun and Slurm start on clusters.
//
// Threading: every MPI call of a group is made by that group's one worker thread, in issue order,
// so callers never block in MPI and the rank-wide order of collectives is the order they were
// issued (the contract in process_group.h). Several groups mean several threads inside MPI at
// once, so MPI is initialised with MPI_THREAD_MULTIPLE; a library that offers only
// MPI_THREAD_SERIALIZED gets one group at a time. The worker's state is shared with its thread, so
// a thread left stuck in MPI by a timed-out collective never touches a destroyed group.
// Collectives run as blocking calls on the worker: MPI's blocking collectives are its fastest
// (non-blocking ones only progress inside MPI_Test calls). Point-to-point operations are started
// non-blocking and polled between tasks, so a send waiting for its receiver never stops the worker
// from starting the matching recv of a ring exchange.
//
// Deadlines: MPI has no timeouts, so wait() enforces the group's timeout itself. A collective
// that times out stays stuck inside MPI: the group is marked broken, its thread is abandoned when
// the group is destroyed, and at exit MPI_Finalize is skipped (it would hang) so the process can
// end and mpirun can tear the job down. Sends and receives still pending when a group is destroyed
// are cancelled.

#include "backends.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
// The C API only: Open MPI's deprecated C++ bindings would need libmpi_cxx.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <limits>
#include <list>
#include <mutex>
#include <set>
#include <thread>

namespace paratrain {
namespace dist {
namespace detail {

namespace {

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return std::string(text, length);
}

// Reductions MPI has no type for: fp16 and bf16, summed in float.
template <typename T, typename Combine>
void reduce_in_float(void* in, void* inout, int* len, Combine combine) {
  auto* a = static_cast<const T*>(in);
  auto* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    b[i] = T(combine(static_cast<float>(a[i]), static_cast<float>(b[i])));
  }
}

template <typename T>
void sum_fn(void* in, void* inout, int* len, MPI_Datatype*) {
  reduce_in_float<T>(in, inout, len, [](float x, float y) { return x + y; });
}
template <typename T>
void max_fn(void* in, void* inout, int* len, MPI_Datatype*) {
  reduce_in_float<T>(in, inout, len, [](float x, float y) { return x > y ? x : y; });
}
template <typename T>
void min_fn(void* in, void* inout, int* len, MPI_Datatype*) {
  reduce_in_float<T>(in, inout, len, [](float x, float y) { return x < y ? x : y; });
}
template <typename T>
void prod_fn(void* in, void* inout, int* len, MPI_Datatype*) {
  reduce_in_float<T>(in, inout, len, [](float x, float y) { return x * y; });
}

struct MpiGlobals {
  MPI_Datatype half16 = MPI_DATATYPE_NULL;  // two bytes, reduced by the ops below
  MPI_Op half_sum, half_max, half_min, half_prod, bf16_sum, bf16_max, bf16_min, bf16_prod;
  int tag_upper_bound = 32767;  // MPI_TAG_UB: MPI promises at least this
};

struct MpiWorker;

// Workers of live groups, so that the exit handler can stop them before MPI_Finalize.
std::mutex g_registry_mutex;
std::set<std::shared_ptr<MpiWorker>> g_workers;  // guarded by g_registry_mutex
bool g_stuck = false;  // some worker never came back from MPI: MPI_Finalize would hang
int g_thread_level = MPI_THREAD_SINGLE;
MpiGlobals g_mpi;

void finalize_at_exit();

void ensure_mpi_initialized() {
  static std::once_flag once;
  std::call_once(once, [] {
    int initialized = 0;
    MPI_Initialized(&initialized);
    int provided = MPI_THREAD_SINGLE;
    if (!initialized) {
      int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      TORCH_CHECK(rc == MPI_SUCCESS, "mpi backend: MPI_Init_thread failed: ", mpi_error_string(rc));
      std::atexit(finalize_at_exit);
    } else {
      MPI_Query_thread(&provided);  // the program initialised MPI itself
    }
    TORCH_CHECK(provided >= MPI_THREAD_SERIALIZED,
                "mpi backend: this MPI library gives thread level ", provided,
                ", below MPI_THREAD_SERIALIZED; rebuild Open MPI with thread support");
    {
      std::lock_guard<std::mutex> lock(g_registry_mutex);
      g_thread_level = provided;
    }
    void* upper = nullptr;
    int found = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &upper, &found);
    if (found != 0 && upper != nullptr) {
      g_mpi.tag_upper_bound = *static_cast<int*>(upper);
    }
    MPI_Type_contiguous(2, MPI_BYTE, &g_mpi.half16);
    MPI_Type_commit(&g_mpi.half16);
    MPI_Op_create(&sum_fn<c10::Half>, 1, &g_mpi.half_sum);
    MPI_Op_create(&max_fn<c10::Half>, 1, &g_mpi.half_max);
    MPI_Op_create(&min_fn<c10::Half>, 1, &g_mpi.half_min);
    MPI_Op_create(&prod_fn<c10::Half>, 1, &g_mpi.half_prod);
    MPI_Op_create(&sum_fn<c10::BFloat16>, 1, &g_mpi.bf16_sum);
    MPI_Op_create(&max_fn<c10::BFloat16>, 1, &g_mpi.bf16_max);
    MPI_Op_create(&min_fn<c10::BFloat16>, 1, &g_mpi.bf16_min);
    MPI_Op_create(&prod_fn<c10::BFloat16>, 1, &g_mpi.bf16_prod);
  });
}

MPI_Datatype mpi_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return MPI_FLOAT;
    case at::kDouble:
      return MPI_DOUBLE;
    case at::kInt:
      return MPI_INT32_T;
    case at::kLong:
      return MPI_INT64_T;
    case at::kShort:
      return MPI_INT16_T;
    case at::kChar:
      return MPI_INT8_T;
    case at::kByte:
    case at::kBool:
      return MPI_UINT8_T;
    case at::kHalf:
    case at::kBFloat16:
      return g_mpi.half16;
    default:
      TORCH_CHECK(false, "mpi backend: tensors of type ", t,
                  " are not supported; use float, double, half, bfloat16 or an integer type");
  }
}

MPI_Op mpi_op(ReduceOp op, at::ScalarType t) {
  if (t == at::kHalf || t == at::kBFloat16) {
    bool half = t == at::kHalf;
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        return half ? g_mpi.half_sum : g_mpi.bf16_sum;
      case ReduceOp::kMax:
        return half ? g_mpi.half_max : g_mpi.bf16_max;
      case ReduceOp::kMin:
        return half ? g_mpi.half_min : g_mpi.bf16_min;
      case ReduceOp::kProduct:
        return half ? g_mpi.half_prod : g_mpi.bf16_prod;
      case ReduceOp::kBand:
      case ReduceOp::kBor:
      case ReduceOp::kBxor:
        break;  // integer tensors only, checked before
    }
  }
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:  // MPI has no average: sum, then divide on the worker.
      return MPI_SUM;
    case ReduceOp::kMax:
      return t == at::kBool ? MPI_BOR : MPI_MAX;
    case ReduceOp::kMin:
      return t == at::kBool ? MPI_BAND : MPI_MIN;
    case ReduceOp::kProduct:
      return t == at::kBool ? MPI_BAND : MPI_PROD;
    case ReduceOp::kBand:
      return MPI_BAND;
    case ReduceOp::kBor:
      return MPI_BOR;
    case ReduceOp::kBxor:
      return MPI_BXOR;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown ReduceOp");
}

// Allreduce chunk size. Measured here with `paratrain bench allreduce --backends mpi` (2 ranks,
// Open MPI 4.1's shared-memory transport), median time of a 64 MiB allreduce: 37.2 ms in one call,
// 10.6 ms in 8 MiB chunks, 9.9 ms in 4 MiB chunks, 8.7 ms in 1 MiB chunks (16 MiB: 2.3, 2.0, 2.2,
// 2.0 ms). In one call the reduction streams from memory; in chunks it stays in cache.
// PARATRAIN_MPI_CHUNK_BYTES overrides it (0: no chunking).
int64_t chunk_bytes() {
  static const int64_t bytes = [] {
    const char* text = std::getenv("PARATRAIN_MPI_CHUNK_BYTES");
    if (text != nullptr && text[0] != '\0') {
      int64_t v = std::atoll(text);
      return v > 0 ? v : std::numeric_limits<int64_t>::max();
    }
    return int64_t(1) << 20;
  }();
  return bytes;
}

// Whether the tensors already lie one after another in one storage, as the rows of
// reduce_scatter_tensor's input do: then that memory is the flat buffer, and no copy is needed.
bool adjacent(const std::vector<at::Tensor>& tensors) {
  if (tensors.empty()) {
    return false;
  }
  const at::Tensor& first = tensors.front();
  const char* next = static_cast<const char*>(first.data_ptr());
  for (const auto& t : tensors) {
    if (!t.is_contiguous() || t.is_conj() || t.is_neg() || t.scalar_type() != first.scalar_type() ||
        !t.storage().is_alias_of(first.storage()) || t.data_ptr() != next) {
      return false;
    }
    next += t.nbytes();
  }
  return true;
}

// The tensors one after another, flattened (at::cat refuses 0-dim tensors): a task that threw on
// one rank only would leave the others in the collective. A copy unless they are adjacent and
// apart from `receiver`, the collective's receive buffer: MPI forbids the two to overlap.
at::Tensor flat_cat(const std::vector<at::Tensor>& tensors, const at::Tensor& receiver) {
  if (adjacent(tensors) && !receiver.storage().is_alias_of(tensors.front().storage())) {
    int64_t total = 0;
    for (const auto& t : tensors) {
      total += t.numel();
    }
    return tensors.front().as_strided({total}, {1});
  }
  std::vector<at::Tensor> flat;
  for (const auto& t : tensors) {
    flat.push_back(t.reshape({-1}));
  }
  return at::cat(flat);
}

void check_cpu(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.device().is_cpu(), "mpi backend: ", op, " got a tensor on ", t.device(),
              "; this backend moves CPU tensors (use the nccl backend for CUDA tensors)");
}

// Shared between a Work handle and the worker thread.
struct Task {
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;   // guarded by mutex
  std::string error;   // guarded by mutex; empty on success
  std::string op;      // "allreduce"
  std::string detail;  // "sum, 4096 bytes"
  int64_t seq = 0;
  bool collective = true;
  // Runs on the worker. Collectives complete inside `start`; point-to-point ones return a
  // request to poll.
  std::function<MPI_Request()> start;

  void finish(std::string err) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      done = true;
      error = std::move(err);
    }
    cv.notify_all();
  }
};

// A group's queue and its thread's state. Shared by the group and the thread (see the top).
struct MpiWorker {
  std::mutex mutex;
  std::condition_variable cv;
  std::deque<std::shared_ptr<Task>> queue;  // guarded by mutex
  bool stopping = false;                    // guarded by mutex
  bool exited = false;                      // guarded by mutex

  static void run(std::shared_ptr<MpiWorker> self) {
    // Requests of started sends and receives, polled while no new task is queued.
    std::list<std::pair<MPI_Request, std::shared_ptr<Task>>> pending;
    for (;;) {
      std::shared_ptr<Task> task;
      bool stopping = false;
      {
        std::unique_lock<std::mutex> lock(self->mutex);
        if (pending.empty()) {
          self->cv.wait(lock, [&] { return self->stopping || !self->queue.empty(); });
        }
        if (!self->queue.empty()) {
          task = self->queue.front();
          self->queue.pop_front();
        }
        stopping = self->stopping;
      }
      if (task) {
        try {
          MPI_Request request = task->start();
          if (request == MPI_REQUEST_NULL) {
            task->finish("");
          } else {
            pending.emplace_back(request, task);
          }
        } catch (const std::exception& e) {
          task->finish(e.what());
        }
        continue;
      }
      if (stopping) {
        // The group is gone: nobody will wait for what is still pending.
        for (auto& p : pending) {
          MPI_Cancel(&p.first);
          MPI_Request_free(&p.first);
          p.second->finish("cancelled: the process group was destroyed");
        }
        std::lock_guard<std::mutex> lock(self->mutex);
        self->exited = true;
        self->cv.notify_all();
        return;
      }
      bool progressed = false;
      for (auto it = pending.begin(); it != pending.end();) {
        int flag = 0;
        int rc = MPI_Test(&it->first, &flag, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS || flag) {
          it->second->finish(rc == MPI_SUCCESS ? "" : mpi_error_string(rc));
          it = pending.erase(it);
          progressed = true;
        } else {
          ++it;
        }
      }
      if (!progressed) {
        // Keep the latency of a waiting recv low without spinning a whole core.
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    }
  }

  // Asks the thread to finish its queue and waits up to `deadline` for it; false when it is
  // stuck in MPI (then it is abandoned, and MPI_Finalize skipped).
  bool stop(std::chrono::milliseconds deadline) {
    std::unique_lock<std::mutex> lock(mutex);
    stopping = true;
    cv.notify_all();
    return cv.wait_for(lock, deadline, [this] { return exited; });
  }
};

class MpiGroup;

class MpiWork : public Work {
 public:
  MpiWork(std::shared_ptr<MpiGroup> group, std::shared_ptr<Task> task)
      : group_(std::move(group)), task_(std::move(task)) {}
  void wait() override;
  bool is_completed() override {
    std::lock_guard<std::mutex> lock(task_->mutex);
    return task_->done;
  }

 private:
  std::shared_ptr<MpiGroup> group_;
  std::shared_ptr<Task> task_;
};

// MPI counts are ints: larger messages would be refused or, past 4 GiB, silently cut.
int mpi_count(int64_t n, const char* op) {
  TORCH_CHECK(n <= std::numeric_limits<int>::max(), "mpi backend: ", op, " of ", n,
              " elements is larger than one MPI message can carry (2^31 - 1); split the tensor");
  return static_cast<int>(n);
}

class MpiGroup : public ProcessGroup, public std::enable_shared_from_this<MpiGroup> {
 public:
  MpiGroup(MPI_Comm comm, int rank, int size, std::chrono::milliseconds timeout)
      : ProcessGroup(rank, size, timeout), comm_(comm), worker_(std::make_shared<MpiWorker>()) {
    std::thread(&MpiWorker::run, worker_).detach();  // ends by itself; see MpiWorker::stop
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    g_workers.insert(worker_);
  }

  ~MpiGroup() override {
    bool stopped = worker_->stop(timeout());
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    g_workers.erase(worker_);
    if (!stopped) {
      g_stuck = true;
    } else {
      MPI_Comm_free(&comm_);
    }
  }

  std::string backend_name() const override { return "mpi"; }

  // MPI_TAG_UB may be below kMaxUserTag; the largest tag is monitored_barrier's.
  int user_tag_limit() const override { return reserved_tag(); }

  std::string fail(const Task& task, const std::string& why, bool timed_out) {
    std::string message = describe(task.op, task.seq, task.detail) + " failed: " + why;
    if (timed_out && task.collective) {
      message +=
          "; MPI cannot tell which ranks did not arrive: look for the rank that failed or is "
          "behind in the other ranks' output";
    }
    mark_broken(message);
    return message;
  }

 protected:
  WorkPtr do_allreduce(at::Tensor& tensor, ReduceOp op, int64_t seq) override {
    check_cpu(tensor, "allreduce");
    MPI_Datatype type = mpi_type(tensor.scalar_type());
    MPI_Op mop = mpi_op(op, tensor.scalar_type());
    return submit(
        "allreduce", std::string(to_string(op)) + ", " + std::to_string(tensor.nbytes()) + " bytes",
        seq, true, [comm = comm_, n = size(), tensor, type, mop, op]() mutable {
          // Large tensors go in chunks that stay in cache while Open MPI reduces them (see
          // chunk_bytes()); every rank splits the same way, so the calls match.
          const int64_t per_chunk =
              std::min<int64_t>(std::max<int64_t>(1, chunk_bytes() / tensor.element_size()),
                                std::numeric_limits<int>::max());
          auto* base = static_cast<char*>(tensor.data_ptr());
          for (int64_t start = 0; start < tensor.numel(); start += per_chunk) {
            const int64_t count = std::min(per_chunk, tensor.numel() - start);
            check(MPI_Allreduce(MPI_IN_PLACE, base + start * tensor.element_size(),
                                static_cast<int>(count), type, mop, comm));
          }
          if (op == ReduceOp::kAvg) {
            tensor.div_(n);
          }
          return MPI_REQUEST_NULL;
        });
  }

  WorkPtr do_broadcast(at::Tensor& tensor, int root, int64_t seq) override {
    check_cpu(tensor, "broadcast");
    const int count = mpi_count(tensor.nbytes(), "broadcast");
    return submit("broadcast", "root " + std::to_string(root), seq, true,
                  [comm = comm_, tensor, root, count]() mutable {
                    check(MPI_Bcast(tensor.data_ptr(), count, MPI_BYTE, root, comm));
                    return MPI_REQUEST_NULL;
                  });
  }

  WorkPtr do_allgather(std::vector<at::Tensor>& outputs,
                       const at::Tensor& input,
                       int64_t seq) override {
    check_cpu(input, "allgather");
    for (auto& o : outputs) {
      check_cpu(o, "allgather");
    }
    const int count = mpi_count(input.nbytes(), "allgather");
    mpi_count(input.nbytes() * size(), "allgather");
    return submit("allgather", "", seq, true,
                  [comm = comm_, n = size(), outputs, input, count]() mutable {
                    at::Tensor flat = at::empty({n * input.numel()}, input.options());
                    check(MPI_Allgather(input.data_ptr(), count, MPI_BYTE, flat.data_ptr(), count,
                                        MPI_BYTE, comm));
                    auto parts = flat.chunk(n);
                    for (int r = 0; r < n; ++r) {
                      outputs[r].copy_(parts[r].view(input.sizes()));
                    }
                    return MPI_REQUEST_NULL;
                  });
  }

  WorkPtr do_reduce_scatter(at::Tensor& output,
                            const std::vector<at::Tensor>& inputs,
                            ReduceOp op,
                            int64_t seq) override {
    check_cpu(output, "reduce_scatter");
    for (auto& i : inputs) {
      check_cpu(i, "reduce_scatter");
    }
    MPI_Datatype type = mpi_type(output.scalar_type());
    MPI_Op mop = mpi_op(op, output.scalar_type());
    const int count = mpi_count(output.numel(), "reduce_scatter");
    return submit("reduce_scatter", to_string(op), seq, true,
                  [comm = comm_, n = size(), output, inputs, type, mop, op, count]() mutable {
                    at::Tensor flat = flat_cat(inputs, output);
                    check(MPI_Reduce_scatter_block(flat.data_ptr(), output.data_ptr(), count, type,
                                                   mop, comm));
                    if (op == ReduceOp::kAvg) {
                      output.div_(n);
                    }
                    return MPI_REQUEST_NULL;
                  });
  }

  WorkPtr do_reduce(at::Tensor& tensor, int dst, ReduceOp op, int64_t seq) override {
    check_cpu(tensor, "reduce");
    MPI_Datatype type = mpi_type(tensor.scalar_type());
    MPI_Op mop = mpi_op(op, tensor.scalar_type());
    const int count = mpi_count(tensor.numel(), "reduce");
    return submit(
        "reduce", std::string(to_string(op)) + ", dst " + std::to_string(dst), seq, true,
        [comm = comm_, me = rank(), n = size(), tensor, dst, type, mop, op, count]() mutable {
          // The others' tensors stay as they were: MPI reads them only.
          if (me == dst) {
            check(MPI_Reduce(MPI_IN_PLACE, tensor.data_ptr(), count, type, mop, dst, comm));
            if (op == ReduceOp::kAvg) {
              tensor.div_(n);
            }
          } else {
            check(MPI_Reduce(tensor.data_ptr(), nullptr, count, type, mop, dst, comm));
          }
          return MPI_REQUEST_NULL;
        });
  }

  WorkPtr do_gather(std::vector<at::Tensor>& outputs,
                    const at::Tensor& input,
                    int dst,
                    int64_t seq) override {
    check_cpu(input, "gather");
    for (auto& o : outputs) {
      check_cpu(o, "gather");
    }
    const int count = mpi_count(input.nbytes(), "gather");
    mpi_count(input.nbytes() * size(), "gather");
    return submit(
        "gather", "dst " + std::to_string(dst), seq, true,
        [comm = comm_, me = rank(), n = size(), outputs, input, dst, count]() mutable {
          at::Tensor flat =
              me == dst ? at::empty({n * input.numel()}, input.options()) : at::Tensor();
          check(MPI_Gather(input.data_ptr(), count, MPI_BYTE, me == dst ? flat.data_ptr() : nullptr,
                           count, MPI_BYTE, dst, comm));
          if (me == dst) {
            auto parts = flat.chunk(n);
            for (int r = 0; r < n; ++r) {
              outputs[r].copy_(parts[r].view(input.sizes()));
            }
          }
          return MPI_REQUEST_NULL;
        });
  }

  WorkPtr do_scatter(at::Tensor& output,
                     const std::vector<at::Tensor>& inputs,
                     int src,
                     int64_t seq) override {
    check_cpu(output, "scatter");
    for (auto& i : inputs) {
      check_cpu(i, "scatter");
    }
    const int count = mpi_count(output.nbytes(), "scatter");
    mpi_count(output.nbytes() * size(), "scatter");
    return submit("scatter", "src " + std::to_string(src), seq, true,
                  [comm = comm_, me = rank(), output, inputs, src, count]() mutable {
                    at::Tensor flat = me == src ? flat_cat(inputs, output) : at::Tensor();
                    check(MPI_Scatter(me == src ? flat.data_ptr() : nullptr, count, MPI_BYTE,
                                      output.data_ptr(), count, MPI_BYTE, src, comm));
                    return MPI_REQUEST_NULL;
                  });
  }

  WorkPtr do_all_to_all_single(at::Tensor& output,
                               const at::Tensor& input,
                               const std::vector<int64_t>& output_split_sizes,
                               const std::vector<int64_t>& input_split_sizes,
                               int64_t seq) override {
    check_cpu(input, "all_to_all_single");
    check_cpu(output, "all_to_all_single");
    // Rows to byte counts and offsets, which MPI takes as ints.
    auto layout = [](const at::Tensor& t, const std::vector<int64_t>& rows, const char* what) {
      const int64_t row_bytes =
          t.dim() == 0 ? t.element_size() : t.nbytes() / std::max<int64_t>(1, t.size(0));
      std::vector<int> counts, offsets;
      int64_t at = 0;
      for (int64_t r : rows) {
        counts.push_back(mpi_count(r * row_bytes, what));
        offsets.push_back(mpi_count(at, what));
        at += r * row_bytes;
      }
      return std::make_pair(counts, offsets);
    };
    auto out = layout(output, output_split_sizes, "all_to_all_single");
    auto in = layout(input, input_split_sizes, "all_to_all_single");
    return submit("all_to_all_single", std::to_string(input.nbytes()) + " bytes out", seq, true,
                  [comm = comm_, output, input, out, in]() mutable {
                    check(MPI_Alltoallv(input.data_ptr(), in.first.data(), in.second.data(),
                                        MPI_BYTE, output.data_ptr(), out.first.data(),
                                        out.second.data(), MPI_BYTE, comm));
                    return MPI_REQUEST_NULL;
                  });
  }

  // By messages to and from rank 0, as torch.distributed's over Gloo: each rank tells rank 0 it
  // arrived, and rank 0 answers every rank with the list of those that did not (one flag per
  // rank). Receives from missing ranks stay posted until the group is destroyed, which
  // cancels them; the group is broken by then.
  // Whether `w` completed by `deadline` (polled: MPI has no wait with a deadline); rethrows its
  // own failure.
  static bool done_by(const WorkPtr& w, std::chrono::steady_clock::time_point deadline) {
    while (!w->is_completed() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (!w->is_completed()) {
      return false;
    }
    w->wait();
    return true;
  }

  // "rank 2 did not reach it within 1500 ms", from one flag per rank.
  static std::string missing_ranks(const at::Tensor& missing, std::chrono::milliseconds timeout) {
    std::string ranks;
    int count = 0;
    for (int64_t r = 0; r < missing.numel(); ++r) {
      if (missing[r].item<int>() != 0) {
        ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
        ++count;
      }
    }
    return (count == 1 ? "rank " : "ranks ") + ranks + " did not reach it within " +
           std::to_string(timeout.count()) + " ms";
  }

  void do_monitored_barrier(std::chrono::milliseconds timeout,
                            bool wait_all_ranks,
                            int64_t seq) override {
    const int tag = reserved_tag();
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = start + (rank() == 0 ? timeout : answer_time(timeout));
    const std::string what = describe("monitored_barrier", seq);
    auto done_by_deadline = [&](const WorkPtr& w) { return done_by(w, deadline); };
    auto fail = [&](const std::string& why) {
      mark_broken(what + " failed: " + why);
      throw CollectiveError(what + " failed: " + why);
    };
    at::Tensor missing = at::zeros({size()}, at::kInt);
    auto name_missing = [&] { return missing_ranks(missing, timeout); };
    if (rank() != 0) {
      at::Tensor here = at::ones({1}, at::kInt);
      auto sent = start_send(here, 0, tag, seq);
      auto verdict = start_recv(missing, 0, tag, seq);
      if (!done_by_deadline(verdict)) {
        fail("rank 0 did not let it pass within " + std::to_string(answer_time(timeout).count()) +
             " ms");
      }
      sent->wait();
      if (missing.any().item<bool>()) {
        fail(name_missing());
      }
      return;
    }
    std::vector<at::Tensor> arrivals;
    std::vector<WorkPtr> receives;
    for (int r = 1; r < size(); ++r) {
      arrivals.push_back(at::zeros({1}, at::kInt));
      receives.push_back(start_recv(arrivals.back(), r, tag, seq));
    }
    // Past the first missing rank (without wait_all_ranks), the others are not waited for.
    std::vector<bool> arrived(static_cast<size_t>(size()), false);
    bool failed = false;
    for (int r = 1; r < size(); ++r) {
      WorkPtr& w = receives[static_cast<size_t>(r - 1)];
      if (failed && !wait_all_ranks) {
        arrived[static_cast<size_t>(r)] = w->is_completed();
      } else if (done_by_deadline(w)) {
        arrived[static_cast<size_t>(r)] = true;
      } else {
        missing[r] = 1;
        failed = true;
      }
    }
    // Every rank gets the verdict, a late one as it comes; only those here are waited for (a
    // send to a rank that never comes is cancelled with the group).
    std::vector<WorkPtr> answers;
    for (int r = 1; r < size(); ++r) {
      WorkPtr sent = start_send(missing, r, tag, seq);
      if (arrived[static_cast<size_t>(r)]) {
        answers.push_back(sent);
      }
    }
    for (auto& a : answers) {
      a->wait();
    }
    if (missing.any().item<bool>()) {
      fail(name_missing());
    }
  }

  WorkPtr do_barrier(int64_t seq) override {
    return submit("barrier", "", seq, true, [comm = comm_]() {
      check(MPI_Barrier(comm));
      return MPI_REQUEST_NULL;
    });
  }

  WorkPtr do_send(const at::Tensor& tensor, int dst, int tag, int64_t seq) override {
    return start_send(tensor, dst, tag, seq);  // the tag is below user_tag_limit()
  }

  WorkPtr start_send(const at::Tensor& tensor, int dst, int tag, int64_t seq) {
    check_cpu(tensor, "send");
    const int count = mpi_count(tensor.nbytes(), "send");
    return submit("send", "to rank " + std::to_string(dst) + ", tag " + std::to_string(tag), seq,
                  false, [comm = comm_, tensor, dst, tag, count]() {
                    MPI_Request request;
                    check(MPI_Isend(tensor.data_ptr(), count, MPI_BYTE, dst, tag, comm, &request));
                    return request;
                  });
  }

  WorkPtr do_recv(at::Tensor& tensor, int src, int tag, int64_t seq) override {
    return start_recv(tensor, src, tag, seq);  // the tag is below user_tag_limit()
  }

  WorkPtr start_recv(at::Tensor& tensor, int src, int tag, int64_t seq) {
    check_cpu(tensor, "recv");
    const int count = mpi_count(tensor.nbytes(), "recv");
    return submit("recv", "from rank " + std::to_string(src) + ", tag " + std::to_string(tag), seq,
                  false, [comm = comm_, tensor, src, tag, count]() mutable {
                    MPI_Request request;
                    check(MPI_Irecv(tensor.data_ptr(), count, MPI_BYTE, src, tag, comm, &request));
                    return request;
                  });
  }

  // MPI_Comm_split over this group's communicator, as a task of this group's worker: it is a
  // collective on the communicator, so it takes its place in the issue order like the others.
  // The subgroup gets a worker thread of its own, hence several threads inside MPI at once:
  // this needs MPI_THREAD_MULTIPLE.
  ProcessGroupPtr do_new_group(const std::vector<int>& ranks,
                               int index,
                               int64_t group_id) override {
    (void)group_id;  // MPI matches collectives on a communicator by their order
    {
      std::lock_guard<std::mutex> lock(g_registry_mutex);
      TORCH_CHECK(g_thread_level >= MPI_THREAD_MULTIPLE,
                  "mpi new_group: this MPI library gives thread level ", g_thread_level,
                  ", not MPI_THREAD_MULTIPLE, which subgroups need (each has its own thread)");
    }
    auto sub = std::make_shared<MPI_Comm>(MPI_COMM_NULL);
    const int color = index >= 0 ? 0 : MPI_UNDEFINED;
    submit("new_group", std::to_string(ranks.size()) + " ranks", sequence_number(), true,
           [comm = comm_, color, index, sub]() {
             int rc = MPI_Comm_split(comm, color, index, sub.get());
             if (rc != MPI_SUCCESS) {
               throw std::runtime_error("MPI_Comm_split failed: " + mpi_error_string(rc));
             }
             return MPI_REQUEST_NULL;
           })
        ->wait();
    if (*sub == MPI_COMM_NULL) {
      return nullptr;
    }
    MPI_Comm_set_errhandler(*sub, MPI_ERRORS_RETURN);
    return std::make_shared<MpiGroup>(*sub, index, static_cast<int>(ranks.size()), timeout());
  }

 private:
  // A tag above users' (ProcessGroup::kMaxUserTag) where MPI has one; MPI promises tags up to
  // 32767 only (MPI_TAG_UB), and then the largest, which users' sends are refused.
  static int reserved_tag() { return std::min(g_mpi.tag_upper_bound, kMaxUserTag); }

  static void check(int rc) {
    if (rc != MPI_SUCCESS) {
      throw std::runtime_error(mpi_error_string(rc));
    }
  }

  WorkPtr submit(std::string op,
                 std::string detail,
                 int64_t seq,
                 bool collective,
                 std::function<MPI_Request()> fn) {
    auto task = std::make_shared<Task>();
    task->op = std::move(op);
    task->detail = std::move(detail);
    task->seq = seq;
    task->collective = collective;
    task->start = std::move(fn);
    {
      std::lock_guard<std::mutex> lock(worker_->mutex);
      worker_->queue.push_back(task);
    }
    worker_->cv.notify_all();
    return std::make_shared<MpiWork>(shared_from_this(), task);
  }

  MPI_Comm comm_;
  std::shared_ptr<MpiWorker> worker_;
};

void MpiWork::wait() {
  std::unique_lock<std::mutex> lock(task_->mutex);
  bool finished = task_->cv.wait_for(lock, group_->timeout(), [this] { return task_->done; });
  if (!finished) {
    lock.unlock();
    throw CollectiveError(group_->fail(
        *task_, "timed out after " + std::to_string(group_->timeout().count()) + " ms", true));
  }
  if (!task_->error.empty()) {
    std::string error = task_->error;
    lock.unlock();
    throw CollectiveError(group_->fail(*task_, error, false));
  }
}

void finalize_at_exit() {
  std::set<std::shared_ptr<MpiWorker>> workers;
  {
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    workers = g_workers;
  }
  bool stuck = false;
  for (const auto& w : workers) {
    // Groups still alive at exit (held by a static, say): a short grace for their queues.
    stuck = !w->stop(std::chrono::seconds(10)) || stuck;
  }
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!g_stuck && !stuck && !finalized) {
    MPI_Finalize();
  }
}

}  // namespace

ProcessGroupPtr make_mpi_group(std::chrono::milliseconds timeout) {
  ensure_mpi_initialized();
  {
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    TORCH_CHECK(g_thread_level >= MPI_THREAD_MULTIPLE || g_workers.empty(),
                "mpi backend: this MPI library gives thread level ", g_thread_level,
                ", not MPI_THREAD_MULTIPLE, so only one mpi process group can exist at a time");
  }
  MPI_Comm comm;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  int rank = 0;
  int size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  return std::make_shared<MpiGroup>(comm, rank, size, timeout);
}

}  // namespace detail
}  // namespace dist
}  // namespace paratrain
