// Sharded FSDP checkpoints (fsdp_checkpoint.h). Through programs/fsdp_worker on real ranks: a
// resumed job ends bit for bit where an uninterrupted one does; a checkpoint of 3 ranks resumes
// on 2 (the same weights bit for bit once loaded, then the same training); `paratrain checkpoint
// consolidate` writes the whole model, under Hugging Face's names too; a checkpoint of another
// model is refused in one line. In this process, on a world of one: the round trip bit for bit,
// the directories that hold no checkpoint, each refused in one line, and consolidation's outputs
// that would write over a checkpoint's files, refused before anything is written.

#include "test_util.h"

#include <paratrain/comm/init.h>
#include <paratrain/io/checkpoint.h>
#include <paratrain/io/safetensors.h>
#include <paratrain/models/gpt.h>
#include <paratrain/parallel/fsdp_checkpoint.h>
#include <paratrain/parallel/fully_sharded_data_parallel.h>
#include <paratrain/util/atomic_file.h>

#include <torch/torch.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>

namespace paratrain {
namespace testing {
namespace {

const std::string kWorker = PARATRAIN_TEST_FSDP_WORKER;

// The worker compares every step with one process: within 1e-6, and under Adam here within 1e-4.
// Adam moves each weight by about lr * g / (|g| + eps); where the gradient is zero but for
// rounding (the attention's key bias, which softmax ignores), that ratio is rounding noise, and
// over 3 ranks, whose sums the reference does not group as FSDP does, such weights differ by up to
// about 1e-4 (3.7e-5 seen). The equivalence suite follows Adam's trajectory; these tests check
// the checkpoints, bit for bit.
std::vector<std::string> adam(std::vector<std::string> args) {
  args.insert(args.end(), {"--optimizer", "adam", "--tolerance", "1e-4"});
  return args;
}

std::vector<std::string> sgd(std::vector<std::string> args) {
  args.insert(args.end(), {"--optimizer", "sgd"});
  return args;
}

ProcessResult run_worker(int ranks, const std::vector<std::string>& args) {
  std::vector<std::string> argv{
      cli_path(), "launch", "--standalone", "--nproc-per-node", std::to_string(ranks), "--backend",
      "gloo",     "--",     kWorker};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_process(argv, {kCpuOnly, {"PARATRAIN_TIMEOUT", "60"}}, 240);
}

int64_t total_numel(const std::map<std::string, torch::Tensor>& tensors,
                    const std::string& prefix) {
  int64_t n = 0;
  for (const auto& kv : tensors) {
    if (kv.first.compare(0, prefix.size(), prefix) == 0) {
      n += kv.second.numel();
    }
  }
  return n;
}

// 6 steps without a break, and 3 steps, a save, and 3 more in a new job: the same bytes. Each rank
// file holds only that rank's shards and their optimizer state; the manifest holds the layout.
TEST(FsdpCheckpoint, ExactResumeIsBitwise) {  // ctest: slow 12
  const std::string dir = make_temp_dir("fsdp-exact");
  const std::string ckpt = dir + "/ckpt";
  expect_every_rank_ok(kWorker, "gloo", 2,
                       adam({"--steps", "6", "--final-out", dir + "/straight"}));
  expect_every_rank_ok(kWorker, "gloo", 2, adam({"--steps", "3", "--save-checkpoint", ckpt}));
  expect_every_rank_ok(kWorker, "gloo", 2,
                       adam({"--steps", "3", "--resume", ckpt, "--final-out", dir + "/resumed"}));
  expect_bitwise(load_safetensors(dir + "/straight"), load_safetensors(dir + "/resumed"));

  const auto rank0 = load_safetensors(ckpt + "/ckpt-0000000000.rank-0.safetensors");
  const auto rank1 = load_safetensors(ckpt + "/ckpt-0000000000.rank-1.safetensors");
  const int64_t whole = total_numel(load_safetensors(dir + "/straight"), "");
  EXPECT_EQ(total_numel(rank0, "fsdp."), total_numel(rank1, "fsdp."));
  EXPECT_GE(2 * total_numel(rank0, "fsdp."), whole);
  EXPECT_LT(2 * total_numel(rank0, "fsdp."), whole + 2 * 4);  // 4 units, padded to 2
  for (const char* key :
       {"fsdp.root", "fsdp.h2", "optim.0.0.exp_avg", "optim.0.3.exp_avg_sq", "optim.0.0.step"}) {
    EXPECT_TRUE(rank0.count(key)) << key;
  }
  EXPECT_EQ(rank0.at("optim.0.3.exp_avg").sizes(), rank0.at("fsdp.h2").sizes());
  EXPECT_EQ(load_safetensors_metadata(ckpt + "/ckpt-0000000000.rank-1.safetensors").at("rank"),
            "1");
  const auto meta = nlohmann::json::parse(Checkpoint::load(ckpt + "/ckpt-0000000000.json").meta);
  EXPECT_EQ(meta.at("metadata").at("step"), "3");
  EXPECT_EQ(meta.at("fsdp").at("units").size(), 4u);
  remove_tree(dir);
}

// 3 ranks save at step 3 and 2 ranks load it. Under SGD with momentum: the same weights, bit for
// bit, once loaded, and 3 more steps on the same global batch of 12 sequences train as 3 ranks
// training 6 steps straight, within the rounding of sums over another split. Under Adam: its
// moments resharded and its step counts, bit for bit.
TEST(FsdpCheckpoint, ResumesOnAnotherWorldSize) {  // ctest: slow 25
  const std::string dir = make_temp_dir("fsdp-reshard");
  auto on_12 = [](std::vector<std::string> args) {
    args.insert(args.end(), {"--global-batch", "12"});
    return args;
  };
  expect_every_rank_ok(kWorker, "gloo", 3,
                       sgd(on_12({"--steps", "6", "--final-out", dir + "/straight"})));
  expect_every_rank_ok(kWorker, "gloo", 3,
                       sgd(on_12({"--steps", "3", "--save-checkpoint", dir + "/sgd", "--full-out",
                                  dir + "/saved"})));
  expect_every_rank_ok(kWorker, "gloo", 2,
                       sgd(on_12({"--steps", "3", "--resume", dir + "/sgd", "--loaded-out",
                                  dir + "/loaded", "--final-out", dir + "/resumed"})));
  expect_bitwise(load_safetensors(dir + "/saved"), load_safetensors(dir + "/loaded"));
  const auto straight = load_safetensors(dir + "/straight");
  const auto resumed = load_safetensors(dir + "/resumed");
  ASSERT_EQ(straight.size(), resumed.size());
  for (const auto& kv : straight) {
    ASSERT_TRUE(resumed.count(kv.first)) << kv.first;
    expect_close(kv.second, resumed.at(kv.first), kv.first, 1e-6);
  }

  expect_every_rank_ok(kWorker, "gloo", 3,
                       adam(on_12({"--steps", "3", "--save-checkpoint", dir + "/adam",
                                   "--optim-out", dir + "/adam-saved"})));
  expect_every_rank_ok(kWorker, "gloo", 2,
                       adam(on_12({"--steps", "0", "--resume", dir + "/adam", "--loaded-optim-out",
                                   dir + "/adam-loaded"})));
  const auto saved = load_safetensors(dir + "/adam-saved");
  EXPECT_EQ(saved.at("0.0.step").item<int64_t>(), 3);
  EXPECT_EQ(saved.size(), 4u * 3);  // step, exp_avg and exp_avg_sq of each unit
  expect_bitwise(saved, load_safetensors(dir + "/adam-loaded"));
  remove_tree(dir);
}

TEST(FsdpCheckpoint, ConsolidateWritesTheWholeModel) {
  const std::string dir = make_temp_dir("fsdp-consolidate");
  const std::string ckpt = dir + "/ckpt";
  expect_every_rank_ok(
      kWorker, "gloo", 2,
      sgd({"--steps", "2", "--save-checkpoint", ckpt, "--full-out", dir + "/full"}));
  const auto full = load_safetensors(dir + "/full");
  auto r = run_process({cli_path(), "checkpoint", "consolidate", ckpt, "--out", dir + "/one"},
                       {kCpuOnly}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("paratrain checkpoint: wrote " + std::to_string(total_numel(full, "")) +
                          " parameters (" + std::to_string(full.size()) + " tensors) of " + ckpt +
                          " to " + dir + "/one"),
            std::string::npos)
      << r.output;
  expect_bitwise(full, load_safetensors(dir + "/one"));
  EXPECT_EQ(load_safetensors_metadata(dir + "/one").at("step"), "2");

  // One file by Hugging Face's names (an --out that does not end in .safetensors is a model
  // directory: tests/models/gpt_pretrained_test.cpp).
  r = run_process({cli_path(), "checkpoint", "consolidate", "--out", dir + "/hf.safetensors",
                   "--names", "hf", ckpt},
                  {kCpuOnly}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto hf = load_safetensors(dir + "/hf.safetensors");
  ASSERT_EQ(hf.size(), full.size());
  for (const auto& kv : full) {
    ASSERT_TRUE(hf.count(models::hf_gpt2_name(kv.first))) << kv.first;
    EXPECT_TRUE(torch::equal(hf.at(models::hf_gpt2_name(kv.first)), kv.second)) << kv.first;
  }
  EXPECT_TRUE(hf.count("transformer.h.0.attn.c_attn.weight"));
  EXPECT_TRUE(hf.count("transformer.wte.weight"));
  remove_tree(dir);
}

TEST(FsdpCheckpoint, RefusesACheckpointOfAnotherModel) {
  const std::string dir = make_temp_dir("fsdp-other");
  expect_every_rank_ok(kWorker, "gloo", 2, sgd({"--steps", "1", "--save-checkpoint", dir}));
  const auto r = run_worker(2, sgd({"--layers", "2", "--steps", "1", "--resume", dir}));
  EXPECT_NE(r.exit_code, 0) << r.output;
  // Every rank fails alike, but the launcher may stop the others once the first has: one line
  // suffices.
  const std::string line = "]: error: the checkpoint in " + dir +
                           " is of another model: it has 4 units and this model 3: its unit 'h2' "
                           "is not in this model; load it into a model built as the one that "
                           "saved it\n";
  EXPECT_NE(r.output.find(line), std::string::npos) << "missing '" << line << "' in\n" << r.output;
  remove_tree(dir);
}

dist::ProcessGroupPtr checkpoint_world_of_one() {
  const std::string path = "/tmp/" + unique_token("paratrain-fsdp-ckpt-store");
  return dist::init_process_group(
      dist::InitOptions().backend("gloo").init_method("file://" + path).rank(0).world_size(1));
}

torch::nn::Sequential small_gpt(int64_t width) {
  torch::manual_seed(3);
  return models::gpt(models::GptOptions().layers(2).width(width).heads(2).vocab(29).context(8));
}

// One Adam step of FSDP over a small GPT on a world of one, on tokens drawn from `seed`.
struct Trained {
  Trained(const dist::ProcessGroupPtr& pg, int seed, int64_t width = 16)
      : fsdp(small_gpt(width), pg), adam(fsdp.parameters(), torch::optim::AdamOptions(1e-2)) {
    torch::manual_seed(seed);
    fsdp.forward(torch::randint(0, 29, {2, 8})).pow(2).mean().backward();
    adam.step();
  }
  FullyShardedDataParallel fsdp;
  torch::optim::Adam adam;
};

TEST(FsdpCheckpoint, WorldOfOneRoundTripsBitwise) {
  auto pg = checkpoint_world_of_one();
  const std::string dir = make_temp_dir("fsdp-one");
  Trained a(pg, 1);
  save_sharded_checkpoint(dir, a.fsdp, &a.adam, {{"note", "x"}});
  Trained b(pg, 2);  // a step on other tokens: every weight and moment differs
  ASSERT_FALSE(torch::equal(a.fsdp.parameters()[1], b.fsdp.parameters()[1]));
  EXPECT_EQ(load_sharded_checkpoint(dir, b.fsdp, &b.adam).at("note"), "x");
  expect_bitwise(a.fsdp.sharded_state(), b.fsdp.sharded_state());
  expect_bitwise(optimizer_state(a.adam), optimizer_state(b.adam));
  // Saved again into the same directory: still one checkpoint, still the same.
  save_sharded_checkpoint(dir, b.fsdp, nullptr);
  Trained c(pg, 3);
  EXPECT_TRUE(load_sharded_checkpoint(dir, c.fsdp, nullptr).empty());
  expect_bitwise(a.fsdp.sharded_state(), c.fsdp.sharded_state());
  remove_tree(dir);
}

// The buffers (BatchNorm's running statistics, not sharded) are saved with the shards and loaded
// back: a model resumed from the checkpoint normalizes as the saved one did.
TEST(FsdpCheckpoint, KeepsTheBuffers) {
  auto pg = checkpoint_world_of_one();
  const std::string dir = make_temp_dir("fsdp-buffers");
  auto model = [] {
    torch::manual_seed(5);
    return torch::nn::Sequential(torch::nn::Linear(4, 6), torch::nn::BatchNorm1d(6),
                                 torch::nn::Linear(6, 2));
  };
  FullyShardedDataParallel a(model(), pg);
  torch::manual_seed(6);
  a.forward(torch::randn({8, 4}) * 3 + 1).sum().backward();  // moves the running statistics
  save_sharded_checkpoint(dir, a, nullptr);
  FullyShardedDataParallel b(model(), pg);
  ASSERT_FALSE(torch::equal(b.module()->named_buffers()["1.running_mean"],
                            a.module()->named_buffers()["1.running_mean"]));
  load_sharded_checkpoint(dir, b, nullptr);
  for (const auto& kv : a.module()->named_buffers()) {
    SCOPED_TRACE(kv.key());
    EXPECT_TRUE(torch::equal(b.module()->named_buffers()[kv.key()], kv.value()));
  }
  remove_tree(dir);
}

// A checkpoint in the form save_sharded_checkpoint wrote before (fsdp.json beside
// rank-R-of-W.safetensors, the shards keyed "model.<unit>"), made here for a world of one.
void save_older_format(const std::string& dir, Trained& t) {
  nlohmann::json units = nlohmann::json::array();
  std::map<std::string, size_t> owners;
  const auto layout = t.fsdp.units();
  for (size_t k = 0; k < layout.size(); ++k) {
    const auto& u = layout[k];
    units.push_back(nlohmann::json{{"name", u.name},
                                   {"params", u.params},
                                   {"shapes", u.shapes},
                                   {"offsets", u.offsets},
                                   {"numel", u.numel},
                                   {"padded", u.padded}});
    if (u.padded > 0) {
      owners["0." + std::to_string(owners.size()) + "."] = k;
    }
  }
  TensorMap tensors = with_prefix(t.fsdp.sharded_state(), "model.");
  for (const auto& kv : with_prefix(optimizer_state(t.adam), "optim.")) {
    tensors[kv.first] = kv.second;
  }
  const std::string name = "rank-0-of-1.safetensors";
  const SafetensorsParts parts = encode_safetensors(
      tensors,
      {{"note", "older"},
       {"fsdp.layout", nlohmann::json{{"world", 1}, {"rank", 0}, {"units", units}}.dump()}});
  std::vector<FilePiece> pieces{{parts.header.data(), parts.header.size()}};
  for (const auto& p : parts.tensors) {
    pieces.push_back({p.data_ptr(), p.nbytes()});
  }
  write_pieces_atomic(dir + "/" + name, pieces);
  const std::string bytes = file_bytes(dir + "/" + name);
  const nlohmann::json manifest{{"format", "paratrain-fsdp-checkpoint-1"},
                                {"world", 1},
                                {"units", units},
                                {"optimizer", owners},
                                {"metadata", {{"note", "older"}}},
                                {"files",
                                 {{{"file", name},
                                   {"bytes", bytes.size()},
                                   {"crc32", crc32_of({{bytes.data(), bytes.size()}})}}}}};
  std::ofstream(dir + "/fsdp.json") << manifest.dump();
}

// Checkpoints of the older format load as they did (weights and optimizer bit for bit, the
// caller's metadata) and consolidate to the same weights; a save into their directory replaces
// them with one of the current format.
TEST(FsdpCheckpoint, TheOlderFormatStillLoads) {
  auto pg = checkpoint_world_of_one();
  const std::string dir = make_temp_dir("fsdp-older");
  Trained a(pg, 1);
  save_older_format(dir, a);
  Trained b(pg, 2);
  EXPECT_EQ(load_sharded_checkpoint(dir, b.fsdp, &b.adam).at("note"), "older");
  expect_bitwise(a.fsdp.sharded_state(), b.fsdp.sharded_state());
  expect_bitwise(optimizer_state(a.adam), optimizer_state(b.adam));
  const auto older = consolidate_sharded_model(dir);
  EXPECT_EQ(older.metadata.at("note"), "older");

  save_sharded_checkpoint(dir, a.fsdp, &a.adam, {{"note", "current"}});
  const auto files = files_in(dir);
  EXPECT_FALSE(files.count("fsdp.json"));
  EXPECT_FALSE(files.count("rank-0-of-1.safetensors"));
  EXPECT_TRUE(files.count("ckpt-0000000000.json"));
  const auto current = consolidate_sharded_model(dir);
  EXPECT_EQ(current.metadata.at("note"), "current");
  expect_bitwise(older.tensors, current.tensors);
  remove_tree(dir);
}

TEST(FsdpCheckpoint, BadDirectoriesAreOneLine) {
  auto pg = checkpoint_world_of_one();
  const std::string dir = make_temp_dir("fsdp-bad");
  Trained a(pg, 1);
  save_sharded_checkpoint(dir, a.fsdp, &a.adam);
  auto expect_error = [&](Trained& t, const std::string& what) {
    const std::string e = error_of([&] { load_sharded_checkpoint(dir, t.fsdp, &t.adam); });
    EXPECT_NE(e.find(what), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  };
  Trained wider(pg, 1, 24);
  expect_error(wider, "the checkpoint in " + dir +
                          " is of another model: unit 'root' has 'embed.wte.weight' of shape "
                          "[29, 16] in it but [29, 24] here; load it into a model built as the "
                          "one that saved it");

  const std::string file = dir + "/ckpt-0000000000.rank-0.safetensors";
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-1, std::ios::end);
    f.put('\x7f');  // a changed byte of the last tensor
  }
  Trained b(pg, 2);
  expect_error(b, file + " fails its CRC-32 check");
  ASSERT_EQ(std::remove(file.c_str()), 0);
  expect_error(b, "the checkpoint in " + dir + " lacks " + file + " (rank 0's shards of 1)");
  ASSERT_EQ(std::remove((dir + "/ckpt-0000000000.json").c_str()), 0);
  expect_error(b, "no complete checkpoint in " + dir + ": it has no manifest");

  // The command line: the same line, and its own usage errors.
  auto r = run_cli({cli_path(), "checkpoint", "consolidate", dir, "--out", dir + "/x"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_EQ(r.output.rfind("paratrain checkpoint: error: no complete checkpoint in " + dir +
                               ": it has no manifest",
                           0),
            0u)
      << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  r = run_cli({cli_path(), "checkpoint", "consolidate", dir});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("give the checkpoint's directory and --out FILE"), std::string::npos)
      << r.output;
  r = run_cli({cli_path(), "checkpoint", "consolidate", dir, "--out", "x", "--names", "gpt"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("unknown --names 'gpt'"), std::string::npos) << r.output;
  r = run_cli({cli_path(), "checkpoint", "--help"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("  consolidate DIR --out FILE"), std::string::npos) << r.output;
  remove_tree(dir);

  // A directory with checkpoints of other steps (a Trainer's) is refused, and left as it was.
  const std::string other = make_temp_dir("fsdp-other-steps");
  {
    CheckpointState s;
    s.step = 5;
    Checkpoint trainer(CheckpointOptions(other).background(false));
    trainer.save(std::move(s));
  }
  const auto before = files_in(other);
  EXPECT_NE(error_of([&] { save_sharded_checkpoint(other, a.fsdp, &a.adam); })
                .find(other + " holds checkpoints of other steps (the newest: " + other +
                      "/ckpt-0000000005.json), which it would not replace"),
            std::string::npos);
  EXPECT_EQ(files_in(other), before);
  remove_tree(other);
}

// A consolidation writes outside the checkpoint, under a name of its own: never over a file of
// the checkpoint it reads (its manifest, say, which a resume would then skip), nor over one of
// another checkpoint; a manifest given for the directory names the directory; an existing file
// elsewhere is replaced whole.
TEST(FsdpCheckpoint, ConsolidateNeverWritesOverACheckpoint) {
  auto pg = checkpoint_world_of_one();
  const std::string dir = make_temp_dir("fsdp-out");
  Trained a(pg, 1);
  const std::string sharded = dir + "/sharded";
  save_sharded_checkpoint(sharded, a.fsdp, &a.adam);
  // A Trainer's checkpoint directory under the fsdp strategy, as it saves one at step 8: the
  // manifest's metadata holds the layout, the rank file the shards.
  const std::string trainer = dir + "/trainer";
  {
    nlohmann::json units = nlohmann::json::array();
    for (const auto& u : a.fsdp.units()) {
      units.push_back(nlohmann::json{{"name", u.name.empty() ? "root" : u.name},
                                     {"params", u.params},
                                     {"shapes", u.shapes},
                                     {"offsets", u.offsets},
                                     {"numel", u.numel},
                                     {"padded", u.padded}});
    }
    CheckpointState s;
    s.step = 8;
    s.meta = nlohmann::json{{"strategy", "fsdp"}, {"fsdp", {{"world_size", 1}, {"units", units}}}}
                 .dump();
    for (const auto& kv : a.fsdp.sharded_state()) {
      s.own["fsdp." + kv.first] = kv.second;
    }
    s.own_read_by_all = true;
    Checkpoint ckpt(CheckpointOptions(trainer).background(false));
    ckpt.save(std::move(s));
  }
  const std::string manifest = trainer + "/ckpt-0000000008.json";
  const std::string saved = file_bytes(manifest);
  ASSERT_FALSE(saved.empty());

  auto refused = [&](const std::string& from, const std::string& out, const std::string& what) {
    const std::string e = error_of([&] { consolidate_sharded_checkpoint(from, out); });
    EXPECT_NE(e.find(what), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  };
  refused(trainer, manifest,
          "consolidate: the output file " + manifest + " is in the checkpoint's directory " +
              trainer + ", whose files are the checkpoint: write it elsewhere");
  refused(trainer, trainer + "/whole.safetensors", "is in the checkpoint's directory");
  refused(sharded, sharded + "/ckpt-0000000000.json", "is in the checkpoint's directory");
  // Another checkpoint's files, by their names.
  refused(trainer, sharded + "/rank-0-of-1.safetensors",
          "consolidate: the output file " + sharded +
              "/rank-0-of-1.safetensors has the name of a checkpoint's own file "
              "(rank-0-of-1.safetensors), which it would replace or pass for: give it another "
              "name");
  refused(sharded, dir + "/ckpt-0000000012.rank-1.safetensors",
          "has the name of a checkpoint's own file");
  refused(manifest, dir + "/x.safetensors",
          "a sharded checkpoint is a directory, and " + manifest +
              " is a file: give the directory that holds it, " + trainer);
  EXPECT_EQ(file_bytes(manifest), saved);
  EXPECT_EQ(Checkpoint::load(manifest).step, 8);  // still whole

  // The command line says the same, and writes nothing.
  auto r = run_cli({cli_path(), "checkpoint", "consolidate", trainer, "--out", manifest});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_EQ(r.output.rfind("paratrain checkpoint: error: consolidate: the output file " + manifest +
                               " is in the checkpoint's directory",
                           0),
            0u)
      << r.output;
  r = run_cli({cli_path(), "checkpoint", "consolidate", manifest, "--out", dir + "/x"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("a sharded checkpoint is a directory, and " + manifest +
                          " is a file: give the directory that holds it, " + trainer),
            std::string::npos)
      << r.output;
  EXPECT_EQ(file_bytes(manifest), saved);

  // Elsewhere, an existing file is replaced (atomically); both layouts give the same weights.
  const std::string whole = dir + "/whole.safetensors";
  std::ofstream(whole) << "an older file";
  consolidate_sharded_checkpoint(trainer, whole);
  consolidate_sharded_checkpoint(sharded, dir + "/whole-sharded.safetensors");
  const auto from_trainer = load_safetensors(whole);
  EXPECT_GT(from_trainer.size(), 4u);  // a parameter each
  expect_bitwise(from_trainer, load_safetensors(dir + "/whole-sharded.safetensors"));
  remove_tree(dir);
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
