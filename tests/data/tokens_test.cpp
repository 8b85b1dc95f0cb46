// Token files: TokenDataset over nanoGPT's and llm.c's formats (byte layouts, windows, batches
// through the loader, bad files named in one line), write_tokens, and `paratrain data tokenize`.

#include "paratrain/data/tokens.h"

#include "paratrain/data/distributed_sampler.h"
#include "paratrain/data/loader.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <vector>

namespace paratrain {
namespace testing {
namespace {

std::string token_file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_token_file_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// Little-endian int32 fields, as llm.c's header holds them.
std::string le_int32s(const std::vector<int32_t>& values) {
  std::string out;
  for (int32_t v : values) {
    const auto u = static_cast<uint32_t>(v);
    for (int b = 0; b < 4; ++b) {
      out.push_back(static_cast<char>((u >> (8 * b)) & 0xff));
    }
  }
  return out;
}

// An llm.c header: magic, version, count, then zeros to 1024 bytes.
std::string llmc_header_bytes(int32_t magic, int32_t version, int32_t count) {
  std::string h = le_int32s({magic, version, count});
  h.resize(1024, '\0');
  return h;
}

// n tokens that use both bytes of a uint16: 0, 257, 514, ... (mod 65536).
std::vector<uint16_t> counting_tokens(size_t n) {
  std::vector<uint16_t> t(n);
  for (size_t i = 0; i < n; ++i) {
    t[i] = static_cast<uint16_t>(i * 257);
  }
  return t;
}

// Expects `e` to be one line holding `part` and the file's path.
void expect_one_line_naming(const std::string& e,
                            const std::string& part,
                            const std::string& path) {
  EXPECT_NE(e.find(part), std::string::npos) << "expected '" << part << "' in: " << e;
  EXPECT_NE(e.find(path), std::string::npos) << "the message does not name " << path << ": " << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << "not one line: " << e;
}

TEST(TokenDataset, ReadsNanoGptAndLlmcFiles) {
  const std::string dir = make_temp_dir("tokens");
  const std::vector<uint16_t> tokens = counting_tokens(1000);
  for (const std::string format : {"nanogpt", "llmc"}) {
    SCOPED_TRACE(format);
    const std::string path = dir + "/" + format + ".bin";
    data::write_tokens(path, tokens, format);
    const std::string bytes = token_file_bytes(path);
    const size_t offset = format == "llmc" ? 1024 : 0;
    ASSERT_EQ(bytes.size(), offset + 2 * tokens.size());
    if (format == "llmc") {
      EXPECT_EQ(bytes.substr(0, 12), le_int32s({20240520, 1, 1000}));
      EXPECT_EQ(bytes.substr(12, 1012), std::string(1012, '\0'));
    }
    // Token 1 is 257 = 0x0101, token 3 is 771 = 0x0303; token 255 is 65535: little-endian.
    EXPECT_EQ(static_cast<unsigned char>(bytes[offset + 2 * 255]), 0xff);
    EXPECT_EQ(static_cast<unsigned char>(bytes[offset + 2 * 3]), 0x03);

    data::TokenDataset ds(path, data::TokenDatasetOptions(16));
    EXPECT_EQ(ds.format(), format);
    EXPECT_EQ(ds.num_tokens(), 1000);
    EXPECT_EQ(ds.size(), 999u / 16u);
    EXPECT_EQ(ds.token(255), 65535);
    const data::Sample s = ds.get(2);
    EXPECT_EQ(s.data.scalar_type(), torch::kLong);
    ASSERT_EQ(s.data.sizes(), (std::vector<int64_t>{16}));
    ASSERT_EQ(s.target.sizes(), (std::vector<int64_t>{16}));
    for (int64_t k = 0; k < 16; ++k) {
      EXPECT_EQ(s.data[k].item<int64_t>(), tokens[static_cast<size_t>(32 + k)]);
      EXPECT_EQ(s.target[k].item<int64_t>(), tokens[static_cast<size_t>(33 + k)]);
    }
    EXPECT_EQ(ds.describe(2), path + " tokens [32, 48]");
    // A batch at once holds what get() gives per index.
    auto batch = ds.get_batch({5, 0, 61});
    ASSERT_TRUE(batch.has_value());
    ASSERT_EQ(batch->data.sizes(), (std::vector<int64_t>{3, 16}));
    EXPECT_TRUE(torch::equal(batch->data[0], ds.get(5).data));
    EXPECT_TRUE(torch::equal(batch->target[2], ds.get(61).target));
  }
  // The tensor overload writes the same bytes.
  torch::Tensor ids = torch::tensor(std::vector<int64_t>(tokens.begin(), tokens.end()));
  data::write_tokens(dir + "/from_tensor.bin", ids.view({10, 100}), "llmc");
  EXPECT_EQ(token_file_bytes(dir + "/from_tensor.bin"), token_file_bytes(dir + "/llmc.bin"));
  remove_tree(dir);
}

TEST(TokenDataset, SequentialAndRandomWindows) {
  const std::string dir = make_temp_dir("tokens");
  const std::string path = dir + "/train.bin";
  data::write_tokens(path, counting_tokens(1001), "nanogpt");
  data::TokenDataset sequential(path, data::TokenDatasetOptions(10));
  ASSERT_EQ(sequential.size(), 100u);  // (1001 - 1) / 10: the last window ends at token 1000
  for (size_t i = 0; i < sequential.size(); ++i) {
    EXPECT_EQ(sequential.window_start(i), static_cast<int64_t>(i) * 10);
  }
  auto random = [&](uint64_t seed) {
    return std::make_unique<data::TokenDataset>(
        path, data::TokenDatasetOptions(10).windows("random").seed(seed));
  };
  auto a = random(7);
  auto again = random(7);
  auto other = random(8);
  ASSERT_EQ(a->size(), 100u);
  std::set<int64_t> starts;
  size_t same_as_other = 0;
  for (size_t i = 0; i < a->size(); ++i) {
    const int64_t s = a->window_start(i);
    EXPECT_GE(s, 0);
    EXPECT_LE(s, 1001 - 10 - 1);  // the window's target ends at the last token
    EXPECT_EQ(again->window_start(i), s) << "not deterministic at index " << i;
    same_as_other += other->window_start(i) == s;
    starts.insert(s);
    const data::Sample w = a->get(i);  // target is data shifted by one
    EXPECT_EQ(w.data[0].item<int64_t>(), a->token(s));
    EXPECT_EQ(w.target[9].item<int64_t>(), a->token(s + 10));
  }
  EXPECT_GT(starts.size(), 80u);  // 100 draws from 991 places: few repeats
  EXPECT_GT(*starts.rbegin() - *starts.begin(), 800);
  EXPECT_LT(same_as_other, 5u);  // another seed, other windows
  remove_tree(dir);
}

TEST(TokenDataset, LoaderBatchesUnderTheDistributedSampler) {
  // Two ranks share the index space as for any dataset; batches come from get_batch, [B, context]
  // int64 each.
  const std::string dir = make_temp_dir("tokens");
  const std::string path = dir + "/train.bin";
  data::write_tokens(path, counting_tokens(641), "llmc");
  auto ds = std::make_shared<data::TokenDataset>(path, data::TokenDatasetOptions(8));
  ASSERT_EQ(ds->size(), 80u);
  std::set<int64_t> seen;
  for (int rank = 0; rank < 2; ++rank) {
    auto sampler = std::make_shared<data::DistributedSampler>(ds->size(), 2, rank, true, 3);
    data::DataLoader loader(ds, data::LoaderOptions(16).workers(1), sampler);
    loader.set_epoch(0);
    while (auto b = loader.next()) {
      EXPECT_EQ(b->data.scalar_type(), torch::kLong);
      ASSERT_EQ(b->data.size(1), 8);
      for (int64_t r = 0; r < b->data.size(0); ++r) {
        EXPECT_TRUE(torch::equal(b->target[r].narrow(0, 0, 7), b->data[r].narrow(0, 1, 7)));
        seen.insert(b->data[r][0].item<int64_t>());
      }
    }
  }
  EXPECT_EQ(seen.size(), 80u);  // every window once over the two ranks
  remove_tree(dir);
}

TEST(TokenDataset, BadFilesAreNamedInOneLine) {
  const std::string dir = make_temp_dir("tokens");
  const std::string tokens100(200, '\x01');  // 100 tokens of 257
  struct Case {
    std::string name;
    std::string bytes;
    std::string message;
  };
  const std::vector<Case> cases{
      {"odd.bin", std::string(201, '\x01'), "is 201 bytes, an odd number: not whole uint16 tokens"},
      {"llmc_odd.bin", llmc_header_bytes(20240520, 1, 100) + tokens100 + "x",
       "holds 201 bytes after its llm.c header, an odd number"},
      {"llmc_v2.bin", llmc_header_bytes(20240520, 2, 50) + tokens100,
       "is an llm.c token file of version 2; paratrain reads version 1"},
      {"llmc_count.bin", llmc_header_bytes(20240520, 1, 99) + tokens100,
       "its llm.c header counts 99 tokens but the file holds 100"},
      {"llmc_magic.bin", llmc_header_bytes(20240326, 1, 100) + tokens100,
       "has llm.c's header (version 1, a count of 100 tokens that matches its size) but its "
       "magic is 20240326, not 20240520 (20240326 is llm.c's model checkpoint)"},
      {"llmc_short.bin", le_int32s({20240520, 1, 0}),
       "starts with llm.c's magic 20240520 but is 12 bytes, shorter than its 1024-byte header"},
      {"short.bin", std::string(20, '\x01'), "holds 10 tokens, fewer than the 17 that one sample"},
      {"empty.bin", "", "holds 0 tokens, fewer than the 17"},
  };
  for (const auto& c : cases) {
    const std::string path = dir + "/" + c.name;
    write_token_file_bytes(path, c.bytes);
    expect_one_line_naming(
        error_of([&] { data::TokenDataset ds(path, data::TokenDatasetOptions(16)); }), c.message,
        path);
  }
  expect_one_line_naming(
      error_of([&] { data::TokenDataset ds(dir + "/missing.bin", data::TokenDatasetOptions(16)); }),
      "TokenDataset: cannot open " + dir + "/missing.bin: No such file or directory",
      dir + "/missing.bin");
  expect_one_line_naming(
      error_of([&] { data::TokenDataset ds(dir, data::TokenDatasetOptions(16)); }),
      "it is a folder", dir);
  // A token outside the vocabulary is found when its window is read.
  std::vector<uint16_t> tokens(100, 7);
  tokens[45] = 300;
  data::write_tokens(dir + "/vocab.bin", tokens);
  data::TokenDataset small_vocab(dir + "/vocab.bin", data::TokenDatasetOptions(10).vocab(256));
  EXPECT_EQ(small_vocab.get(3).data[0].item<int64_t>(), 7);  // tokens 30..40 are fine
  expect_one_line_naming(error_of([&] { small_vocab.get(4); }),
                         "token 300 at position 45 is outside the vocabulary of 256",
                         dir + "/vocab.bin");
  expect_one_line_naming(error_of([&] {
                           small_vocab.get_batch({0, 4});
                         }),
                         "at position 45", dir + "/vocab.bin");
  EXPECT_NE(error_of([&] { small_vocab.get(9); }).find("index 9 out of range for 9 samples"),
            std::string::npos);
  // Bad options.
  EXPECT_NE(error_of([&] {
              data::TokenDataset ds(dir + "/vocab.bin", data::TokenDatasetOptions(0));
            }).find("context must be >= 1, got 0"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              data::TokenDataset ds(dir + "/vocab.bin",
                                    data::TokenDatasetOptions(4).windows("shuffled"));
            }).find("unknown windows 'shuffled': choose sequential or random"),
            std::string::npos);
  remove_tree(dir);
}

TEST(TokenDataset, WriteTokensRefusesWhatIsNotUint16) {
  const std::string dir = make_temp_dir("tokens");
  EXPECT_NE(error_of([&] {
              data::write_tokens(dir + "/a.bin", torch::tensor({1, 70000}));
            }).find("token 70000 at position 1 does not fit in uint16 [0, 65535]"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              data::write_tokens(dir + "/a.bin", torch::tensor({-1}));
            }).find("token -1 at position 0 does not fit"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              data::write_tokens(dir + "/a.bin", torch::ones({3}));
            }).find("token ids must be an integer tensor, got Float"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              data::write_tokens(dir + "/a.bin", std::vector<uint16_t>{1}, "npy");
            }).find("unknown format 'npy': choose nanogpt"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              data::write_tokens("/proc/paratrain-tokens/a.bin", std::vector<uint16_t>{1});
            }).find("/proc/paratrain-tokens/a.bin"),
            std::string::npos);
  remove_tree(dir);
}

TEST(Data, TokenizeWritesByteTokens) {
  const std::string dir = make_temp_dir("tokenize");
  std::string text;
  for (int i = 0; i < 50; ++i) {
    text += "First Citizen: speak, speak. \xc3\xa9\n";  // some UTF-8: bytes above 127
  }
  write_token_file_bytes(dir + "/input.txt", text);
  const size_t n = text.size();
  const size_t n_train = static_cast<size_t>(static_cast<double>(n) * 0.9);  // nanoGPT's split
  for (const std::string format : {"nanogpt", "llmc"}) {
    SCOPED_TRACE(format);
    const std::string out = dir + "/" + format;  // made by the command
    auto r = run_cli({cli_path(), "data", "tokenize", "--bytes", dir + "/input.txt", "--out", out,
                      "--format", format});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("wrote " + std::to_string(n_train) + " train and " +
                            std::to_string(n - n_train) + " val tokens"),
              std::string::npos)
        << r.output;
    data::TokenDataset train(out + "/train.bin", data::TokenDatasetOptions(8).vocab(256));
    data::TokenDataset val(out + "/val.bin", data::TokenDatasetOptions(8).vocab(256));
    EXPECT_EQ(train.format(), format);
    ASSERT_EQ(train.num_tokens() + val.num_tokens(), static_cast<int64_t>(n));
    EXPECT_EQ(train.num_tokens(), static_cast<int64_t>(n_train));
    std::string round_trip;
    for (const auto* ds : {&train, &val}) {
      for (int64_t i = 0; i < ds->num_tokens(); ++i) {
        round_trip.push_back(static_cast<char>(ds->token(i)));
      }
    }
    EXPECT_EQ(round_trip, text);
  }
  auto r = run_cli({cli_path(), "data", "tokenize", "--bytes", dir + "/input.txt", "--out",
                    dir + "/quarter", "--val-fraction", "0.25"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(token_file_bytes(dir + "/quarter/val.bin").size(),
            2 * (n - static_cast<size_t>(static_cast<double>(n) * 0.75)));

  // Bad input: one line each; 2 for the command line, 1 for the file.
  write_token_file_bytes(dir + "/empty.txt", "");
  struct Case {
    std::vector<std::string> args;
    int exit_code;
    std::string message;
  };
  const std::string input = dir + "/input.txt";
  const std::vector<Case> cases{
      {{"--bytes", dir + "/missing.txt", "--out", dir + "/o"},
       1,
       "cannot read " + dir + "/missing.txt: No such file or directory"},
      {{"--bytes", dir + "/empty.txt", "--out", dir + "/o"},
       1,
       dir + "/empty.txt is empty: there is nothing to tokenize"},
      {{"--bytes", input, "--out", dir + "/o", "--val-fraction", "0"},
       2,
       "--val-fraction must be in (0, 1), got 0"},
      {{"--bytes", input, "--out", dir + "/o", "--val-fraction", "1.5"},
       2,
       "--val-fraction must be in (0, 1), got 1.5"},
      {{"--bytes", input, "--out", "/proc/paratrain-tokenize"},
       2,
       "cannot write --out /proc/paratrain-tokenize"},
      {{"--bytes", input, "--out", dir + "/o", "--format", "npy"},
       2,
       "unknown --format 'npy': choose nanogpt or llmc"},
      {{"--out", dir + "/o"}, 2, "--bytes FILE and --out DIR are required"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv{cli_path(), "data", "tokenize"};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    auto bad = run_cli(argv);
    EXPECT_EQ(bad.exit_code, c.exit_code) << c.message << ": " << bad.output;
    EXPECT_NE(bad.output.find(c.message), std::string::npos)
        << "expected '" << c.message << "' in: " << bad.output;
  }
  auto unknown = run_cli({cli_path(), "data", "tokenise"});
  EXPECT_EQ(unknown.exit_code, 2) << unknown.output;
  EXPECT_NE(unknown.output.find("unknown data command 'tokenise'; available: make-imagefolder, "
                                "tokenize"),
            std::string::npos)
      << unknown.output;
  remove_tree(dir);
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
