// A test worker: joins the job through init_process_group and, by mode, checks every collective
// against results computed locally, or misbehaves in one precise way so tests can see the error
// another rank reports.
//
//   collective_worker collectives     every collective, sync and async, checked (exit 0 if right)
//   collective_worker init            join and pass one barrier (init method from
//                                     PARATRAIN_INIT_METHOD when set)
//   collective_worker die RANK        RANK exits 0 before the first allreduce; the others try it
//   collective_worker late RANK SECS  RANK sleeps SECS before the first allreduce
//   collective_worker reference DIR   every collective on the inputs of
//                                     tests/comm/collectives_reference.py, compared with the
//                                     results PyTorch saved to DIR/rank-R.pt; bad input first
//   collective_worker monitored RANK  a monitored_barrier that passes, then one that RANK misses
//
// Errors are printed as "error: <one line>" and end the process with code 1.

#include <paratrain/paratrain.h>

#include <torch/torch.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <iostream>
#include <map>
#include <numeric>
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
          default:  // the others: checked against PyTorch's results (mode "reference")
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

// The inputs of collectives_reference.py: small integers (-4..4), quarters as floats, so that
// every sum is exact in any order.
at::Tensor values(int64_t seed, int64_t numel, at::ScalarType type) {
  at::Tensor v = (torch::arange(numel, torch::kLong) * 3 + seed * 7).remainder(9) - 4;
  return type == torch::kFloat ? v.to(torch::kFloat) / 4 : v.to(type);
}

at::Tensor bits(int64_t seed, int64_t numel) {
  return (torch::arange(numel, torch::kLong) * 11 + seed * 37).remainder(64);
}

at::Tensor as_bytes(const std::string& s) {
  at::Tensor t = torch::empty({static_cast<int64_t>(s.size())}, torch::kByte);
  std::memcpy(t.data_ptr(), s.data(), s.size());
  return t;
}

// Integers exactly, floats within 1e-6.
void expect_reference(const std::map<std::string, at::Tensor>& want,
                      const std::string& key,
                      const at::Tensor& got,
                      int& compared) {
  auto it = want.find(key);
  if (it == want.end()) {
    std::cout << "MISMATCH " << key << ": PyTorch saved no result" << std::endl;
    ++g_failures;
    return;
  }
  const at::Tensor& w = it->second;
  const bool same_kind = got.scalar_type() == w.scalar_type() && got.sizes() == w.sizes();
  const bool equal =
      same_kind && (at::isFloatingType(got.scalar_type()) ? torch::allclose(got, w, 1e-6, 1e-6)
                                                          : torch::equal(got, w));
  if (!equal) {
    std::cout << "MISMATCH " << key << ": got " << got.flatten().slice(0, 0, 8) << " "
              << got.sizes() << " want " << w.flatten().slice(0, 0, 8) << " " << w.sizes()
              << std::endl;
    ++g_failures;
  }
  ++compared;
}

// Each bad input is one line, thrown before any rank communicates (so one rank may hit it alone).
void check_bad_input(dist::ProcessGroup& pg) {
  const int n = pg.size();
  auto expect_error = [](const std::string& what, const std::function<void()>& f,
                         const std::string& part) {
    try {
      f();
      std::cout << "MISMATCH bad input " << what << ": no error" << std::endl;
      ++g_failures;
    } catch (const c10::Error& e) {
      const std::string m = e.what_without_backtrace();
      if (m.find(part) == std::string::npos || m.find('\n') != std::string::npos) {
        std::cout << "MISMATCH bad input " << what << ": " << m << std::endl;
        ++g_failures;
      }
    }
  };
  at::Tensor f = torch::zeros({4});
  at::Tensor i = torch::zeros({4}, torch::kLong);
  expect_error(
      "splits",
      [&] {
        at::Tensor out = torch::zeros({n});
        std::vector<int64_t> wrong(static_cast<size_t>(n), 0);
        wrong[0] = 3;
        pg.all_to_all_single(out, f, std::vector<int64_t>(static_cast<size_t>(n), 1), wrong);
      },
      "add up to 3, but the tensor has 4 rows in dim 0");
  expect_error(
      "bitwise on floats", [&] { pg.allreduce(f, dist::ReduceOp::kBand); },
      "band needs an integer or bool tensor, got Float");
  expect_error(
      "dst out of range", [&] { pg.reduce(i, n); },
      "reduce: dst " + std::to_string(n) + " is out of range for a group of size " +
          std::to_string(n));
  if (n > 1) {
    std::vector<at::Tensor> outputs(static_cast<size_t>(n), torch::zeros({4}));
    const int dst = (pg.rank() + 1) % n;
    expect_error(
        "gather outputs on a non-dst rank", [&] { pg.gather(outputs, f, dst); },
        "gather: outputs are given on rank " + std::to_string(pg.rank()) + ", which is not dst (" +
            std::to_string(dst) + ")");
  }
}

void check_reference(dist::ProcessGroup& pg, const std::string& dir) {
  const int n = pg.size();
  const int me = pg.rank();
  check_bad_input(pg);
  const auto want = paratrain::load_torch_state_dict(dir + "/rank-" + std::to_string(me) + ".pt");
  int compared = 0;
  auto expect = [&](const std::string& key, const at::Tensor& got) {
    expect_reference(want, key, got, compared);
  };
  const std::vector<std::pair<std::string, dist::ReduceOp>> ops{
      {"sum", dist::ReduceOp::kSum},
      {"max", dist::ReduceOp::kMax},
      {"min", dist::ReduceOp::kMin},
      {"product", dist::ReduceOp::kProduct}};
  for (const auto& [name, op] : ops) {
    for (auto [type, tag] :
         {std::make_pair(torch::kFloat, "f32"), std::make_pair(torch::kLong, "i64")}) {
      at::Tensor t = values(me, 7, type);
      pg.allreduce(t, op)->wait();
      expect("allreduce_" + name + "_" + tag, t);
    }
  }
  at::Tensor avg = values(me, 7, torch::kFloat);
  pg.allreduce(avg, dist::ReduceOp::kAvg)->wait();
  expect("allreduce_avg_f32", avg);
  for (const auto& [name, op] :
       std::vector<std::pair<std::string, dist::ReduceOp>>{{"band", dist::ReduceOp::kBand},
                                                           {"bor", dist::ReduceOp::kBor},
                                                           {"bxor", dist::ReduceOp::kBxor}}) {
    at::Tensor t = bits(me, 7);
    pg.allreduce(t, op)->wait();
    expect("allreduce_" + name + "_i64", t);
  }

  at::Tensor r = values(me, 6, torch::kFloat);
  const at::Tensor before = r.clone();
  pg.reduce(r, n - 1)->wait();
  if (me == n - 1) {
    expect("reduce_sum_f32", r);
  } else if (!torch::equal(r, before)) {
    std::cout << "MISMATCH reduce changed a non-dst rank's tensor" << std::endl;
    ++g_failures;
  }
  r = values(me, 6, torch::kLong);
  pg.reduce(r, 0, dist::ReduceOp::kProduct)->wait();
  if (me == 0) {
    expect("reduce_product_i64", r);
  }

  const int dst = 1 % n;
  std::vector<at::Tensor> gathered;
  if (me == dst) {
    for (int k = 0; k < n; ++k) {
      gathered.push_back(torch::zeros({5}));
    }
  }
  pg.gather(gathered, values(me + 10, 5, torch::kFloat), dst)->wait();
  for (size_t k = 0; k < gathered.size(); ++k) {
    expect("gather_" + std::to_string(k), gathered[k]);
  }

  const int src = n - 1;
  at::Tensor received = torch::zeros({3}, torch::kLong);
  std::vector<at::Tensor> pieces;
  if (me == src) {
    for (int k = 0; k < n; ++k) {
      pieces.push_back(values(100 + k, 3, torch::kLong));
    }
  }
  pg.scatter(received, pieces, src)->wait();
  expect("scatter", received);

  std::vector<at::Tensor> inputs, outputs;
  for (int p = 0; p < n; ++p) {
    inputs.push_back(values(me * 10 + p, ((me + p) % 3 + 1) * 2, torch::kFloat).view({-1, 2}));
    outputs.push_back(torch::zeros({(p + me) % 3 + 1, 2}));
  }
  pg.all_to_all(outputs, inputs)->wait();
  for (int p = 0; p < n; ++p) {
    expect("all_to_all_" + std::to_string(p), outputs[static_cast<size_t>(p)]);
  }

  std::vector<int64_t> in_splits, out_splits;
  for (int p = 0; p < n; ++p) {
    in_splits.push_back((me + 2 * p) % 3);
    out_splits.push_back((p + 2 * me) % 3);
  }
  const int64_t rows_in = std::accumulate(in_splits.begin(), in_splits.end(), int64_t(0));
  const int64_t rows_out = std::accumulate(out_splits.begin(), out_splits.end(), int64_t(0));
  at::Tensor target = torch::zeros({rows_out, 2}, torch::kLong);
  pg.all_to_all_single(target, values(me + 20, rows_in * 2, torch::kLong).view({-1, 2}), out_splits,
                       in_splits)
      ->wait();
  expect("all_to_all_single_uneven", target);
  at::Tensor equal_out = torch::zeros({n * 2, 3});
  pg.all_to_all_single(equal_out, values(me + 30, n * 6, torch::kFloat).view({n * 2, 3}))->wait();
  expect("all_to_all_single_equal", equal_out);

  at::Tensor whole = torch::zeros({n * 5});
  pg.all_gather_into_tensor(whole, values(me + 40, 5, torch::kFloat))->wait();
  expect("all_gather_into_tensor", whole);
  for (const auto& [name, op] : std::vector<std::pair<std::string, dist::ReduceOp>>{
           {"sum", dist::ReduceOp::kSum}, {"max", dist::ReduceOp::kMax}}) {
    at::Tensor mine = torch::zeros({4});
    pg.reduce_scatter_tensor(mine, values(me + 50, n * 4, torch::kFloat), op)->wait();
    expect("reduce_scatter_tensor_" + name, mine);
  }
  // In place, as FSDP calls it: the output is this rank's row of the input.
  at::Tensor both = values(me + 50, n * 4, torch::kFloat);
  at::Tensor row = both.view({n, 4})[me];
  pg.reduce_scatter_tensor(row, both, dist::ReduceOp::kSum)->wait();
  expect("reduce_scatter_tensor_sum", row);

  at::Tensor recv = torch::zeros({6});
  auto works = pg.batch_isend_irecv(
      {{dist::P2POp::Kind::kIsend, values(me + 60, 6, torch::kFloat), (me + 1) % n},
       {dist::P2POp::Kind::kIrecv, recv, (me + n - 1) % n}});
  for (auto& w : works) {
    w->wait();
  }
  expect("batch_isend_irecv", recv);

  std::string object;
  for (int k = 0; k <= me; ++k) {
    object += "object of rank " + std::to_string(me);
  }
  pg.broadcast_object(object, n - 1);
  expect("broadcast_object", as_bytes(object));
  std::string mine;
  for (int k = 0; k <= me; ++k) {
    mine += "rank " + std::to_string(me) + " ";
  }
  std::vector<std::string> everyone;
  pg.all_gather_object(everyone, mine);
  for (int k = 0; k < n; ++k) {
    expect("all_gather_object_" + std::to_string(k), as_bytes(everyone[static_cast<size_t>(k)]));
  }
  std::cout << "rank " << me << " of " << n << " (" << pg.backend_name() << "): " << compared
            << " results equal PyTorch's" << std::endl;
}

// A monitored_barrier that every rank reaches, then one that rank `late` reaches too late.
int check_monitored(dist::ProcessGroup& pg, int late) {
  pg.monitored_barrier(std::chrono::milliseconds(20000));
  std::cout << "rank " << pg.rank() << " passed the monitored barrier" << std::endl;
  if (pg.rank() == late) {
    std::this_thread::sleep_for(std::chrono::seconds(4));
  }
  try {
    pg.monitored_barrier(std::chrono::milliseconds(1500), /*wait_all_ranks=*/true);
    std::cout << "rank " << pg.rank() << " passed the second monitored barrier" << std::endl;
  } catch (const dist::CollectiveError& e) {
    std::cout << "rank " << pg.rank() << " error: " << e.what() << std::endl;
  }
  return 0;
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
      if (mode == "die") {
        // Every rank's connections are made first: a rank that left while another was still
        // connecting would fail that rank's rendezvous, not its collective.
        pg->barrier()->wait();
      }
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
    if (mode == "monitored") {
      return check_monitored(*pg, argc > 2 ? std::atoi(argv[2]) : 1);
    }
    if (mode == "reference") {
      check_reference(*pg, argc > 2 ? argv[2] : ".");
    } else {
      check_collectives(*pg);
    }
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
