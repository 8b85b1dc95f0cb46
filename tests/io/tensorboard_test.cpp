// TensorBoard event files: the CRC-32C of TFRecord framing, and files read back by an
// independent reader (python3-protobuf with TensorBoard's Event, python3-crc32c), by
// TensorBoard's own EventAccumulator where it is installed, and against the Trainer's metrics.

#include "test_util.h"

#include "paratrain/data/dataset.h"
#include "paratrain/io/tensorboard.h"
#include "paratrain/models/registry.h"
#include "paratrain/train/trainer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace paratrain {
namespace testing {
namespace {

using Json = nlohmann::json;

std::string reader() {
  return std::string(PARATRAIN_TEST_DATA_DIR) + "/../train/read_tensorboard.py";
}

// Why the event-file tests cannot run here, or "" when they can.
std::string missing_reader() {
  if (!tensorboard::available()) {
    return "this build has no Protocol Buffers (libprotobuf-dev, protobuf-compiler)";
  }
  if (!python_has("google.protobuf") || (!python_has("crc32c") && !python_has("crcmod"))) {
    return test_python() + " lacks python3-protobuf or python3-crc32c to read event files";
  }
  return "";
}

std::vector<std::string> event_files(const std::string& dir) {
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    files.push_back(e.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

// Every record of `files`, as the independent reader decodes them.
std::vector<Json> read_back(const std::vector<std::string>& files) {
  std::vector<std::string> argv{test_python(), reader()};
  argv.insert(argv.end(), files.begin(), files.end());
  auto r = run_process(argv, {}, 120);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  std::vector<Json> rows;
  std::istringstream in(r.output);
  for (std::string line; std::getline(in, line);) {
    rows.push_back(Json::parse(line));
  }
  return rows;
}

TEST(TensorBoard, MaskedCrc32cMatchesTheStandardCheckValue) {
  // CRC-32C("123456789") is 0xE3069283 (the check value of the Castagnoli CRC); TFRecord masks
  // it as ((crc >> 15) | (crc << 17)) + 0xa282ead8.
  const uint32_t crc = 0xE3069283u;
  const uint32_t masked = ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
  EXPECT_EQ(tensorboard::masked_crc32c("123456789", 9), masked);
  EXPECT_NE(tensorboard::masked_crc32c("123456780", 9), masked);
}

TEST(TensorBoard, EventFilesReadBackIndependently) {
  const std::string why = missing_reader();
  if (!why.empty()) {
    GTEST_SKIP() << why;
  }
  const std::string dir = "/tmp/" + unique_token("tb");
  std::string path;
  {
    tensorboard::SummaryWriter tb(dir);
    path = tb.path();
    EXPECT_EQ(std::filesystem::path(path).filename().string().rfind("events.out.tfevents.", 0), 0u)
        << path;
    tb.add_scalar("train/loss", 2.5, 1);
    tb.add_scalar("train/loss", 0.125, 2);
    tb.add_scalar("train/lr", 0.1, 2);
    tb.purge(2);
    tb.add_scalar("train/loss", 1e-3, 2);
  }
  const std::vector<Json> rows = read_back({path});
  ASSERT_EQ(rows.size(), 6u);
  EXPECT_EQ(rows[0].at("file_version"), "brain.Event:2");
  EXPECT_GT(rows[0].at("wall_time").get<double>(), 1.6e9);  // seconds since 1970
  const std::vector<std::tuple<std::string, double, int64_t>> want{
      {"train/loss", 2.5, 1}, {"train/loss", 0.125, 2}, {"train/lr", 0.1, 2}};
  for (size_t i = 0; i < want.size(); ++i) {
    const auto& [tag, value, step] = want[i];
    EXPECT_EQ(rows[i + 1].at("step"), step);
    EXPECT_EQ(rows[i + 1].at("values").at(tag).get<float>(), static_cast<float>(value)) << tag;
  }
  EXPECT_EQ(rows[4].at("session_log"), 1);  // SessionLog.START
  EXPECT_EQ(rows[4].at("step"), 2);
  EXPECT_EQ(rows[5].at("values").at("train/loss").get<float>(), 1e-3f);

  // A flipped byte in a record fails the reader's CRC-32C check.
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-6, std::ios::end);
    f.put('\x7f');
  }
  auto r = run_process({test_python(), reader(), path}, {}, 120);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("CRC-32C is wrong"), std::string::npos) << r.output;
  remove_tree(dir);
}

TEST(TensorBoard, UnwritableDirectoryIsNamed) {
  if (!tensorboard::available()) {
    GTEST_SKIP() << "this build has no Protocol Buffers (libprotobuf-dev, protobuf-compiler)";
  }
  try {
    tensorboard::SummaryWriter tb("/proc/paratrain-tb");
    FAIL() << "wrote into /proc";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("/proc/paratrain-tb"), std::string::npos) << e.what();
  }
}

// The Trainer's event file holds the metrics rows' values at their steps, and where TensorBoard
// is installed its EventAccumulator reads the same scalars.
TEST(TensorBoard, TrainerScalarsMatchTheMetrics) {
  const std::string why = missing_reader();
  if (!why.empty()) {
    GTEST_SKIP() << why;
  }
  const std::string dir = "/tmp/" + unique_token("tbtrain");
  torch::manual_seed(1);
  const int64_t n = 256;
  torch::Tensor y = torch::randint(0, 10, {n}, torch::kLong);
  torch::Tensor x = torch::randn({n, 1, 28, 28}) + y.view({n, 1, 1, 1}).to(torch::kFloat);
  auto data = std::make_shared<data::TensorDataset>(x, y);
  torch::manual_seed(0);
  Trainer t(models::make("linear", 10), data, data,
            TrainerOptions()
                .epochs(2)
                .batch_size(32)
                .workers(0)
                .log_every(2)
                .metrics(dir + "/metrics.jsonl")
                .tensorboard(dir + "/tb"));
  t.fit();
  std::map<std::pair<std::string, int64_t>, double> want;  // (tag, step) -> value
  {
    std::ifstream in(dir + "/metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const Json row = Json::parse(line);
      const std::string prefix = row.contains("val_accuracy") ? "epoch/" : "train/";
      for (const auto& [key, value] : row.items()) {
        if (key != "step" && key != "epoch" && key != "batch" && value.is_number()) {
          want[{prefix + key, row.at("step").get<int64_t>()}] = value.get<double>();
        }
      }
    }
  }
  ASSERT_TRUE(want.count({"train/loss", 8})) << "no step row at step 8";
  ASSERT_TRUE(want.count({"train/images_per_sec", 8}));
  ASSERT_TRUE(want.count({"epoch/val_accuracy", 16}));
  std::map<std::pair<std::string, int64_t>, double> got;
  for (const Json& row : read_back(event_files(dir + "/tb"))) {
    if (row.contains("values")) {
      for (const auto& [tag, value] : row.at("values").items()) {
        got[{tag, row.at("step").get<int64_t>()}] = value.get<double>();
      }
    }
  }
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [key, value] : want) {
    ASSERT_TRUE(got.count(key)) << key.first << " at step " << key.second;
    EXPECT_EQ(static_cast<float>(got.at(key)), static_cast<float>(value))
        << key.first << " at step " << key.second;
  }
  if (python_has("tensorboard")) {
    auto r = run_process({test_python(), "-c",
                          "import sys\n"
                          "from tensorboard.backend.event_processing import event_accumulator\n"
                          "a = event_accumulator.EventAccumulator(sys.argv[1]); a.Reload()\n"
                          "print(a.Scalars('train/loss')[-1].value)\n",
                          dir + "/tb"},
                         {}, 120);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NEAR(std::stod(r.output), want.at({"train/loss", 16}), 1e-6) << r.output;
  } else {
    std::cerr << "[ SKIPPED part ] TensorBoard's EventAccumulator: " << test_python()
              << " has no tensorboard module" << std::endl;
  }
  remove_tree(dir);
}

// A resumed run starts a new event file with SessionLog.START at the first step it redoes, so
// TensorBoard drops what the lost attempt logged from there on.
TEST(TensorBoard, ResumePurgesTheStepsItRedoes) {
  const std::string why = missing_reader();
  if (!why.empty()) {
    GTEST_SKIP() << why;
  }
  const std::string dir = "/tmp/" + unique_token("tbresume");
  torch::manual_seed(1);
  auto data = std::make_shared<data::TensorDataset>(torch::randn({128, 1, 28, 28}),
                                                    torch::randint(0, 10, {128}, torch::kLong));
  auto options = [&](int64_t epochs) {
    return TrainerOptions()
        .epochs(epochs)
        .batch_size(32)
        .workers(0)
        .log_every(1)
        .checkpoint_dir(dir + "/ckpt")
        .checkpoint_every_epoch(true)
        .resume("auto")
        .tensorboard(dir + "/tb");
  };
  torch::manual_seed(0);
  Trainer(models::make("linear", 10), data, data, options(1)).fit();
  torch::manual_seed(0);
  Trainer(models::make("linear", 10), data, data, options(2)).fit();
  const std::vector<std::string> files = event_files(dir + "/tb");
  ASSERT_EQ(files.size(), 2u);
  const std::vector<Json> second = read_back({files[1]});
  ASSERT_GE(second.size(), 3u);
  EXPECT_EQ(second[1].at("session_log"), 1) << second[1].dump();
  EXPECT_EQ(second[1].at("step"), 5) << "the first file logged steps 1-4, then the checkpoint";
  EXPECT_EQ(second[2].at("step"), 5) << second[2].dump();
  remove_tree(dir);
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
