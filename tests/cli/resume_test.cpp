// Exact resume through `paratrain train`: a run SIGKILLed at a random step and resumed with
// --resume auto ends with weights bitwise equal to an uninterrupted run, for every strategy, for
// AMP O1 and O2, across an epoch boundary, and under --max-restarts. Also the bad input of the
// checkpoint, resume and restart flags.

#include "test_util.h"

#include <paratrain/io/checkpoint.h>
#include <paratrain/io/safetensors.h>

#include <torch/torch.h>

#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace paratrain {
namespace testing {
namespace {

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// 2 epochs of 8 steps of the mlp on Fashion-MNIST, plus `extra`.
std::vector<std::string> job(const std::vector<std::string>& extra) {
  std::vector<std::string> argv{cli_path(), "train", "--model",      "mlp", "--epochs",  "2",
                                "--steps",  "8",     "--batch-size", "32",  "--workers", "1"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

std::vector<std::string> plus(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Kills rank `ranks`-1 or below at a random step of the 16, resumes, and compares the weights
// with an uninterrupted run's, byte for byte.
// A kill at step `first` or later must resume from a checkpoint: checkpoints are written in the
// background, and save() waits for the previous write, so with --checkpoint-every 3 the one of
// step 3 is on disk once step 6 ends. Earlier kills may find none.
// `make_job` makes the job of 16 steps from the flags (job(): the mlp's).
void expect_exact_resume(
    const std::vector<std::string>& extra,
    int ranks,
    const std::vector<std::string>& checkpoints = {"--checkpoint-every", "3"},
    int first = 6,
    const std::function<std::vector<std::string>(const std::vector<std::string>&)>& make_job =
        job) {
  std::random_device seed;
  std::mt19937 rng(seed());
  const int kill_step = std::uniform_int_distribution<int>(1, 15)(rng);
  const int kill_rank = std::uniform_int_distribution<int>(0, ranks - 1)(rng);
  SCOPED_TRACE("killed at step " + std::to_string(kill_step) + " on rank " +
               std::to_string(kill_rank));
  const std::string base = "/tmp/" + unique_token("resume");
  const std::string whole = base + "-whole.safetensors";
  const std::string resumed = base + "-resumed.safetensors";
  const std::string dir = base + "-ckpt";
  const std::map<std::string, std::string> env{kCpuOnly, {"PARATRAIN_TIMEOUT", "60"}};

  auto a = run_process(make_job(plus(extra, {"--save-weights", whole})), env, 300);
  ASSERT_EQ(a.exit_code, 0) << a.output;

  auto killed_env = env;
  killed_env["PARATRAIN_FAULT_AT_STEP"] = std::to_string(kill_step);
  killed_env["PARATRAIN_FAULT_RANK"] = std::to_string(kill_rank);
  const auto with_ckpt =
      plus(plus(extra, {"--checkpoint-dir", dir, "--resume", "auto"}), checkpoints);
  auto b = run_process(make_job(with_ckpt), killed_env, 300);
  ASSERT_TRUE(b.signal == 9 || b.exit_code == 137) << "exit " << b.exit_code << "\n" << b.output;

  // An earlier kill can also leave the first checkpoint incomplete: rank 0's manifest written
  // and a killed rank's file not, which the resume refuses as damaged unless told to start over.
  const std::vector<std::string> again = kill_step >= first
                                             ? std::vector<std::string>{}
                                             : std::vector<std::string>{"--start-fresh-if-damaged"};
  auto c =
      run_process(make_job(plus(plus(with_ckpt, again), {"--save-weights", resumed})), env, 300);
  ASSERT_EQ(c.exit_code, 0) << c.output;
  if (kill_step >= first) {
    EXPECT_NE(c.output.find("resumed from "), std::string::npos) << c.output;
  } else {
    EXPECT_TRUE(c.output.find("resumed from ") != std::string::npos ||
                c.output.find("no checkpoint in ") != std::string::npos ||
                c.output.find("is damaged: starting from step 0") != std::string::npos)
        << c.output;
  }
  if (ranks > 1) {
    // Rank 0 prunes every rank's files: at most --keep (3) checkpoints of rank 1 stay.
    auto ls =
        run_process({"/bin/sh", "-c", "ls '" + dir + "' | grep -c 'rank-1.safetensors$'"}, {}, 10);
    ASSERT_EQ(ls.exit_code, 0) << ls.output;
    EXPECT_LE(std::atoi(ls.output.c_str()), 3) << ls.output;
    EXPECT_GE(std::atoi(ls.output.c_str()), 1) << ls.output;
  }
  const std::string wa = read_bytes(whole);
  ASSERT_GT(wa.size(), 1000u);
  EXPECT_TRUE(wa == read_bytes(resumed)) << "the resumed run's weights differ\n" << c.output;
  remove_with_prefix(base);
}

TEST(Resume, SingleProcess) {
  expect_exact_resume({}, 1);
}

TEST(Resume, DdpOnGloo) {
  expect_exact_resume({"--strategy", "ddp", "--nproc-per-node", "2", "--backend", "gloo"}, 2);
}

// HSDP (a mesh of 2 replicas of a shard each): the MLP's BatchNorm statistics come back too.
TEST(Resume, HsdpOnAMesh) {
  expect_exact_resume({"--dp-replicate", "2", "--nproc-per-node", "2"}, 2);
}

// A GPT of 4 heads on bytes of text, 2 epochs of 8 steps.
std::vector<std::string> gpt_job(const std::string& tokens, const std::vector<std::string>& extra) {
  return plus(
      {cli_path(),    "train", "--model",  "gpt",  "--layers",  "2",  "--width",      "32",
       "--heads",     "4",     "--vocab",  "256",  "--context", "32", "--dataset",    "tokens",
       "--data-dir",  tokens,  "--epochs", "2",    "--steps",   "8",  "--batch-size", "4",
       "--optimizer", "adam",  "--lr",     "3e-3", "--device",  "cpu"},
      extra);
}

// A 2-D mesh (tensor parallel over 2 ranks with sequence and loss parallel, FSDP over 2).
TEST(Resume, TensorParallelTimesFsdp) {  // ctest: slow 30
  const std::string text = "/usr/share/common-licenses/GPL-3";
  if (!std::ifstream(text).good()) {
    GTEST_SKIP() << text << " is missing (Debian's base-files ships it)";
  }
  const std::string tokens = "/tmp/" + unique_token("tp-resume-tok");
  auto tok = run_process({cli_path(), "data", "tokenize", "--bytes", text, "--out", tokens});
  ASSERT_EQ(tok.exit_code, 0) << tok.output;
  expect_exact_resume(
      {"--tp", "2", "--dp-shard", "2", "--nproc-per-node", "4"}, 4, {"--checkpoint-every", "3"}, 6,
      [&](const std::vector<std::string>& extra) { return gpt_job(tokens, extra); });
  remove_with_prefix(tokens);
}

#ifdef PARATRAIN_WITH_MPI
TEST(Resume, DdpOnMpi) {  // ctest: slow 12
  expect_exact_resume({"--strategy", "ddp", "--nproc", "2", "--backend", "mpi"}, 2);
}
#endif

TEST(Resume, DataParallel) {
  // linear: the mlp's Dropout draws from the one CPU generator in both replica threads, in an
  // order that differs from run to run (README, Known problems); CUDA replicas each have theirs.
  expect_exact_resume({"--strategy", "dp", "--devices", "cpu,cpu", "--model", "linear"}, 1);
}

TEST(Resume, Pipeline) {
  expect_exact_resume({"--strategy", "pipeline", "--stages", "2", "--chunks", "4"}, 1);
}

TEST(Resume, AmpO1AndO2Bf16) {
  expect_exact_resume({"--amp", "O1", "--amp-dtype", "bf16"}, 1);
  expect_exact_resume({"--amp", "O2", "--amp-dtype", "bf16", "--optimizer", "adamw"}, 1);
}

TEST(Resume, AcrossAnEpochBoundary) {
  // Checkpoints every 4 steps and at each epoch's end (step 8 has both), an lr schedule per
  // epoch: a kill from step 12 on resumes in epoch 2 from a checkpoint of epoch 1's end or later.
  expect_exact_resume({"--lr-schedule", "step", "--lr-step-size", "1", "--lr-gamma", "0.5"}, 1,
                      {"--checkpoint-every", "4", "--checkpoint-every-epoch"}, 12);
}

TEST(Resume, MaxRestartsContinuesFromTheLastCheckpoint) {
  const std::string base = "/tmp/" + unique_token("restarts");
  const std::map<std::string, std::string> env{kCpuOnly, {"PARATRAIN_TIMEOUT", "60"}};
  const std::vector<std::string> ddp{"--strategy", "ddp", "--nproc", "2", "--backend", "gloo"};
  auto a = run_process(job(plus(ddp, {"--save-weights", base + "-a.safetensors"})), env, 300);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  auto killed_env = env;
  killed_env["PARATRAIN_FAULT_AT_STEP"] = "10";
  killed_env["PARATRAIN_FAULT_RANK"] = "1";
  auto b = run_process(
      job(plus(ddp, {"--checkpoint-dir", base + "-ckpt", "--checkpoint-every", "4", "--resume",
                     "auto", "--max-restarts", "2", "--save-weights", base + "-b.safetensors"})),
      killed_env, 300);
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_NE(b.output.find("rank 1 (pid "), std::string::npos) << b.output;
  EXPECT_NE(b.output.find("restarting all (restart 1 of 2)"), std::string::npos) << b.output;
  EXPECT_NE(b.output.find("resumed from "), std::string::npos) << b.output;
  // From step 8, or from 4 when the kill came before checkpoint 8 was on disk.
  EXPECT_TRUE(b.output.find("ckpt-0000000008.json (step 8") != std::string::npos ||
              b.output.find("ckpt-0000000004.json (step 4") != std::string::npos)
      << b.output;
  EXPECT_TRUE(read_bytes(base + "-a.safetensors") == read_bytes(base + "-b.safetensors"));
  remove_with_prefix(base);
}

TEST(Train, CheckReplicasNamesTheRankThatDiverged) {
  // Rank 1's weights are nudged after step 3; the check at step 4 names it.
  auto r = run_process(
      job({"--strategy", "ddp", "--nproc", "2", "--backend", "gloo", "--check-replicas", "2"}),
      {kCpuOnly,
       {"PARATRAIN_TIMEOUT", "60"},
       {"PARATRAIN_FAULT_AT_STEP", "3"},
       {"PARATRAIN_FAULT_RANK", "1"},
       {"PARATRAIN_FAULT", "perturb"}},
      300);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("the replicas diverged at step 4: rank(s) 1 hold weights that differ "
                          "from rank 0's, first in 'linear2.bias'"),
            std::string::npos)
      << r.output;
  // Without the nudge the same job passes every check.
  auto ok = run_process(
      job({"--strategy", "ddp", "--nproc", "2", "--backend", "gloo", "--check-replicas", "1"}),
      {kCpuOnly, {"PARATRAIN_TIMEOUT", "60"}}, 300);
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
}

TEST(Train, TraceHoldsEveryRanksSpans) {
  const std::string base = "/tmp/" + unique_token("trace");
  auto r = run_process(
      job({"--strategy", "ddp", "--nproc", "2", "--backend", "gloo", "--epochs", "1", "--steps",
           "3", "--checkpoint-dir", base + "-ckpt", "--trace", base + ".json"}),
      {kCpuOnly, {"PARATRAIN_TIMEOUT", "60"}}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Read back by Python's json module: spans per (rank, name), each a complete event.
  auto count =
      run_process({test_python(), "-c",
                   "import json, sys, collections\n"
                   "events = json.load(open(sys.argv[1]))['traceEvents']\n"
                   "spans = [e for e in events if e['ph'] == 'X']\n"
                   "assert all(e['dur'] >= 0 and e['ts'] > 0 for e in spans)\n"
                   "c = collections.Counter('%d %s' % (e['pid'], e['name']) for e in spans)\n"
                   "print(';'.join('%s=%d' % kv for kv in sorted(c.items())))\n",
                   base + ".json"},
                  {}, 60);
  ASSERT_EQ(count.exit_code, 0) << count.output;
  for (int rank : {0, 1}) {
    const std::string p = std::to_string(rank) + " ";
    for (const std::string name : {"forward=3", "backward=3", "optimizer step=3", "data wait=3",
                                   "allreduce bucket 0=3", "checkpoint write=1"}) {
      EXPECT_NE(count.output.find(p + name), std::string::npos)
          << p + name << " in " << count.output;
    }
  }
  remove_with_prefix(base);
}

// ZeRO's checkpoints hold the consolidated state, SyncBatchNorm's layers keep BatchNorm's names.
TEST(Resume, DdpWithZeroAndSyncBatchNorm) {
  expect_exact_resume({"--strategy", "ddp", "--nproc", "2", "--backend", "gloo", "--zero",
                       "--sync-bn", "--optimizer", "adam", "--lr", "0.001"},
                      2);
}

// Flags of an elastic ZeRO job with Adam that checkpoints every 4 steps into `dir`.
std::vector<std::string> zero_job(const std::string& layout, const std::string& dir, int ranks) {
  return {"--strategy", "ddp",
          "--backend",  "gloo",
          "--nproc",    std::to_string(ranks),
          "--zero",     "--optimizer",
          "adam",       "--lr",
          "0.001",      "--zero-checkpoint",
          layout,       "--checkpoint-dir",
          dir,          "--checkpoint-every",
          "4"};
}

// ZeRO's checkpoints either way (--zero-checkpoint): consolidated in rank 0's shared file, or each
// rank's shard in its own file. An elastic job of 3 ranks killed at step 10 is resumed from its
// checkpoint of step 4 (on disk once step 8 ended: each save waits for the one before) on 2
// ranks: from shards each rank must gather its new part from all three old files, and both
// layouts must end with the very same weights.
TEST(Resume, ShardedZeroCheckpointResumesOnAnotherWorldSize) {  // ctest: slow 13
  const std::string base = "/tmp/" + unique_token("zeroshard");
  std::map<std::string, std::string> env{
      kCpuOnly, {"PARATRAIN_TIMEOUT", "60"}, {"PARATRAIN_ELASTIC", "1"}};
  std::map<std::string, std::string> weights;
  for (const std::string layout : {"consolidated", "sharded"}) {
    SCOPED_TRACE(layout);
    const std::string dir = base + "-" + layout;
    auto killed = env;
    killed["PARATRAIN_FAULT_AT_STEP"] = "10";
    killed["PARATRAIN_FAULT_RANK"] = "0";
    auto a = run_process(job(zero_job(layout, dir, 3)), killed, 300);
    ASSERT_TRUE(a.signal == 9 || a.exit_code == 137) << "exit " << a.exit_code << "\n" << a.output;
    // Which files of step 4 hold optimizer state: a safetensors header names its tensors in
    // plain text.
    auto holders = run_process(
        {"/bin/sh", "-c", "cd '" + dir + "' && grep -la 'optim\\.' ckpt-*4.*safetensors | sort"},
        {}, 10);
    const auto files = std::count(holders.output.begin(), holders.output.end(), '\n');
    if (layout == "sharded") {
      for (const char* rank : {".rank-0.", ".rank-1.", ".rank-2."}) {
        EXPECT_NE(holders.output.find(rank), std::string::npos) << holders.output;
      }
      EXPECT_EQ(files, 3) << holders.output;
    } else {
      EXPECT_EQ(holders.output.find(".rank-"), std::string::npos) << holders.output;
      EXPECT_EQ(files, 1) << holders.output;
    }
    const std::string file = base + "-" + layout + ".safetensors";
    const std::string step4 = dir + "/ckpt-0000000004.json";
    auto b = run_process(
        job(plus(zero_job(layout, dir, 2), {"--resume", step4, "--save-weights", file})), env, 300);
    ASSERT_EQ(b.exit_code, 0) << b.output;
    EXPECT_NE(b.output.find("resumed from " + step4), std::string::npos) << b.output;
    weights[layout] = read_bytes(file);
    ASSERT_GT(weights[layout].size(), 1000u);
  }
  EXPECT_TRUE(weights["consolidated"] == weights["sharded"]);
  remove_with_prefix(base);
}

// A sharded checkpoint whose third rank's shard is gone (a rank that died while writing it): a
// resume on 2 ranks checks every shard it would read before it takes a checkpoint, so it falls
// back to the one before instead of failing in the restore on every restart.
TEST(Resume, ShardedZeroCheckpointWithAMissingShardIsSkipped) {
  const std::string base = "/tmp/" + unique_token("zeroshardgone");
  const std::string dir = base + "-ckpt";
  std::map<std::string, std::string> env{
      kCpuOnly, {"PARATRAIN_TIMEOUT", "60"}, {"PARATRAIN_ELASTIC", "1"}};
  auto a = run_process(job(zero_job("sharded", dir, 3)), env, 300);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  ASSERT_EQ(std::remove((dir + "/ckpt-0000000016.rank-2.safetensors").c_str()), 0);
  auto b = run_process(
      job(plus(zero_job("sharded", dir, 2), {"--resume", "auto", "--epochs", "3"})), env, 300);
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_NE(b.output.find("skipping checkpoint ckpt-0000000016"), std::string::npos) << b.output;
  EXPECT_NE(b.output.find("ckpt-0000000016.rank-2.safetensors"), std::string::npos) << b.output;
  EXPECT_NE(b.output.find("resumed from " + dir + "/ckpt-0000000012.json"), std::string::npos)
      << b.output;
  remove_with_prefix(base);
}

// What a resume says is what happened. A resume at an epoch's last step shows no training numbers
// of its own for that epoch (in text and in --json rows). An elastic job resumes a checkpoint of a
// job that was not elastic (the ranks are checked from the manifest, not the config's world size,
// which an elastic job's config leaves open). With an explicit --resume, a rank whose file fails
// its checks stops every rank before any says "resumed from".
TEST(Resume, MessagesSayWhatHappened) {  // ctest: slow 25
  const std::string base = "/tmp/" + unique_token("resumemsg");
  const std::string dir = base + "-ckpt";
  const std::map<std::string, std::string> env{kCpuOnly, {"PARATRAIN_TIMEOUT", "60"}};
  // One epoch of 8 steps with checkpoints at steps 4 and 8: step 8 is the epoch's last.
  auto first = run_process(
      job({"--epochs", "1", "--checkpoint-dir", dir, "--checkpoint-every", "4"}), env, 300);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  auto elastic = env;
  elastic["PARATRAIN_ELASTIC"] = "1";
  auto resumed = run_process(
      job({"--checkpoint-dir", dir, "--checkpoint-every", "4", "--resume", "auto"}), elastic, 300);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from " + dir +
                                "/ckpt-0000000008.json (step 8, epoch 1, batch 8)"),
            std::string::npos)
      << resumed.output;
  EXPECT_NE(resumed.output.find("epoch 1/2: trained before the resume; test_accuracy "),
            std::string::npos)
      << resumed.output;
  EXPECT_EQ(resumed.output.find("train_loss 0.0000"), std::string::npos) << resumed.output;
  EXPECT_NE(resumed.output.find("epoch 2/2: train_loss "), std::string::npos) << resumed.output;

  auto json = run_process(job({"--resume", dir + "/ckpt-0000000008.json", "--json"}), env, 300);
  ASSERT_EQ(json.exit_code, 0) << json.output;
  const size_t row = json.output.find("{\"epoch\": 1, ");
  ASSERT_NE(row, std::string::npos) << json.output;
  const std::string epoch1 = json.output.substr(row, json.output.find('\n', row) - row);
  EXPECT_EQ(epoch1.rfind("{\"epoch\": 1, \"test_accuracy\": ", 0), 0u) << epoch1;
  EXPECT_NE(epoch1.find(", \"resumed\": true}"), std::string::npos) << epoch1;
  EXPECT_EQ(epoch1.find("train_loss"), std::string::npos) << epoch1;
  EXPECT_NE(json.output.find("{\"epoch\": 2, \"train_loss\": "), std::string::npos) << json.output;

  // Two ranks; rank 1's file of step 4 gets a changed byte.
  const std::string ddp_dir = base + "-ddp";
  const std::vector<std::string> ddp{
      "--strategy",         "ddp", "--nproc", "2", "--backend",        "gloo",
      "--epochs",           "1",   "--steps", "4", "--checkpoint-dir", ddp_dir,
      "--checkpoint-every", "4"};
  auto made = run_process(job(ddp), env, 300);
  ASSERT_EQ(made.exit_code, 0) << made.output;
  const std::string rank1 = ddp_dir + "/ckpt-0000000004.rank-1.safetensors";
  {
    std::fstream f(rank1, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-1, std::ios::end);
    const char c = static_cast<char>(f.get());
    f.seekp(-1, std::ios::end);
    f.put(static_cast<char>(c ^ 0x55));
  }
  auto refused =
      run_process(job(plus(ddp, {"--resume", ddp_dir + "/ckpt-0000000004.json"})), env, 300);
  EXPECT_NE(refused.exit_code, 0) << refused.output;
  EXPECT_NE(refused.output.find(rank1 + " fails its CRC-32 check"), std::string::npos)
      << refused.output;
  EXPECT_EQ(refused.output.find("resumed from"), std::string::npos) << refused.output;
  remove_with_prefix(base);
}

// ZeroRedundancyOptimizer steps each parameter as the unsharded optimizer does: the weights are
// the same bytes. SyncBatchNorm normalizes over both ranks' batches: the weights change.
TEST(Train, ZeroEqualsUnshardedAndSyncBatchNormChangesTraining) {
  const std::string base = "/tmp/" + unique_token("zero");
  const std::map<std::string, std::string> env{kCpuOnly, {"PARATRAIN_TIMEOUT", "60"}};
  const std::vector<std::string> ddp{"--strategy", "ddp",  "--nproc",  "2",
                                     "--backend",  "gloo", "--epochs", "1"};
  std::map<std::string, std::vector<std::string>> runs{
      {"plain", {}}, {"zero", {"--zero"}}, {"syncbn", {"--sync-bn"}}};
  std::map<std::string, std::string> weights;
  for (const auto& [name, flags] : runs) {
    const std::string file = base + "-" + name + ".safetensors";
    auto r = run_process(job(plus(plus(ddp, flags), {"--save-weights", file})), env, 300);
    ASSERT_EQ(r.exit_code, 0) << name << "\n" << r.output;
    weights[name] = read_bytes(file);
    ASSERT_GT(weights[name].size(), 1000u) << name;
  }
  EXPECT_TRUE(weights["plain"] == weights["zero"]);
  EXPECT_FALSE(weights["plain"] == weights["syncbn"]);
  remove_with_prefix(base);
}

TEST(Resume, BadInput) {  // ctest: slow 24
  const std::string base = "/tmp/" + unique_token("badresume");
  const std::string dir = base + "-ckpt";
  // A checkpoint of the mlp, to resume another model from.
  auto made =
      run_process(job({"--epochs", "1", "--steps", "2", "--checkpoint-dir", dir}), {kCpuOnly}, 120);
  ASSERT_EQ(made.exit_code, 0) << made.output;
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  std::vector<Case> cases{
      {{"--checkpoint-dir", "/proc/paratrain"},
       "cannot create the checkpoint directory /proc/paratrain"},
      {{"--resume", "/nonexistent/ckpt-0000000001.json"},
       "--resume /nonexistent/ckpt-0000000001.json does not exist"},
      {{"--model", "linear", "--checkpoint-dir", dir, "--resume", "auto"},
       "is from another model: it has no 'fc.bias'"},
      {{"--lr", "0.1", "--checkpoint-dir", dir, "--resume", "auto"},
       "was made with another configuration: 'lr' is 0.05 there and 0.1 in this run"},
      {{"--optimizer", "lamb"}, "unknown --optimizer 'lamb': choose sgd, adam or adamw"},
      {{"--lr-schedule", "poly"}, "unknown lr schedule 'poly'"},
      {{"--strategy", "ddp", "--nproc", "2", "--max-restarts", "-1"},
       "--max-restarts must be >= 0, got -1"},
      {{"--checkpoint-dir", dir, "--keep", "0"}, "--keep must be >= 1, got 0"},
      {{"--keep", "2"}, "--keep needs --checkpoint-dir"},
      {{"--check-replicas", "-1"}, "--check-replicas must be >= 0, got -1"},
      {{"--zero"}, "--zero works across DDP's ranks: add --strategy ddp (got --strategy single)"},
      {{"--strategy", "ddp", "--zero", "--zero-checkpoint", "both"},
       "--zero-checkpoint is 'both': use consolidated or sharded"},
      {{"--strategy", "ddp", "--zero-checkpoint", "sharded"},
       "--zero-checkpoint says how --zero's shards are saved: add --zero"},
      {{"--sync-bn", "--strategy", "dp", "--devices", "cpu,cpu"},
       "--sync-bn works across DDP's ranks: add --strategy ddp (got --strategy dp)"},
      {{"--strategy", "ddp", "--nproc", "2", "--backend", "gloo", "--checkpoint-dir", dir,
        "--resume", "auto"},
       "was made by 1 ranks and this job has 2: start as many ranks, or start it with `paratrain "
       "launch --nnodes MIN:MAX ...`"},
      {{"--strategy", "ddp", "--nproc", "2", "--backend", "gloo", "--checkpoint-dir",
        base + "-keep1", "--keep", "1"},
       "keep at least 2 checkpoints with several ranks, got 1"},
      {{"--checkpoint-dir", dir}, "holds checkpoints of another run: continue it with --resume"},
      {{"--config", base + "-typo.toml"},
       "unknown key 'lr_shedule' in --config " + base +
           "-typo.toml; the nearest valid key is 'lr-schedule'"},
      {{"--config", base + "-section.toml"}, "unknown key 'optim.lr' in --config"},
      {{"--config", base + "-missing.toml"}, "cannot read --config " + base + "-missing.toml"},
      {{"--config", base + "-badvalue.toml"}, "--lr 'fast' is not a number"},
      {{"--lrr", "0.1"}, "unknown option --lrr (the nearest is --lr)"},
      {{"---"}, "unexpected '---'"},
      {{"--config", "/dev/zero"}, "cannot read --config /dev/zero: not a regular file"},
      // A config list is one comma-separated value, not its last element.
      {{"--config", base + "-list.toml"}, "bad --lr-milestones entry 'x'"},
      {{"--data-dir", "/nonexistent-fmnist"},
       "/nonexistent-fmnist/train-images-idx3-ubyte.gz does not exist; install Debian's "
       "dataset-fashion-mnist or give --data-dir the folder that holds its files"},
      {{"--start-fresh-if-damaged"},
       "--start-fresh-if-damaged says what --resume auto does when every checkpoint is damaged: "
       "add --resume auto"},
  };
  { std::ofstream(base + "-typo.toml") << "lr = 0.1\nlr_shedule = \"cosine\"\n"; }
  { std::ofstream(base + "-section.toml") << "[optim]\nlr = 0.1\n"; }
  { std::ofstream(base + "-badvalue.toml") << "lr = \"fast\"\n"; }
  {
    std::ofstream(base + "-list.toml") << "lr-schedule = \"multistep\"\n"
                                          "lr-milestones = [\"x\", 2]\n";
  }
  for (const auto& c : cases) {
    // A case with --nproc starts a launcher and ranks: in a process of its own. The others fail
    // before anything starts: in this one.
    const auto argv = job(plus({"--epochs", "1", "--steps", "1"}, c.args));
    const bool ranks = std::find(c.args.begin(), c.args.end(), "--nproc") != c.args.end() ||
                       std::find(c.args.begin(), c.args.end(), "--nproc-per-node") != c.args.end();
    auto r = ranks ? run_process(argv, {kCpuOnly}, 120) : run_cli(argv, {kCpuOnly});
    EXPECT_NE(r.exit_code, 0) << c.message;
    EXPECT_NE(r.output.find(c.message), std::string::npos)
        << "expected '" << c.message << "' in: " << r.output;
  }
  auto launch = run_cli({cli_path(), "launch", "--max-restarts", "-2", "--", "true"});
  EXPECT_NE(launch.exit_code, 0);
  EXPECT_NE(launch.output.find("--max-restarts must be >= 0, got -2"), std::string::npos)
      << launch.output;

  // Every checkpoint damaged (the one of step 2, cut short): no start from step 0 over it, one
  // line naming the fault and what to do, and nothing deleted.
  const std::string damaged = base + "-damaged";
  std::filesystem::copy(dir, damaged);
  ASSERT_EQ(::truncate((damaged + "/ckpt-0000000002.safetensors").c_str(), 20), 0);
  auto files_in = [&]() {
    std::map<std::string, std::string> out;
    for (const auto& entry : std::filesystem::directory_iterator(damaged)) {
      out[entry.path().filename().string()] = read_bytes(entry.path().string());
    }
    return out;
  };
  const auto before = files_in();
  ASSERT_EQ(before.size(), 3u) << "the checkpoint of step 2: manifest, shared file, rank file";
  const auto auto_resume = job({"--epochs", "1", "--steps", "1", "--checkpoint-dir", damaged,
                                "--checkpoint-every", "1", "--resume", "auto"});
  auto refused = run_cli(auto_resume, {kCpuOnly});
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_NE(refused.output.find("paratrain train: error: every checkpoint in '" + damaged +
                                "' is damaged (1 of them; the newest, ckpt-0000000002: " + damaged +
                                "/ckpt-0000000002.safetensors has 20 bytes"),
            std::string::npos)
      << refused.output;
  EXPECT_NE(refused.output.find("none was loaded and none deleted; move them out of the "
                                "directory, or add --start-fresh-if-damaged to start from step "
                                "0 with them left in place\n"),
            std::string::npos)
      << refused.output;
  EXPECT_EQ(refused.output.find("starting from step 0"), std::string::npos) << refused.output;
  EXPECT_TRUE(files_in() == before);
  // Asked for: a run from step 0 beside it, which stays as it was (the run's own checkpoint is
  // of step 1).
  auto fresh = run_process(plus(auto_resume, {"--start-fresh-if-damaged"}), {kCpuOnly}, 120);
  EXPECT_EQ(fresh.exit_code, 0) << fresh.output;
  EXPECT_NE(fresh.output.find("every checkpoint in " + damaged +
                              " is damaged: starting from step 0, as asked"),
            std::string::npos)
      << fresh.output;
  const auto after = files_in();
  EXPECT_TRUE(after.count("ckpt-0000000001.json"));
  for (const auto& [name, bytes] : before) {
    ASSERT_TRUE(after.count(name)) << name << " was deleted";
    EXPECT_TRUE(after.at(name) == bytes) << name << " changed";
  }
  remove_with_prefix(base);
}

// `--config run.toml` fills the options it names; the command line overrides it; a DDP job's ranks
// read the same file without launching or restarting themselves.
TEST(Train, ConfigFileWithCommandLineOverrides) {
  const std::string base = "/tmp/" + unique_token("config");
  {
    std::ofstream(base + ".toml") << "# a run's settings\nmodel = \"linear\"\nepochs = 1\n"
                                     "steps = 3\nlr = 0.5\noptimizer = \"adam\"\njson = true\n"
                                     "strategy = \"ddp\"\nnproc = 2\nbackend = \"gloo\"\n"
                                     "max-restarts = 1\n";
  }
  auto from_file = run_process({cli_path(), "train", "--config", base + ".toml"}, {kCpuOnly}, 120);
  ASSERT_EQ(from_file.exit_code, 0) << from_file.output;
  EXPECT_NE(from_file.output.find("model linear"), std::string::npos) << from_file.output;
  EXPECT_NE(from_file.output.find("2 ranks (gloo)"), std::string::npos) << from_file.output;
  EXPECT_NE(from_file.output.find("adam lr 0.5,"), std::string::npos) << from_file.output;
  EXPECT_NE(from_file.output.find("{\"epoch\": 1"), std::string::npos) << from_file.output;
  auto overridden = run_process({cli_path(), "train", "--config", base + ".toml", "--lr", "0.01",
                                 "--nproc", "0", "--strategy", "single", "--max-restarts", "0"},
                                {kCpuOnly}, 120);
  ASSERT_EQ(overridden.exit_code, 0) << overridden.output;
  EXPECT_NE(overridden.output.find("adam lr 0.01,"), std::string::npos) << overridden.output;
  EXPECT_NE(overridden.output.find("1 rank,"), std::string::npos) << overridden.output;
  std::remove((base + ".toml").c_str());
}

}  // namespace
}  // namespace testing
}  // namespace paratrain

namespace paratrain {
namespace testing {
namespace {

// paratrain train of a small GPT on bytes under --strategy fsdp on `ranks` ranks, for `epochs`
// epochs of 10 steps, checkpointing every 5 into `dir`.
std::vector<std::string> fsdp_job(const std::string& tokens,
                                  const std::string& dir,
                                  int ranks,
                                  int epochs) {
  return {cli_path(),
          "train",
          "--model",
          "gpt",
          "--layers",
          "2",
          "--width",
          "32",
          "--heads",
          "2",
          "--vocab",
          "256",
          "--context",
          "32",
          "--dataset",
          "tokens",
          "--data-dir",
          tokens,
          "--strategy",
          "fsdp",
          "--nproc",
          std::to_string(ranks),
          "--device",
          "cpu",
          "--epochs",
          std::to_string(epochs),
          "--steps",
          "10",
          "--batch-size",
          "4",
          "--optimizer",
          "adam",
          "--lr",
          "3e-3",
          "--checkpoint-every",
          "5",
          "--checkpoint-dir",
          dir};
}

// An fsdp job stopped after 2 epochs and resumed for the third ends with the weights of a job
// that ran 3 epochs straight, bit for bit; its sharded checkpoint consolidates into those
// weights; and 3 ranks resume a checkpoint 2 ranks made (resharded).
TEST(Resume, FsdpCheckpointsResumeBitwiseReshardAndConsolidate) {  // ctest: slow 30
  const std::string text = "/usr/share/common-licenses/GPL-3";
  if (!std::ifstream(text).good()) {
    GTEST_SKIP() << text << " is missing (Debian's base-files ships it)";
  }
  const std::string base = "/tmp/" + unique_token("fsdp-resume");
  const std::map<std::string, std::string> env{
      kCpuOnly, {"PARATRAIN_TIMEOUT", "60"}, {"PARATRAIN_ELASTIC", "1"}};
  auto tok = run_process({cli_path(), "data", "tokenize", "--bytes", text, "--out", base + "-tok"});
  ASSERT_EQ(tok.exit_code, 0) << tok.output;
  const std::string tokens = base + "-tok";
  auto straight = run_process(
      plus(fsdp_job(tokens, base + "-a", 2, 3), {"--save-weights", base + "-a.safetensors"}), env,
      300);
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  auto first = run_process(fsdp_job(tokens, base + "-b", 2, 2), env, 300);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  // Sharded: every rank's own file holds its shards; the shared file no weight.
  auto holders = run_process(
      {"/bin/sh", "-c", "cd '" + base + "-b' && grep -la 'fsdp\\.h0' ckpt-*20.*safetensors"}, {},
      10);
  EXPECT_NE(holders.output.find(".rank-0."), std::string::npos) << holders.output;
  EXPECT_NE(holders.output.find(".rank-1."), std::string::npos) << holders.output;
  auto rest = run_process(plus(fsdp_job(tokens, base + "-b", 2, 3),
                               {"--resume", "auto", "--save-weights", base + "-b.safetensors"}),
                          env, 300);
  ASSERT_EQ(rest.exit_code, 0) << rest.output;
  EXPECT_EQ(read_bytes(base + "-a.safetensors"), read_bytes(base + "-b.safetensors"));
  auto whole = run_process(
      {cli_path(), "checkpoint", "consolidate", base + "-b", "--out", base + "-c.safetensors"});
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const TensorMap saved = load_safetensors(base + "-b.safetensors");
  const TensorMap consolidated = load_safetensors(base + "-c.safetensors");
  ASSERT_EQ(saved.size(), consolidated.size());
  for (const auto& [name, t] : saved) {
    ASSERT_TRUE(consolidated.count(name)) << name;
    EXPECT_TRUE(torch::equal(consolidated.at(name), t)) << name;
  }
  auto three = run_process(
      plus(fsdp_job(tokens, base + "-b", 3, 4), {"--resume", base + "-b/ckpt-0000000020.json"}),
      env, 300);
  ASSERT_EQ(three.exit_code, 0) << three.output;
  EXPECT_NE(three.output.find("resumed from"), std::string::npos) << three.output;
  remove_with_prefix(base);
}

// The largest difference between two weight files of the same names.
double max_difference(const std::string& a, const std::string& b) {
  const TensorMap x = load_safetensors(a);
  const TensorMap y = load_safetensors(b);
  EXPECT_EQ(x.size(), y.size());
  double worst = 0;
  for (const auto& [name, t] : x) {
    EXPECT_TRUE(y.count(name)) << name;
    if (y.count(name)) {
      worst = std::max(
          worst, (t.to(torch::kDouble) - y.at(name).to(torch::kDouble)).abs().max().item<double>());
    }
  }
  return worst;
}

// A job on a 2-D mesh (tensor parallel over 2 ranks, FSDP over 2) stopped after 2 epochs and
// resumed for the third ends with the weights of one that ran 3 epochs straight, bit for bit. Its
// checkpoint consolidates into the whole model (the tensor-parallel parts joined), by the
// module's names and by Hugging Face's. Other meshes take it, resharded: plain FSDP on 2, 4 and 1
// ranks, tensor parallelism over 4, and 2 replicas of tensor parallelism over 2: each holds
// exactly the saved weights (a resume with no step left saves them again), and those that see the
// same batches end epoch 3 alike, which they could not without the saved optimizer state.
TEST(Resume, MeshCheckpointsResumeAndReshard) {  // ctest: slow 60
  const std::string text = "/usr/share/common-licenses/GPL-3";
  if (!std::ifstream(text).good()) {
    GTEST_SKIP() << text << " is missing (Debian's base-files ships it)";
  }
  const std::string base = "/tmp/" + unique_token("mesh-resume");
  const std::map<std::string, std::string> env{kCpuOnly, {"PARATRAIN_TIMEOUT", "60"}};
  auto tok = run_process({cli_path(), "data", "tokenize", "--bytes", text, "--out", base + "-tok"});
  ASSERT_EQ(tok.exit_code, 0) << tok.output;
  const std::string tokens = base + "-tok";
  // 4 heads, so that tensor parallelism may take 4 ranks.
  auto mesh_job = [&](const std::string& dir, int epochs, const std::vector<std::string>& mesh,
                      int ranks = 4) {
    std::vector<std::string> job = plus(fsdp_job(tokens, dir, ranks, epochs), mesh);
    *(std::find(job.begin(), job.end(), "--heads") + 1) = "4";
    return job;
  };
  const std::vector<std::string> tp2_fsdp2{"--tp", "2", "--dp-shard", "2"};
  auto straight = run_process(
      plus(mesh_job(base + "-a", 3, tp2_fsdp2), {"--save-weights", base + "-a.safetensors"}), env,
      300);
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  auto first = run_process(
      plus(mesh_job(base + "-b", 2, tp2_fsdp2), {"--save-weights", base + "-b2.safetensors"}), env,
      300);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const std::string epoch2 = base + "-b/ckpt-0000000020.json";
  auto rest = run_process(plus(mesh_job(base + "-b", 3, tp2_fsdp2),
                               {"--resume", "auto", "--save-weights", base + "-b.safetensors"}),
                          env, 300);
  ASSERT_EQ(rest.exit_code, 0) << rest.output;
  EXPECT_NE(rest.output.find("resumed from"), std::string::npos) << rest.output;
  EXPECT_EQ(read_bytes(base + "-a.safetensors"), read_bytes(base + "-b.safetensors"));

  auto whole = run_process(
      {cli_path(), "checkpoint", "consolidate", base + "-b", "--out", base + "-c.safetensors"});
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  EXPECT_EQ(max_difference(base + "-b.safetensors", base + "-c.safetensors"), 0.0);
  auto hf = run_process({cli_path(), "checkpoint", "consolidate", base + "-b", "--names", "hf",
                         "--out", base + "-hf"});
  ASSERT_EQ(hf.exit_code, 0) << hf.output;
  const TensorMap named = load_safetensors(base + "-hf/model.safetensors");
  ASSERT_TRUE(named.count("transformer.h.0.attn.c_attn.weight")) << hf.output;
  EXPECT_TRUE(torch::equal(named.at("transformer.h.0.attn.c_attn.weight"),
                           load_safetensors(base + "-c.safetensors").at("h0.attn.c_attn.weight")));

  // name, ranks, mesh: those with 2 data-parallel ranks see the straight run's batches; tp4 sees
  // fsdp1's (one data-parallel rank each).
  const std::vector<std::tuple<std::string, int, std::vector<std::string>>> others{
      {"fsdp2", 2, {}},  // another world size: elastic, below
      {"tp2-replicate2", 4, {"--tp", "2", "--dp-replicate", "2"}},
      {"fsdp4", 4, {}},
      {"fsdp1", 1, {}},
      {"tp4", 4, {"--tp", "4"}}};
  for (const auto& [name, ranks, mesh] : others) {
    SCOPED_TRACE("resumed as " + name);
    const std::string dir = base + "-" + name;
    auto job = [&, ranks = ranks, mesh = mesh](int epochs, const std::string& out) {
      return plus(mesh_job(dir, epochs, mesh, ranks), {"--resume", epoch2, "--save-weights", out});
    };
    auto elastic = env;
    elastic["PARATRAIN_ELASTIC"] = "1";  // as `paratrain launch --nnodes MIN:MAX` sets it
    auto same = run_process(job(2, dir + "-2.safetensors"), elastic, 300);
    ASSERT_EQ(same.exit_code, 0) << same.output;
    EXPECT_EQ(max_difference(base + "-b2.safetensors", dir + "-2.safetensors"), 0.0);
    auto on = run_process(job(3, dir + "-3.safetensors"), elastic, 300);
    ASSERT_EQ(on.exit_code, 0) << on.output;
    const double d = max_difference(base + "-a.safetensors", dir + "-3.safetensors");
    std::cout << name << ": max |w - w_straight| after epoch 3 = " << d << std::endl;
    if (name == "fsdp2" || name == "tp2-replicate2") {
      EXPECT_LT(d, 1e-5);
    }
  }
  const double d = max_difference(base + "-fsdp1-3.safetensors", base + "-tp4-3.safetensors");
  std::cout << "tp4 against fsdp1 after epoch 3: " << d << std::endl;
  EXPECT_LT(d, 1e-5);
  remove_with_prefix(base);
}

// Pipeline stages on a mesh (3-D): the GPT cut into stages over "pp", each sharded over dp_shard
// or dp_replicate, or split by tensor parallelism, ends 20 Adam steps within 1e-5 of plain FSDP
// with the same data-parallel ranks (one rank when the others are tp or pp). A stopped job resumes
// bitwise; its checkpoint consolidates into the whole model and resumes with another split inside
// the stages holding exactly the saved weights; another stage count is refused in one line.
TEST(Resume, PipelineStagesOnAMesh) {  // ctest: slow 60
  const std::string text = "/usr/share/common-licenses/GPL-3";
  if (!std::ifstream(text).good()) {
    GTEST_SKIP() << text << " is missing (Debian's base-files ships it)";
  }
  const std::string base = "/tmp/" + unique_token("pp-mesh");
  const std::map<std::string, std::string> env{kCpuOnly, {"PARATRAIN_TIMEOUT", "60"}};
  auto tok = run_process({cli_path(), "data", "tokenize", "--bytes", text, "--out", base + "-tok"});
  ASSERT_EQ(tok.exit_code, 0) << tok.output;
  // 4 blocks, so that 4 stages take one each; 4 heads for tp.
  auto job = [&](const std::string& name, int ranks, int epochs,
                 const std::vector<std::string>& mesh) {
    std::vector<std::string> j = plus(fsdp_job(base + "-tok", base + "-" + name, ranks, epochs),
                                      plus(mesh, {"--save-weights", base + "-" + name + ".st"}));
    *(std::find(j.begin(), j.end(), "--heads") + 1) = "4";
    *(std::find(j.begin(), j.end(), "--layers") + 1) = "4";
    *(std::find(j.begin(), j.end(), "--lr") + 1) = "1e-3";
    return plus(j, {"--clip-grad-norm", "0.5"});  // the global norm spans the stages
  };
  for (const auto& [name, ranks] :
       std::vector<std::pair<std::string, int>>{{"fsdp1", 1}, {"fsdp2", 2}}) {
    auto r = run_process(job(name, ranks, 2, {}), env, 300);
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  const std::vector<std::tuple<std::string, std::vector<std::string>, std::string>> meshes{
      {"pp2-fsdp2",
       {"--pp", "2", "--dp-shard", "2", "--schedule", "1f1b", "--checkpoint-activations"},
       "fsdp2"},
      {"pp2-tp2", {"--pp", "2", "--tp", "2"}, "fsdp1"},
      {"pp2-hsdp2", {"--pp", "2", "--dp-replicate", "2"}, "fsdp2"},
      {"pp4", {"--pp", "4"}, "fsdp1"}};
  for (const auto& [name, mesh, reference] : meshes) {
    SCOPED_TRACE(name);
    auto r = run_process(job(name, 4, 2, plus(mesh, {"--chunks", "2"})), env, 300);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("on mesh pp="), std::string::npos) << r.output;
    const double d = max_difference(base + "-" + reference + ".st", base + "-" + name + ".st");
    std::cout << name << " against " << reference << " after 20 Adam steps: " << d << std::endl;
    EXPECT_LT(d, 1e-5);
  }

  const std::vector<std::string> pp2_tp2{"--pp", "2", "--tp", "2", "--chunks", "2"};
  auto first = run_process(job("stopped", 4, 1, pp2_tp2), env, 300);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  auto whole = run_process(
      {cli_path(), "checkpoint", "consolidate", base + "-stopped", "--out", base + "-whole.st"});
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  EXPECT_EQ(max_difference(base + "-stopped.st", base + "-whole.st"), 0.0);
  const std::string epoch1 = base + "-stopped/ckpt-0000000010.json";
  auto other_split =
      run_process(plus(job("resplit", 4, 1, {"--pp", "2", "--dp-shard", "2", "--chunks", "2"}),
                       {"--resume", epoch1}),
                  env, 300);
  ASSERT_EQ(other_split.exit_code, 0) << other_split.output;
  EXPECT_EQ(max_difference(base + "-whole.st", base + "-resplit.st"), 0.0);
  auto refused = run_process(
      plus(job("no-stages", 4, 1, {"--tp", "2", "--dp-shard", "2"}), {"--resume", epoch1}), env,
      300);
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.output.find(
                "with 2 pipeline stages, and this one has 1; restore it on a mesh with pp 2"),
            std::string::npos)
      << refused.output;
  auto rest = run_process(plus(job("stopped", 4, 2, pp2_tp2), {"--resume", "auto"}), env, 300);
  ASSERT_EQ(rest.exit_code, 0) << rest.output;
  EXPECT_NE(rest.output.find("resumed from"), std::string::npos) << rest.output;
  EXPECT_EQ(read_bytes(base + "-pp2-tp2.st"), read_bytes(base + "-stopped.st"));
  remove_with_prefix(base);
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
