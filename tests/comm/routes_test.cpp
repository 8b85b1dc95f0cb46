// Backends routed by tensor device ("cpu:gloo,cuda:nccl", as torch.distributed 2.x), their bad
// inputs, and the ranks-per-GPU check. The multi-process runs are in collectives_test.cpp
// (cpu:gloo and cpu:mpi) and gpu/gpu_test.cpp (with CUDA tensors).

#include "test_util.h"

#include "paratrain/comm/devices.h"
#include "paratrain/comm/init.h"

#include <gtest/gtest.h>

namespace paratrain {
namespace dist {
namespace {

using testing::error_of;

std::string resolve(const std::string& backend, bool cuda = false) {
  return resolve_backend(InitOptions().backend(backend).uses_cuda(cuda));
}

bool built(const std::string& engine) {
  auto all = available_backends();
  return std::find(all.begin(), all.end(), engine) != all.end();
}

TEST(Routes, ParseAndNormalise) {
  if (!built("gloo")) {
    GTEST_SKIP() << "this build has no gloo backend";
  }
  EXPECT_EQ(resolve("cpu:gloo"), "cpu:gloo");
  EXPECT_EQ(resolve("cpu:gloo,cuda:gloo"), "gloo");  // one engine for both: that engine
  auto routes = parse_backend_routes("cuda:gloo,cpu:gloo");
  ASSERT_EQ(routes.size(), 2u);
  EXPECT_EQ(routes[0].first, c10::DeviceType::CPU);  // the CPU's route first
  EXPECT_EQ(routes[1].first, c10::DeviceType::CUDA);
  if (built("nccl")) {
    EXPECT_EQ(resolve("cpu:gloo,cuda:nccl"), "cpu:gloo,cuda:nccl");
    EXPECT_EQ(resolve("auto", /*cuda=*/true), "cpu:gloo,cuda:nccl");
  } else {
    // Without a CUDA libtorch, "auto" on a job that asks for CUDA still gets the CPU's engine.
    EXPECT_EQ(resolve("auto", /*cuda=*/true), "gloo");
  }
  EXPECT_EQ(resolve("auto", /*cuda=*/false), "gloo");
}

TEST(Routes, BadInputIsOneClearLine) {
  const std::vector<std::pair<std::string, std::string>> cases{
      {"cpu:foo", "unknown backend 'foo' in 'cpu:foo': choose gloo, mpi or nccl"},
      {"gpu:gloo", "backend 'gpu:gloo': unknown device 'gpu': routes name cpu or cuda"},
      {"cpu:nccl", "backend 'cpu:nccl': nccl moves CUDA tensors only; route cpu to gloo or mpi"},
      {"cuda:mpi", "mpi backend moves CPU tensors only"},
      {"cpu:gloo,cpu:gloo", "names cpu twice"},
      {"cpu:", "'cpu:' is not device:backend"},
      {"carrier-pigeon", "unknown backend 'carrier-pigeon': choose auto, gloo, mpi or nccl"},
  };
  for (const auto& c : cases) {
    const std::string why = error_of([&] { resolve(c.first); });
    EXPECT_NE(why.find(c.second), std::string::npos) << c.first << ": " << why;
    EXPECT_EQ(why.find('\n'), std::string::npos) << c.first << ": " << why;
  }
  if (!built("nccl")) {
    const std::string why = error_of([&] { resolve("cpu:gloo,cuda:nccl"); });
    EXPECT_NE(why.find("backend 'nccl' is not in this build"), std::string::npos) << why;
    EXPECT_NE(why.find("nccl needs a libtorch built with CUDA"), std::string::npos) << why;
  }
  if (!built("gloo")) {
    const std::string why = error_of([&] { resolve("gloo"); });
    EXPECT_NE(why.find("gloo needs gloo's headers at build time"), std::string::npos) << why;
  }
}

TEST(Routes, CpuRouteGroupInOneProcess) {
  if (!built("gloo")) {
    GTEST_SKIP() << "this build has no gloo backend";
  }
  auto pg = init_process_group(InitOptions()
                                   .backend("cpu:gloo")
                                   .init_method("file:///tmp/" + testing::unique_token("routes"))
                                   .rank(0)
                                   .world_size(1));
  EXPECT_EQ(pg->backend_name(), "cpu:gloo");
  EXPECT_EQ(pg->backend_for(c10::DeviceType::CPU), "gloo");
  EXPECT_EQ(pg->backend_for(c10::DeviceType::CUDA), "");
  auto t = torch::arange(4, torch::kFloat);
  pg->allreduce(t, ReduceOp::kAvg)->wait();
  EXPECT_TRUE(torch::equal(t, torch::arange(4, torch::kFloat)));
  auto sub = pg->new_group({0});
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(sub->backend_name(), "cpu:gloo");
  sub->allreduce(t)->wait();
  pg->barrier()->wait();
}

TEST(Devices, MoreRanksThanGpusSaysWhatToDo) {
  const std::string why = error_of([] { check_ranks_fit_gpus(2, 1); });
  EXPECT_NE(why.find("2 ranks run on this node but it has 1 visible CUDA device, and each rank "
                     "needs a GPU of its own: start at most 1 per node (--nproc-per-node 1), "
                     "pick GPUs with --devices, or compute on the CPU"),
            std::string::npos)
      << why;
  EXPECT_EQ(error_of([] { check_ranks_fit_gpus(2, 2); }), "");
}

}  // namespace
}  // namespace dist
}  // namespace paratrain
