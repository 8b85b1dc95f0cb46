// paratrain train end to end (the README's main job, shortened; a GPT on bytes) and its bad input.

#include "test_util.h"

#include "paratrain/data/tokens.h"
#include "paratrain/io/safetensors.h"
#include "paratrain/models/registry.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>

#if defined(__x86_64__) || defined(__i386__)
#endif

#include <sys/mount.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <regex>

namespace paratrain {
namespace testing {
namespace {

// These jobs test CPU training: on a machine with GPUs they run with the GPUs hidden (two ranks
// on one GPU are refused by design, see Devices.MoreRanksThanGpusSaysWhatToDo).

// The test accuracy of the first --json epoch row in `output`; -1 when there is none.
double json_test_accuracy(const std::string& output) {
  std::smatch m;
  if (!std::regex_search(output, m, std::regex(R"("test_accuracy": ([0-9.e-]+))"))) {
    return -1;
  }
  return std::stod(m[1]);
}

TEST(Train, MainJobShortened) {
  // The README's main job with --steps: 2 DDP ranks, mlp, Fashion-MNIST. After 150 steps per rank
  // of batch 64 the MLP is well past chance (10%); the full job reaches 85%.
  std::string weights = "/tmp/" + unique_token("paratrain-weights") + ".safetensors";
  auto r =
      run_process({cli_path(),   "train", "--model",    "mlp", "--dataset",    "fashion-mnist",
                   "--strategy", "ddp",   "--nproc",    "2",   "--device",     "cpu",
                   "--epochs",   "1",     "--steps",    "150", "--batch-size", "64",
                   "--lr",       "0.05",  "--momentum", "0.9", "--json",       "--save-weights",
                   weights},
                  {{"PARATRAIN_TIMEOUT", "60"}}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::smatch m;
  std::regex row(R"(\{"epoch": 1, "train_loss": ([0-9.e-]+), "test_accuracy": ([0-9.e-]+), )"
                 R"("test_loss": ([0-9.e-]+), "images_per_sec": ([0-9.e+-]+), )"
                 R"("seconds": ([0-9.e-]+), "data_wait_seconds": ([0-9.e-]+)\})");
  ASSERT_TRUE(std::regex_search(r.output, m, row)) << r.output;
  EXPECT_GT(std::stod(m[2]), 0.70) << r.output;
  EXPECT_LT(std::stod(m[1]), 1.5) << r.output;
  EXPECT_LT(std::stod(m[3]), 1.5) << r.output;  // the test set's mean cross entropy
  EXPECT_GT(std::stod(m[4]), 0) << r.output;
  EXPECT_GE(std::stod(m[6]), 0) << r.output;  // the time spent waiting for batches
  // The weights load back into the same model, by name.
  auto state = load_safetensors(weights);
  EXPECT_EQ(state.count("linear0.weight"), 1u);
  EXPECT_EQ(state.at("linear0.weight").sizes(), (std::vector<int64_t>{512, 784}));
  EXPECT_EQ(state.count("bn0.running_mean"), 1u);
  auto model = models::make("mlp");
  load_module_state(*model, state);
  EXPECT_TRUE(torch::equal(model->named_parameters()["linear2.bias"], state.at("linear2.bias")));
  std::remove(weights.c_str());
}

TEST(Train, ExampleProgramTrains) {
  auto r = run_process({cli_path(), "launch", "--standalone", "--nproc-per-node", "2", "--",
                        PARATRAIN_TEST_DDP_EXAMPLE, "1", "100"},
                       {{"PARATRAIN_TIMEOUT", "60"}, kCpuOnly}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m,
                                std::regex(R"(\[rank 0\]: epoch 1: mean loss [0-9.]+, )"
                                           R"(test accuracy ([0-9.]+))")))
      << r.output;
  EXPECT_GT(std::stod(m[1]), 0.6) << r.output;
}

TEST(Train, DataParallelExampleTrains) {
  auto r = run_process({PARATRAIN_TEST_DP_EXAMPLE, "1", "150"}, {kCpuOnly}, 180);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(
      r.output, m,
      std::regex(R"(epoch 1: 2 replicas, mean loss [0-9.]+, test accuracy ([0-9.]+))")))
      << r.output;
  EXPECT_GT(std::stod(m[1]), 0.6) << r.output;
}

TEST(Train, ModelParallelResNet50Example) {
  // One step of each, a batch of 8 in 4 micro-batches: both modes run and train. On a CPU where
  // oneDNN 3.x would divide by zero, models::make turns it off (Note [CPU kernels that do not
  // run]; tests/util/cpu_kernels_test.cpp runs that path on every machine).
  auto r = run_process({PARATRAIN_TEST_MP_EXAMPLE, "1", "8", "4", "1f1b"}, {}, 240);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(std::regex_search(
      r.output, std::regex(R"(model parallel \(cpu, cpu\): [0-9.e-]+ s/step, loss [0-9.]+)")))
      << r.output;
  EXPECT_TRUE(std::regex_search(
      r.output,
      std::regex(R"(pipelined, 4 chunks \(1f1b\): [0-9.e-]+ s/step, loss [0-9.]+, speedup)")))
      << r.output;
}

TEST(Train, CustomResNetFinetuneExample) {
  if (!python_has("torchvision")) {
    GTEST_SKIP() << test_python() << " has no torchvision to write the reference weights";
  }
  const std::string prefix = "/tmp/" + unique_token("tv-resnet18-example");
  auto py = run_process(
      {test_python(), std::string(PARATRAIN_TEST_DATA_DIR) + "/make_torchvision_reference.py", "18",
       prefix},
      {}, 120);
  ASSERT_EQ(py.exit_code, 0) << py.output;
  auto r =
      run_process({PARATRAIN_TEST_FINETUNE_EXAMPLE, prefix + "_state.pt", "18", "60"}, {}, 240);
  for (const char* suffix : {"_state.pt", "_ordered.pt", "_ref.pt"}) {
    std::remove((prefix + suffix).c_str());
  }
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(
      r.output, m,
      std::regex(R"(resnet18 \+ custom head \(backbone frozen\): 60 steps, mean loss [0-9.]+, )"
                 R"(test accuracy ([0-9.]+))")))
      << r.output;
  EXPECT_GT(std::stod(m[1]), 0.40) << r.output;
}

TEST(Train, MixedPrecisionDdpExample) {  // ctest: slow 14
  auto r = run_process({cli_path(), "launch", "--standalone", "--nproc-per-node", "2", "--",
                        PARATRAIN_TEST_AMP_EXAMPLE, "O1", "80"},
                       {{"PARATRAIN_TIMEOUT", "60"}, kCpuOnly}, 240);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(
      r.output, m, std::regex(R"(O1 \(bf16\): 80 steps per rank, test accuracy ([0-9.]+))")))
      << r.output;
  EXPECT_GT(std::stod(m[1]), 0.60) << r.output;
}

TEST(Train, SingleProcessLinear) {
  auto r = run_process({cli_path(), "train", "--model", "linear", "--strategy", "single",
                        "--epochs", "2", "--steps", "20", "--batch-size", "32"},
                       {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("epoch 2/2: train_loss "), std::string::npos) << r.output;
}

TEST(Train, DataParallelTwoCpuReplicas) {
  // --batch-size is the whole batch, as with nn.DataParallel: 100 steps of 128 over 2 replicas.
  auto r =
      run_process({cli_path(), "train", "--model", "mlp", "--strategy", "dp", "--devices",
                   "cpu,cpu", "--epochs", "1", "--steps", "100", "--batch-size", "128", "--json"},
                  {}, 180);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("devices cpu,cpu, batch 128 (whole, scattered)"), std::string::npos)
      << r.output;
  const double accuracy = json_test_accuracy(r.output);
  ASSERT_GE(accuracy, 0) << r.output;
  EXPECT_GT(accuracy, 0.70) << r.output;
}

TEST(Train, PipelineTwoStagesOneFOneB) {
  auto r = run_process({cli_path(), "train", "--model", "mlp", "--strategy", "pipeline", "--stages",
                        "2", "--chunks", "8", "--schedule", "1f1b", "--epochs", "1", "--steps",
                        "100", "--batch-size", "128", "--json"},
                       {}, 180);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("devices cpu,cpu (2 stages, balance [2, 8], 8 chunks, 1f1b)"),
            std::string::npos)
      << r.output;
  const double accuracy = json_test_accuracy(r.output);
  ASSERT_GE(accuracy, 0) << r.output;
  EXPECT_GT(accuracy, 0.70) << r.output;
}

TEST(Train, MixedPrecisionUnderDdp) {
  // O2 in bf16 with 2 DDP ranks: half model, fp32 masters, gradients reduced in bf16. The saved
  // weights are the fp32 masters.
  const std::string weights = "/tmp/" + unique_token("o2-weights") + ".safetensors";
  auto r = run_process({cli_path(), "train",        "--model",  "cnn",      "--strategy",
                        "ddp",      "--nproc",      "2",        "--device", "cpu",
                        "--amp",    "O2",           "--epochs", "1",        "--steps",
                        "60",       "--batch-size", "64",       "--json",   "--save-weights",
                        weights},
                       {{"PARATRAIN_TIMEOUT", "60"}}, 240);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto saved = load_safetensors(weights);
  std::remove(weights.c_str());
  EXPECT_EQ(saved.at("conv0.weight").scalar_type(), torch::kFloat);
  EXPECT_EQ(saved.at("fc1.weight").scalar_type(), torch::kFloat);
  EXPECT_EQ(saved.at("bn0.running_mean").scalar_type(), torch::kFloat);
  EXPECT_NE(r.output.find("amp O2 (bf16)"), std::string::npos) << r.output;
  const double accuracy = json_test_accuracy(r.output);
  ASSERT_GE(accuracy, 0) << r.output;
  EXPECT_GT(accuracy, 0.60) << r.output;
}

TEST(Train, CustomHeadOnTorchvisionWeights) {  // ctest: slow 18
  if (!python_has("torchvision")) {
    GTEST_SKIP() << test_python() << " has no torchvision to write the reference weights";
  }
  // torchvision's resnet18 weights (random: nothing can be downloaded here) from python3-torch,
  // loaded strictly, the custom classifier head on top, backbone frozen, Fashion-MNIST at 3x32x32.
  const std::string prefix = "/tmp/" + unique_token("tv-resnet18");
  auto py = run_process(
      {test_python(), std::string(PARATRAIN_TEST_DATA_DIR) + "/make_torchvision_reference.py", "18",
       prefix},
      {}, 120);
  ASSERT_EQ(py.exit_code, 0) << py.output;
  auto r = run_process({cli_path(),
                        "train",
                        "--model",
                        "resnet18",
                        "--load-weights",
                        prefix + "_state.pt",
                        "--head",
                        "custom",
                        "--freeze-backbone",
                        "--image-size",
                        "32",
                        "--epochs",
                        "1",
                        "--steps",
                        "60",
                        "--batch-size",
                        "64",
                        "--lr",
                        "0.01",
                        "--json"},
                       {}, 240);
  for (const char* suffix : {"_state.pt", "_ordered.pt", "_ref.pt"}) {
    std::remove((prefix + suffix).c_str());
  }
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const double accuracy = json_test_accuracy(r.output);
  ASSERT_GE(accuracy, 0) << r.output;
  EXPECT_GT(accuracy, 0.40) << r.output;  // 10 classes: chance is 0.10
}

TEST(Train, MixedPrecisionWithDataParallelAndPipeline) {
  for (const auto& extra : std::vector<std::vector<std::string>>{
           {"--strategy", "dp", "--devices", "cpu,cpu", "--amp", "O1"},
           {"--strategy", "pipeline", "--stages", "2", "--chunks", "4", "--amp", "O2"}}) {
    std::vector<std::string> argv{cli_path(), "train", "--model", "mlp",          "--epochs", "1",
                                  "--steps",  "100",   "--json",  "--batch-size", "128"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    auto r = run_process(argv, {}, 180);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const double accuracy = json_test_accuracy(r.output);
    ASSERT_GE(accuracy, 0) << r.output;
    EXPECT_GT(accuracy, 0.70) << extra[1] << " " << extra.back() << ": " << r.output;
  }
}

TEST(Train, BadInput) {  // ctest: slow 10
  std::string bad_file = "/tmp/" + unique_token("not-safetensors");
  { std::ofstream(bad_file) << "hello"; }
  std::string linear_weights = "/tmp/" + unique_token("linear") + ".safetensors";
  save_safetensors(module_state(*models::make("linear")), linear_weights);
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  std::vector<Case> cases{
      {{"--model", "vgg"}, "unknown --model 'vgg': choose linear, mlp, cnn, resnet18"},
      {{"--model", "resnet18", "--head", "fancy"}, "unknown --head 'fancy'"},
      {{"--freeze-backbone"}, "--freeze-backbone goes with --head custom"},
      {{"--model", "cnn", "--head", "custom"},
       "the backbone's last layer must be its classifier 'fc'"},
      {{"--amp", "O4"}, "unknown opt level 'O4': choose O0, O1, O2 or O3"},
      {{"--amp", "O1", "--amp-dtype", "fp8"}, "unknown mixed-precision dtype 'fp8'"},
      {{"--amp-dtype", "bf16"}, "--amp-dtype goes with --amp O1|O2|O3"},
      {{"--device", "cpu", "--amp", "O2", "--amp-dtype", "fp16"},
       "fp16 autocast is not available on the CPU"},
      {{"--dataset", "cifar"}, "unknown --dataset 'cifar'"},
      {{"--strategy", "mp"}, "unknown --strategy 'mp': choose single, ddp, fsdp, dp or pipeline"},
      // The value given stays as given, though "zero" is also the name of an option.
      {{"--strategy", "zero"}, "unknown --strategy 'zero': choose single, ddp, fsdp"},
      {{"--strategy", "fsdp", "--amp", "O2"},
       "--strategy fsdp keeps fp32 shards as the master weights: use --amp O0 or O1 (autocast), "
       "or bf16 shards through --fsdp-param-dtype, not O2"},
      {{"--strategy", "dp"}, "--strategy dp needs --devices"},
      {{"--devices", "cpu"}, "--devices goes with --strategy dp or pipeline"},
      {{"--chunks", "2"}, "--chunks and --schedule go with --strategy pipeline or --pp P"},
      {{"--stages", "3"}, "--stages goes with --strategy pipeline (on a mesh: --pp P)"},
      {{"--strategy", "pipeline", "--model", "linear", "--stages", "3"},
       "pipeline: 3 stages but the model has only 2 layers"},
      {{"--strategy", "pipeline", "--chunks", "0"}, "--chunks must be >= 1, got 0"},
      {{"--strategy", "pipeline", "--chunks", "65", "--batch-size", "64"},
       "--chunks (65) is larger than --batch-size (64)"},
      {{"--strategy", "pipeline", "--schedule", "interleaved"},
       "unknown schedule 'interleaved': choose gpipe or 1f1b"},
      {{"--strategy", "pipeline", "--stages", "2", "--devices", "cpu"},
       "--devices names 1 devices for 2 stages"},
      {{"--strategy", "dp", "--devices", ","}, "--devices is empty"},
      {{"--strategy", "dp", "--devices", "cpu,gpu"}, "bad device 'gpu' in --devices"},
      {{"--strategy", "dp", "--devices", "cpu:3"}, "device cpu:3 does not exist"},
      {{"--batch-size", "0"}, "--batch-size must be >= 1, got 0"},
      {{"--tp", "2", "--strategy", "ddp"}, "--tp goes with --strategy fsdp (got --strategy ddp)"},
      {{"--no-loss-parallel"}, "--no-loss-parallel goes with --tp T"},
      {{"--tp", "2", "--model", "mlp"}, "--tp splits a GPT's heads, MLP and vocabulary"},
      {{"--dp-replicate", "2"},
       "dp_replicate 2 x dp_shard -1 (the rest) x tp 1 x pp 1 does not make the world's 1 ranks"},
      {{"--pp", "2"}, "--pp cuts a GPT between its blocks: use --model gpt or a GPT-2 preset"},
      {{"--nproc-per-node", "-1"},
       "--nproc-per-node needs --strategy ddp or fsdp and a positive count"},
      {{"--nproc", "2"}, "--nproc-per-node needs --strategy ddp or fsdp"},  // the earlier spelling
      {{"--epochs", "0"}, "--epochs must be >= 1, got 0"},
      {{"--data-dir", "/nonexistent"},
       "Fashion-MNIST: /nonexistent/train-images-idx3-ubyte.gz does not exist"},
      {{"--model", "mlp", "--load-weights", linear_weights},
       "weights do not match the model: missing tensor(s) bn0.bias"},
      {{"--model", "mlp", "--load-weights", bad_file},
       "is not a valid safetensors file: shorter than its 8-byte header length"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv{cli_path(), "train", "--steps", "1"};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    auto r = run_cli(argv);
    EXPECT_NE(r.exit_code, 0) << c.message;
    EXPECT_NE(r.output.find(c.message), std::string::npos)
        << "expected '" << c.message << "' in: " << r.output;
  }
  std::remove(bad_file.c_str());
  std::remove(linear_weights.c_str());
}

// The last number after `key` in `text` (a --json row's "test_loss": ...); -1 when there is none.
double last_number_after(const std::string& text, const std::string& key) {
  const auto at = text.rfind(key);
  return at == std::string::npos ? -1 : std::stod(text.substr(at + key.size()));
}

// The GPL's text as byte tokens in a fresh directory (`paratrain data tokenize --bytes`): the
// directory, or "" with `why` set when the text is missing or tokenizing failed.
std::string gpl_token_dir(const std::string& name, std::string& why) {
  const std::string text = "/usr/share/common-licenses/GPL-3";
  if (::access(text.c_str(), R_OK) != 0) {
    why = text + " is missing (Debian's base-files package installs it)";
    return "";
  }
  const std::string dir = make_temp_dir(name);
  const auto made = run_cli({cli_path(), "data", "tokenize", "--bytes", text, "--out", dir});
  if (made.exit_code != 0) {
    why = "tokenize failed: " + made.output;
    return "";
  }
  return dir;
}

// `paratrain train` of the small GPT the byte-level tests train (2 blocks of width 64, 4 heads,
// a context of 64 bytes) on the tokens in `dir`, then `extra`.
std::vector<std::string> small_gpt_on_bytes(const std::string& dir,
                                            const std::vector<std::string>& extra) {
  std::vector<std::string> argv{cli_path(),  "train", "--model",   "gpt",    "--layers",   "2",
                                "--width",   "64",    "--heads",   "4",      "--vocab",    "256",
                                "--context", "64",    "--dataset", "tokens", "--data-dir", dir};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

TEST(Train, GptOnBytesLearns) {  // ctest: slow 20
  // nanoGPT's shakespeare_char at the byte level, on the GPL's text: a 2-layer GPT of width 64
  // with a context of 64 bytes, 10 epochs of 31 steps of 16 windows. Its validation loss starts
  // at log(256) = 5.55 (uniform over the bytes); English text's bytes alone (their unigram
  // frequencies) give about 2.9, and a model that has learnt anything of the order of letters
  // goes below that within these steps. One thread, as ctest runs it: with OpenBLAS on two the
  // sums round otherwise, and 310 steps later the loss was 3.04 against 2.98 with one.
  std::string why;
  const std::string dir = gpl_token_dir("gpt-bytes", why);
  if (dir.empty()) {
    ASSERT_NE(why.find("is missing"), std::string::npos) << why;
    GTEST_SKIP() << why;
  }
  auto r =
      run_process(small_gpt_on_bytes(dir, {"--optimizer", "adam", "--lr", "3e-3", "--batch-size",
                                           "16", "--epochs", "10", "--device", "cpu", "--json",
                                           "--metrics", dir + "/metrics.jsonl"}),
                  {kCpuOnly, {"OMP_NUM_THREADS", "1"}}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("model gpt (2 layers, width 64, 4 heads, context 64, vocab 256; "),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("\"tokens_per_sec\": "), std::string::npos) << r.output;
  const double val_loss = last_number_after(r.output, "\"test_loss\": ");
  ASSERT_GT(val_loss, 0) << r.output;
  EXPECT_LT(val_loss, 3.0) << r.output;
  // The metrics file's last epoch row says the same.
  std::ifstream in(dir + "/metrics.jsonl");
  std::string rows((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NEAR(last_number_after(rows, "\"val_loss\":"), val_loss, 1e-3) << rows;
  remove_tree(dir);
}

// A GPT on a 2-D mesh (tensor parallel over 2 ranks with sequence and loss parallel, FSDP over 2)
// sees the batches of 2 data-parallel ranks, as plain FSDP on 2 ranks does: the same losses,
// within what the split matmuls' rounding gives (measured 5e-7 on the first epoch).
TEST(Train, GptOnAMeshTrainsAsFsdp) {
  std::string why;
  const std::string dir = gpl_token_dir("gpt-mesh", why);
  if (dir.empty()) {
    ASSERT_NE(why.find("is missing"), std::string::npos) << why;
    GTEST_SKIP() << why;
  }
  std::vector<std::string> base =
      small_gpt_on_bytes(dir, {"--optimizer", "adam", "--lr", "3e-3", "--batch-size", "16",
                               "--steps", "8", "--clip-grad-norm", "1.0", "--json"});
  std::vector<double> losses;
  for (const auto& extra : std::vector<std::vector<std::string>>{
           {"--nproc-per-node", "2", "--strategy", "fsdp"},
           {"--nproc-per-node", "4", "--tp", "2", "--dp-shard", "2"}}) {
    std::vector<std::string> argv = base;
    argv.insert(argv.end(), extra.begin(), extra.end());
    auto r = run_process(argv, {kCpuOnly}, 300);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    losses.push_back(last_number_after(r.output, "\"train_loss\": "));
    losses.push_back(last_number_after(r.output, "\"test_loss\": "));
    if (extra.size() > 4) {
      EXPECT_NE(r.output.find("strategy fsdp on mesh dp_shard=2 x tp=2 with sequence parallel, "
                              "loss parallel, 4 ranks"),
                std::string::npos)
          << r.output;
    }
  }
  EXPECT_GT(losses[0], 0);
  EXPECT_NEAR(losses[2], losses[0], 1e-5);
  EXPECT_NEAR(losses[3], losses[1], 1e-5);
  remove_tree(dir);
}

// The fused optimizer under the sharding strategies: ZeRO's local optimizer and FSDP's flat
// shards are contiguous fp32 CPU tensors, so the pass runs there, and training goes as DDP's
// with libtorch's AdamW.
TEST(Train, FusedOptimizerUnderZeroAndFsdp) {
  std::string why;
  const std::string dir = gpl_token_dir("gpt-fused", why);
  if (dir.empty()) {
    ASSERT_NE(why.find("is missing"), std::string::npos) << why;
    GTEST_SKIP() << why;
  }
  std::vector<std::string> base =
      small_gpt_on_bytes(dir, {"--optimizer", "adamw", "--weight-decay", "0.1", "--lr", "3e-3",
                               "--batch-size", "16", "--steps", "8", "--json"});
  std::vector<double> losses;
  for (const auto& extra : std::vector<std::vector<std::string>>{
           {"--nproc-per-node", "2", "--strategy", "ddp"},
           {"--nproc-per-node", "2", "--strategy", "ddp", "--zero", "--fused-optimizer"},
           {"--nproc-per-node", "2", "--strategy", "fsdp", "--fused-optimizer"}}) {
    std::vector<std::string> argv = base;
    argv.insert(argv.end(), extra.begin(), extra.end());
    auto r = run_process(argv, {kCpuOnly}, 300);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    losses.push_back(last_number_after(r.output, "\"train_loss\": "));
    losses.push_back(last_number_after(r.output, "\"test_loss\": "));
    if (extra.back() == "--fused-optimizer") {
      EXPECT_NE(r.output.find("adamw (fused, "), std::string::npos) << r.output;
      // Every step ran the pass: none fell back to libtorch's (which says so).
      EXPECT_EQ(r.output.find("fused optimizer:"), std::string::npos) << r.output;
    }
  }
  EXPECT_GT(losses[0], 0);
  for (size_t i = 2; i < losses.size(); ++i) {
    EXPECT_NEAR(losses[i], losses[i % 2], 1e-5) << i;
  }
  remove_tree(dir);
}

// paratrain train --offload on 2 FSDP ranks: every part in a file or in host memory, with
// gradient accumulation and clipping, ends with the same bytes as training in memory; and
// ZeRO's optimizer state offloaded trains as ZeRO in memory.
TEST(Train, OffloadIsBitwiseEqualToTrainingInMemory) {  // ctest: slow 12
  std::string why;
  const std::string dir = gpl_token_dir("gpt-offload", why);
  if (dir.empty()) {
    ASSERT_NE(why.find("is missing"), std::string::npos) << why;
    GTEST_SKIP() << why;
  }
  const std::string scratch = make_temp_dir("offload-scratch");
  const std::vector<std::string> base =
      small_gpt_on_bytes(dir, {"--optimizer", "adamw", "--weight-decay", "0.1", "--lr", "3e-3",
                               "--batch-size", "8", "--steps", "10", "--accumulate", "2",
                               "--strategy", "fsdp", "--nproc-per-node", "2", "--fused-optimizer"});
  const std::vector<std::string> clip{"--clip-grad-norm", "0.5"};
  struct Run {
    std::string name;
    std::vector<std::string> extra;
    std::string reference;  // the run in memory it must equal
  };
  // Clipped: every part offloaded, stepped after backward. Not clipped: the optimizer's moments
  // offloaded are stepped unit by unit in backward (the optimizer in backward). ZeRO: its local
  // optimizer's moments offloaded.
  const std::vector<Run> runs{
      {"memory", clip, ""},
      {"all", {"--offload", "all", "--offload-dir", scratch, clip[0], clip[1]}, "memory"},
      {"optimizer,gradients",
       {"--offload", "optimizer,gradients", "--offload-dir", scratch, clip[0], clip[1]},
       "memory"},
      {"optimizer,params,host", {"--offload", "optimizer,params,host", clip[0], clip[1]}, "memory"},
      {"unclipped", {}, ""},
      {"in-backward", {"--offload", "optimizer", "--offload-dir", scratch}, "unclipped"},
      {"in-backward,params,host", {"--offload", "optimizer,params,host"}, "unclipped"},
      {"zero", {"--strategy", "ddp", "--zero"}, ""},
      {"zero-offload", {"--strategy", "ddp", "--zero", "--offload", "host"}, "zero"}};
  std::map<std::string, std::string> weights;
  for (const auto& run : runs) {
    std::vector<std::string> argv = base;
    argv.insert(argv.end(), run.extra.begin(), run.extra.end());
    const std::string file = scratch + "/" + run.name + ".safetensors";
    argv.insert(argv.end(), {"--save-weights", file});
    auto r = run_process(argv, {kCpuOnly}, 300);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    weights[run.name] = file_bytes(file);
    EXPECT_FALSE(weights[run.name].empty()) << run.name;
    if (!run.reference.empty()) {
      EXPECT_NE(r.output.find(", offload "), std::string::npos) << r.output;
      EXPECT_EQ(weights[run.name], weights[run.reference])
          << run.name << " differs from training in memory";
    }
  }
  EXPECT_NE(weights["memory"], weights["unclipped"]) << "clipping changed nothing";
  EXPECT_EQ(files_in(scratch).size(), weights.size()) << "offload files left behind";
  remove_tree(scratch);
  remove_tree(dir);
}

// Each refusal is one line and a non-zero exit, before any rank starts.
TEST(Train, OffloadBadInput) {
  const std::string dir = make_temp_dir("offload-bad");
  data::write_tokens(dir + "/train.bin", std::vector<uint16_t>(3000, 'a'));
  data::write_tokens(dir + "/val.bin", std::vector<uint16_t>(300, 'b'));
  const std::vector<std::string> gpt{
      "--model",   "gpt",    "--layers",   "1",   "--width",     "8",
      "--heads",   "2",      "--vocab",    "256", "--context",   "16",
      "--dataset", "tokens", "--data-dir", dir,   "--optimizer", "adam"};
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  std::vector<Case> cases{
      {{"--strategy", "ddp", "--offload", "optimizer", "--offload-dir", dir},
       "--strategy ddp keeps the whole state on every rank: add --zero"},
      {{"--strategy", "single", "--offload", "host"}, "shards nothing: use --strategy fsdp"},
      {{"--strategy", "ddp", "--zero", "--offload", "optimizer,gradients", "--offload-dir", dir},
       "offload gradients and params with --strategy fsdp"},
      {{"--strategy", "fsdp", "--offload", "optimizer", "--offload-dir", dir + "/missing"},
       "does not exist"},
      {{"--strategy", "fsdp", "--offload", "optimizer"}, "--offload needs --offload-dir DIR"},
      {{"--strategy", "fsdp", "--offload", "host", "--offload-dir", dir}, "give one of them"},
      {{"--strategy", "fsdp", "--offload", "weights", "--offload-dir", dir},
       "unknown --offload part 'weights'"},
      {{"--strategy", "fsdp", "--offload-dir", dir}, "add --offload optimizer"},
      {{"--strategy", "fsdp", "--offload", "gradients", "--offload-dir", dir},
       "offload the optimizer too"},
  };
  struct statfs fs {};
  if (::statfs("/dev/shm", &fs) == 0 && fs.f_type == 0x01021994) {  // TMPFS_MAGIC
    cases.push_back({{"--strategy", "fsdp", "--offload", "optimizer", "--offload-dir", "/dev/shm"},
                     "tmpfs, which is memory"});
  }
  // A disk without room for what the ranks will write: an 8 MiB ext4 the test mounts (root).
  const std::string mnt = dir + "/small";
  const std::string mount = "mkdir -p " + mnt + " && truncate -s 8M " + dir + "/disk.img && " +
                            "mkfs.ext4 -q " + dir + "/disk.img 2>/dev/null && mount -o loop " +
                            dir + "/disk.img " + mnt + " 2>/dev/null";
  const bool mounted = ::geteuid() == 0 && std::system(mount.c_str()) == 0;
  if (mounted) {
    cases.push_back({{"--strategy", "fsdp", "--offload", "all", "--offload-dir", mnt, "--layers",
                      "4", "--width", "256", "--heads", "4"},
                     "free space or choose another directory"});
  } else {
    std::cout << "[ note ] cannot mount a small ext4 here (root and loop devices): the "
                 "free-space refusal is not exercised\n";
  }
  for (const auto& c : cases) {
    std::vector<std::string> argv{cli_path(), "train"};
    argv.insert(argv.end(), gpt.begin(), gpt.end());
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    if (std::find(c.args.begin(), c.args.end(), "--strategy") != c.args.end() &&
        std::find(c.args.begin(), c.args.end(), "single") == c.args.end()) {
      argv.insert(argv.end(), {"--nproc-per-node", "2"});
    }
    auto r = run_process(argv, {kCpuOnly}, 120);
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(c.message), std::string::npos) << c.message << "\n" << r.output;
    EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos) << r.output;
  }
  if (mounted) {
    ::umount2(mnt.c_str(), MNT_DETACH);
  }
  remove_tree(dir);
}

TEST(Train, GptBadInput) {
  const std::string dir = make_temp_dir("gpt-bad");
  {
    data::write_tokens(dir + "/train.bin", std::vector<uint16_t>(300, 'a'));
    std::vector<uint16_t> val(100, 'b');
    val[50] = 300;  // outside a byte vocabulary; the validation windows read every position
    data::write_tokens(dir + "/val.bin", val);
  }
  const std::vector<std::string> tokens{"--dataset", "tokens", "--data-dir", dir};
  const std::vector<std::string> shape{"--layers", "1", "--width", "8", "--heads", "2"};
  struct Case {
    std::vector<std::vector<std::string>> args;
    std::string message;
  };
  const std::vector<Case> cases{
      {{{"--model", "gpt"}, tokens}, "--model gpt needs its shape: --layers L --width D --heads H"},
      {{{"--model", "gpt", "--layers", "2", "--width", "64"}, tokens},
       "--model gpt needs its shape"},
      {{{"--model", "mlp"}, tokens}, "--dataset tokens trains a language model"},
      {{{"--model", "gpt2"}},
       "--model gpt2 is a language model: train it on token files with --dataset tokens"},
      {{{"--model", "gpt", "--dataset", "imagefolder", "--data-dir", dir}, shape},
       "--model gpt is a language model"},
      {{{"--model", "gpt2", "--context", "2048"}, tokens},
       "--context 2048 is longer than gpt2's context of 1024"},
      {{{"--model", "gpt2-medium"}, shape, tokens},
       "--layers, --width and --heads shape --model gpt; gpt2-medium has its own"},
      {{{"--model", "mlp", "--vocab", "256"}},
       "--vocab goes with --model gpt or a GPT-2 preset (got --model mlp)"},
      {{{"--model", "gpt", "--layers", "1", "--width", "60", "--heads", "8"}, tokens},
       "--width 60 is not a multiple of --heads 8"},
      {{{"--model", "gpt", "--context", "0"}, shape, tokens},
       "--layers, --width, --heads, --vocab and --context must be >= 1"},
      {{{"--model", "gpt", "--image-size", "32"}, shape, tokens},
       "--image-size goes with the image models; --model gpt is a GPT"},
      {{{"--model", "gpt2", "--dataset", "tokens"}}, "--dataset tokens needs --data-dir D"},
      {{{"--model", "gpt", "--dataset", "tokens", "--data-dir", dir + "/nope"}, shape},
       "TokenDataset: cannot open " + dir + "/nope/train.bin: No such file or directory"},
      {{{"--model", "gpt", "--context", "400"}, shape, tokens},
       "TokenDataset: " + dir + "/train.bin holds 300 tokens, fewer than the 401"},
      {{{"--model", "vgg"}}, "gpt2, gpt2-medium, gpt2-large, gpt2-xl"},  // listed with the rest
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv{cli_path(), "train", "--steps", "1"};
    for (const auto& part : c.args) {
      argv.insert(argv.end(), part.begin(), part.end());
    }
    auto r = run_cli(argv);
    EXPECT_NE(r.exit_code, 0) << c.message;
    EXPECT_NE(r.output.find(c.message), std::string::npos)
        << "expected '" << c.message << "' in: " << r.output;
  }
  // A token outside --vocab is found when its window is read, here by the evaluation after the
  // first step: in a process of its own, as the run gets as far as training.
  auto r = run_process(
      {cli_path(),   "train", "--model", "gpt", "--layers",  "1",  "--width",   "8",
       "--heads",    "2",     "--vocab", "256", "--context", "16", "--dataset", "tokens",
       "--data-dir", dir,     "--steps", "1",   "--device",  "cpu"},
      {kCpuOnly}, 120);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("TokenDataset: " + dir +
                          "/val.bin: token 300 at position 50 is "
                          "outside the vocabulary of 256"),
            std::string::npos)
      << r.output;
  remove_tree(dir);
}

TEST(Cli, HelpListsEveryCommandAndBenchmark) {
  auto r = run_process({cli_path(), "--help"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* row : {"  info ", "  launch [opts] -- PROG ", "  train [opts] ", "  data ",
                          "  tune ", "  generate [opts] ", "  bench <name> [opts] "}) {
    EXPECT_NE(r.output.find(row), std::string::npos) << row << " is missing from\n" << r.output;
  }
  // The benchmarks are their own program, which `paratrain bench` runs.
  auto bench = run_process({cli_path(), "bench", "--help"});
  EXPECT_EQ(bench.exit_code, 0) << bench.output;
  for (const char* row : {"  allreduce ", "  ddp ", "  strategies ", "  pipeline ", "  amp ",
                          "  amp-accuracy ", "  faults ", "  tune ", "  cluster ", "  data "}) {
    EXPECT_NE(bench.output.find(row), std::string::npos) << row << " is missing from\n"
                                                         << bench.output;
  }
  auto unknown = run_process({cli_path(), "bench", "allreduse"});
  EXPECT_EQ(unknown.exit_code, 2) << unknown.output;
  EXPECT_NE(unknown.output.find("unknown benchmark 'allreduse'; available: allreduce, ddp, "
                                "strategies, pipeline, amp"),
            std::string::npos)
      << unknown.output;
  auto command = run_process({cli_path(), "trian"});
  EXPECT_EQ(command.exit_code, 2) << command.output;
  EXPECT_NE(command.output.find("unknown command 'trian'"), std::string::npos) << command.output;
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
