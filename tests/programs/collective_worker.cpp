// A test worker: joins the job through init_process_group and, by mode, checks every collective
// against results computed locally, or misbehaves in one precise way so tests can see the error
// another rank reports.
//
//   collective_worker collectives     every collective, sync and async, checked (exit 0 if right)
//   collective_worker init            join and pass one barrier (init method from
//                                     PARATRAIN_INIT_METHOD when set)
//   collective_worker die RANK        RANK exits 0 before the first allreduce; the others try it
//   collective_worker late RANK SECS  RANK sleeps SECS before the first allreduce
//
// Errors are printed as "error: <one line>" and end the process with code 1.

#include <paratrain/paratrain.h>

#include <torch/torch.h>

#include <chrono>
#include <iostream>
#include <sstream>
#include <thread>

// In the test programs' one binary (main.cpp): run() is this program's main.
namespace paratrain_test_programs {
namespace collective_worker {

namespace dist = paratrain::dist;

namespace {

int g_failures = 0;

void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  // bf16 keeps 8 bits of mantissa, and a reduction may round once per rank: compare within a few
  // units in the last place. Everything else must match to float precision.
  const bool bf16 = got.scalar_type() == torch::kBFloat16;
  const double rtol = bf16 ? 2e-2 : 1e-5;
  const double atol = bf16 ? 1e-1 : 1e-6;
  if (got.sizes() != want.sizes() ||
      !torch::allclose(got.to(torch::kDouble), want.to(torch::kDouble), rtol, atol)) {
    std::ostringstream s;
    s << "MISMATCH " << what << ": got " << got.flatten().slice(0, 0, 6) << " want "
      << want.flatten().slice(0, 0, 6);
    std::cout << s.str() << std::endl;
    ++g_failures;
  }
}

// Rank r's contribution: deterministic, different per rank and element.
at::Tensor contribution(int rank, int64_t n, at::ScalarType type) {
  auto base = torch::arange(n, torch::kDouble) * 0.5 + rank * 3 - 1;
  if (at::isIntegralType(type, /*includeBool=*/false)) {
    base = torch::arange(n, torch::kDouble) + rank * 7;
  }
  return base.to(type);
}

void check_collectives(dist::ProcessGroup& pg) {
  const int n = pg.size();
  const int me = pg.rank();
  for (auto type : {torch::kFloat, torch::kDouble, torch::kInt, torch::kLong, torch::kBFloat16}) {
    for (int64_t numel : {int64_t(1), int64_t(1000), int64_t(300000)}) {
      std::string tag = std::string(c10::toString(type)) + "[" + std::to_string(numel) + "]";
      std::vector<at::Tensor> all;
      for (int r = 0; r < n; ++r) {
        all.push_back(contribution(r, numel, type).to(torch::kDouble));
      }
      auto stacked = torch::stack(all);
      for (auto op : {dist::ReduceOp::kSum, dist::ReduceOp::kAvg, dist::ReduceOp::kMax,
                      dist::ReduceOp::kMin}) {
        if (op == dist::ReduceOp::kAvg && !at::isFloatingType(type)) {
          continue;
        }
        at::Tensor want;
        switch (op) {
          case dist::ReduceOp::kSum:
            want = stacked.sum(0);
            break;
          case dist::ReduceOp::kAvg:
            want = stacked.mean(0);
            break;
          case dist::ReduceOp::kMax:
            want = std::get<0>(stacked.max(0));
            break;
          case dist::ReduceOp::kMin:
            want = std::get<0>(stacked.min(0));
            break;
        }
        at::Tensor t = contribution(me, numel, type);
        pg.allreduce(t, op)->wait();
        expect_close(t, want.to(type), std::string("allreduce ") + dist::to_string(op) + " " + tag);
      }

      for (int root = 0; root < n; ++root) {
        at::Tensor t = contribution(me, numel, type);
        pg.broadcast(t, root)->wait();
        expect_close(t, contribution(root, numel, type),
                     "broadcast root " + std::to_string(root) + " " + tag);
      }
      std::vector<at::Tensor> outs;
      for (int r = 0; r < n; ++r) {
        outs.push_back(torch::zeros({numel}, type));
      }
      pg.allgather(outs, contribution(me, numel, type))->wait();
      for (int r = 0; r < n; ++r) {
        expect_close(outs[r], contribution(r, numel, type),
                     "allgather slot " + std::to_string(r) + " " + tag);
      }
      // reduce_scatter: rank r's inputs[j] = contribution(r)*(j+1); output j = sum_r of that.
      std::vector<at::Tensor> inputs;
      for (int j = 0; j < n; ++j) {
        inputs.push_back(contribution(me, numel, type) * (j + 1));
      }
      at::Tensor out = torch::zeros({numel}, type);
      pg.reduce_scatter(out, inputs, dist::ReduceOp::kSum)->wait();
      expect_close(out, (stacked.sum(0) * (me + 1)).to(type), "reduce_scatter sum " + tag);
      if (at::isFloatingType(type)) {
        pg.reduce_scatter(out, inputs, dist::ReduceOp::kAvg)->wait();
        expect_close(out, (stacked.mean(0) * (me + 1)).to(type), "reduce_scatter avg " + tag);
        pg.reduce_scatter(out, inputs, dist::ReduceOp::kMax)->wait();
        expect_close(out, (std::get<0>(stacked.max(0)) * (me + 1)).to(type),
                     "reduce_scatter max " + tag);
        pg.reduce_scatter(out, inputs, dist::ReduceOp::kMin)->wait();
        expect_close(out, (std::get<0>(stacked.min(0)) * (me + 1)).to(type),
                     "reduce_scatter min " + tag);
      }
      // In place, as FSDP-style callers use them: the output is this rank's own input, the
      // allgather's input this rank's own output slot.
      at::Tensor flat = torch::cat(inputs);
      std::vector<at::Tensor> pieces = flat.chunk(n);
      pg.reduce_scatter(pieces[me], pieces, dist::ReduceOp::kSum)->wait();
      expect_close(pieces[me], (stacked.sum(0) * (me + 1)).to(type),
                   "in-place reduce_scatter " + tag);
      at::Tensor gathered = torch::zeros({n * numel}, type);
      std::vector<at::Tensor> slots = gathered.chunk(n);
      slots[me].copy_(contribution(me, numel, type));
      pg.allgather(slots, slots[me])->wait();
      for (int r = 0; r < n; ++r) {
        expect_close(slots[r], contribution(r, numel, type),
                     "in-place allgather slot " + std::to_string(r) + " " + tag);
      }
    }
  }
  pg.barrier()->wait();

  // Async: issue several operations, then wait in reverse order.
  std::vector<at::Tensor> ts;
  std::vector<dist::WorkPtr> works;
  for (int k = 0; k < 8; ++k) {
    ts.push_back(torch::full({4096}, static_cast<float>(me + k)));
    works.push_back(pg.allreduce(ts.back()));
  }
  for (int k = 7; k >= 0; --k) {
    works[k]->wait();
    if (!works[k]->is_completed()) {
      std::cout << "MISMATCH async work " << k << " not completed after wait" << std::endl;
      ++g_failures;
    }
    float want = n * k + n * (n - 1) / 2.0f;
    expect_close(ts[k], torch::full({4096}, want), "async allreduce " + std::to_string(k));
  }

  // Gathers and reduce-scatters in flight together (as FSDP overlaps a unit's gather with the
  // previous unit's reduction), waited in reverse order.
  {
    std::vector<std::vector<at::Tensor>> gathered(4), inputs(4);
    std::vector<at::Tensor> reduced(4);
    std::vector<dist::WorkPtr> pending;
    for (int k = 0; k < 4; ++k) {
      for (int r = 0; r < n; ++r) {
        gathered[k].push_back(torch::zeros({50000}));
        inputs[k].push_back(torch::full({50000}, static_cast<float>(me * 10 + r + k)));
      }
      reduced[k] = torch::zeros({50000});
      pending.push_back(
          pg.allgather(gathered[k], torch::full({50000}, static_cast<float>(me + k))));
      pending.push_back(pg.reduce_scatter(reduced[k], inputs[k], dist::ReduceOp::kSum));
    }
    for (auto it = pending.rbegin(); it != pending.rend(); ++it) {
      (*it)->wait();
    }
    for (int k = 0; k < 4; ++k) {
      for (int r = 0; r < n; ++r) {
        expect_close(gathered[k][r], torch::full({50000}, static_cast<float>(r + k)),
                     "overlapped allgather " + std::to_string(k));
      }
      const float want = 10.0f * n * (n - 1) / 2 + n * (me + k);
      expect_close(reduced[k], torch::full({50000}, want),
                   "overlapped reduce_scatter " + std::to_string(k));
    }
  }

  // Polling: once is_completed() says true, the result is final without calling wait().
  {
    at::Tensor t = torch::full({1000}, static_cast<float>(me));
    auto work = pg.allreduce(t, dist::ReduceOp::kAvg);
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!work->is_completed() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    expect_close(t, torch::full({1000}, (n - 1) / 2.0f), "polled avg allreduce");
    work->wait();
  }

  // Point to point: a ring, each rank sending to the next and receiving from the previous, with
  // both operations in flight at once (the order that deadlocks blocking sends of large tensors).
  if (n > 1) {
    for (int64_t numel : {int64_t(10), int64_t(1 << 20)}) {
      at::Tensor out = contribution(me, numel, torch::kFloat);
      at::Tensor in = torch::zeros({numel});
      int next = (me + 1) % n;
      int prev = (me + n - 1) % n;
      auto s = pg.send(out, next, 5);
      auto r = pg.recv(in, prev, 5);
      r->wait();
      s->wait();
      expect_close(in, contribution(prev, numel, torch::kFloat),
                   "ring recv " + std::to_string(numel));
    }
  }
}

}  // namespace

int run(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "collectives";
  try {
    dist::InitOptions options;
    if (const char* method = std::getenv("PARATRAIN_INIT_METHOD")) {
      options.init_method(method);
    }
    auto pg = dist::init_process_group(options);
    if (mode == "init") {
      pg->barrier()->wait();
      std::cout << "rank " << pg->rank() << " of " << pg->size() << " joined ("
                << pg->backend_name() << ")" << std::endl;
      return 0;
    }
    if (mode == "die" || mode == "late") {
      int who = argc > 2 ? std::atoi(argv[2]) : 1;
      if (pg->rank() == who) {
        if (mode == "die") {
          std::cout << "rank " << who << " leaving before the allreduce" << std::endl;
          return 0;
        }
        std::this_thread::sleep_for(std::chrono::seconds(argc > 3 ? std::atoi(argv[3]) : 30));
      }
      const std::string op = argc > 4 ? argv[4] : "allreduce";
      at::Tensor t = torch::ones({1 << 16});
      if (op == "reduce_scatter") {
        at::Tensor out = torch::zeros({1 << 16});
        pg->reduce_scatter(out, std::vector<at::Tensor>(pg->size(), t))->wait();
      } else if (op == "allgather") {
        std::vector<at::Tensor> outs(pg->size());
        for (auto& o : outs) {
          o = torch::zeros({1 << 16});
        }
        pg->allgather(outs, t)->wait();
      } else {
        pg->allreduce(t)->wait();
      }
      std::cout << "rank " << pg->rank() << " " << op << " done" << std::endl;
      return 0;
    }
    check_collectives(*pg);
    if (g_failures > 0) {
      std::cout << "rank " << pg->rank() << ": " << g_failures << " collective checks failed"
                << std::endl;
      return 1;
    }
    std::cout << "rank " << pg->rank() << " of " << pg->size() << " (" << pg->backend_name()
              << "): all collectives ok" << std::endl;
    return 0;
  } catch (const c10::Error& e) {
    std::cout << "error: " << e.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cout << "error: " << e.what() << std::endl;
    return 1;
  }
}

}  // namespace collective_worker
}  // namespace paratrain_test_programs
