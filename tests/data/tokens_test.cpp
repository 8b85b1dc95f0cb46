// Token files: TokenDataset over nanoGPT's and llm.c's formats (byte layouts, windows, batches
// through the loader, bad files named in one line), write_tokens, and `paratrain data tokenize`.

#include "paratrain/data/tokens.h"

#include "paratrain/data/distributed_sampler.h"
#include "paratrain/data/loader.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <set>
#include <string>
#include <utility>
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
       "is an llm.c token file (magic 20240520) that paratrain cannot read: the 201 bytes after "
       "the header are not whole uint16 tokens (truncated?)"},
      {"llmc_v2.bin", llmc_header_bytes(20240520, 2, 50) + tokens100,
       "that paratrain cannot read: version 2 (uint32 LLaMA-3 tokens), expected 1 (uint16 GPT-2 "
       "tokens, the only kind paratrain reads). Make the file again"},
      {"llmc_count.bin", llmc_header_bytes(20240520, 1, 99) + tokens100,
       "that paratrain cannot read: token count 99 in the header but the file holds 100 "
       "(truncated or appended to?)"},
      {"llmc_magic.bin", llmc_header_bytes(20240326, 1, 100) + tokens100,
       "laid out as llm.c's (version 1 at int32 1, a count at int32 2, zeros from int32 3 to 255), "
       "not with tokens, and paratrain cannot read it: magic 20240326, expected 20240520 (llm.c's; "
       "20240326 marks llm.c's model checkpoints, not token files). Make the file again"},
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

TEST(TokenDataset, DamagedLlmcHeaderIsNamedNotReadAsTokens) {
  // A file whose first 1024 bytes are laid out as llm.c's header is refused, naming each wrong
  // field with its value and the expected one, whatever its magic and count say: read as raw
  // tokens, its header would be trained on as 512 tokens.
  const std::string dir = make_temp_dir("tokens");
  const std::string tokens512(1024, '\x01');  // 512 tokens of 257
  std::string overwritten = llmc_header_bytes(20240521, 1, 512);
  overwritten.replace(4 * 10, 4, le_int32s({5}));  // a reserved int32 written over
  struct Case {
    std::string name;
    std::string bytes;
    std::vector<std::string> parts;
  };
  const std::vector<Case> cases{
      // Magic and count both wrong: taken for 1024 tokens of nanoGPT's format before.
      {"both.bin",
       llmc_header_bytes(20240521, 1, 100) + tokens512,
       {"starts with a 1024-byte header laid out as llm.c's (version 1 at int32 1, a count at "
        "int32 2, zeros from int32 3 to 255), not with tokens, and paratrain cannot read it: "
        "magic 20240521, expected 20240520 (llm.c's); token count 100 in the header but the file "
        "holds 512 (truncated or appended to?). Make the file again with llm.c's dev/data "
        "scripts"}},
      {"zero_magic.bin",
       llmc_header_bytes(0, 1, 7) + tokens512,
       {"magic 0, expected 20240520 (llm.c's); token count 7 in the header but the file holds "
        "512"}},
      // llm.c's version 2 (uint32 tokens): the count is of uint32 tokens, 256 here.
      {"v2.bin",
       llmc_header_bytes(123, 2, 5) + tokens512,
       {"(version 2 at int32 1,",
        "magic 123, expected 20240520 (llm.c's); version 2 (uint32 LLaMA-3 tokens), expected 1 "
        "(uint16 GPT-2 tokens, the only kind paratrain reads); token count 5 in the header but "
        "the file holds 256"}},
      {"magic_odd.bin",
       llmc_header_bytes(20240521, 1, 100) + tokens512 + "x",
       {"magic 20240521, expected 20240520 (llm.c's); the 1025 bytes after the header are not "
        "whole uint16 tokens (truncated?)"}},
      // The reserved part written over, but the count matches the size.
      {"overwritten.bin",
       overwritten + tokens512,
       {"(version 1 at int32 1, a count at int32 2 that matches the file's size)",
        "cannot read it: magic 20240521, expected 20240520 (llm.c's). Make"}},
      // llm.c's magic: every wrong field is named at once.
      {"right_magic.bin",
       llmc_header_bytes(20240520, 2, 99) + tokens512,
       {"is an llm.c token file (magic 20240520) that paratrain cannot read: version 2 (uint32 "
        "LLaMA-3 tokens), expected 1 (uint16 GPT-2 tokens, the only kind paratrain reads); token "
        "count 99 in the header but the file holds 256 (truncated or appended to?)"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string path = dir + "/" + c.name;
    write_token_file_bytes(path, c.bytes);
    const std::string e =
        error_of([&] { data::TokenDataset ds(path, data::TokenDatasetOptions(16)); });
    for (const auto& part : c.parts) {
      expect_one_line_naming(e, part, path);
    }
  }
  remove_tree(dir);
}

TEST(TokenDataset, TokensThatOnlyResembleAnLlmcHeaderStayNanoGpt) {
  // The header's shape needs int32 3 to 255 all zero (tokens 6 to 511) and a version of 1 or 2
  // (token 2, then token 3 zero): token data that misses any of these is read as tokens.
  const std::string dir = make_temp_dir("tokens");
  // Tokens whose first 1024 bytes are llm.c's header under magic 5 + 6 * 65536, count 9.
  auto header_like = [](uint16_t version, uint16_t count_high) {
    std::vector<uint16_t> t(1000, 7);
    std::fill(t.begin(), t.begin() + 512, uint16_t{0});
    t[0] = 5;
    t[1] = 6;
    t[2] = version;
    t[4] = 9;
    t[5] = count_high;
    return t;
  };
  std::vector<uint16_t> last_reserved = header_like(1, 0);
  last_reserved[511] = 1;  // int32 255
  std::vector<uint16_t> first_reserved = header_like(1, 0);
  first_reserved[6] = 1;  // int32 3
  std::vector<uint16_t> shorter = header_like(1, 0);
  shorter.resize(511);  // 1022 bytes: no room for a header
  const std::vector<std::pair<std::string, std::vector<uint16_t>>> files{
      {"zeros.bin", std::vector<uint16_t>(2000, 0)},  // version 0: padding, a test's zeros
      {"version3.bin", header_like(3, 0)},
      {"negative_count.bin", header_like(1, 0x8000)},
      {"last_reserved.bin", last_reserved},
      {"first_reserved.bin", first_reserved},
      {"short.bin", shorter},
  };
  for (const auto& [name, tokens] : files) {
    SCOPED_TRACE(name);
    const std::string path = dir + "/" + name;
    data::write_tokens(path, tokens, "nanogpt");
    std::unique_ptr<data::TokenDataset> ds;
    EXPECT_EQ(error_of([&] {
                ds = std::make_unique<data::TokenDataset>(path, data::TokenDatasetOptions(16));
              }),
              "");
    ASSERT_TRUE(ds != nullptr);
    EXPECT_EQ(ds->format(), "nanogpt");
    EXPECT_EQ(ds->num_tokens(), static_cast<int64_t>(tokens.size()));
  }
  // The same tokens with the shape whole are refused: version3.bin, negative_count.bin and the two
  // *_reserved.bin above differ from them in one token each.
  const std::string path = dir + "/shaped.bin";
  data::write_tokens(path, header_like(1, 0), "nanogpt");
  expect_one_line_naming(
      error_of([&] { data::TokenDataset ds(path, data::TokenDatasetOptions(16)); }),
      "magic 393221, expected 20240520 (llm.c's); token count 9 in the header but the file holds "
      "488",
      path);
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
       "cannot open " + dir + "/missing.txt: No such file or directory"},
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
  // The dataset's folder is named by the command's flag.
  auto missing = run_cli({cli_path(), "data", "make-imagefolder", "--from", "fashion-mnist",
                          "--data-dir", "/nonexistent-fmnist", "--out", dir + "/never"});
  EXPECT_EQ(missing.exit_code, 1) << missing.output;
  EXPECT_NE(missing.output.find("/nonexistent-fmnist/train-images-idx3-ubyte.gz does not exist; "
                                "install Debian's dataset-fashion-mnist or give --data-dir the "
                                "folder that holds its files"),
            std::string::npos)
      << missing.output;
  remove_tree(dir);
}

TEST(Data, TokenizeNamesABadInputPathBeforeWritingAnything) {
  // A folder, a missing or unreachable path, an unreadable file: one line naming the path and the
  // problem, exit 1, and no --out made. A folder opens as a stream and fails only at the first
  // read, which gave libstdc++'s "basic_filebuf::underflow error reading the file: Is a
  // directory", without the path.
  const std::string dir = make_temp_dir("tokenize-input");
  const std::string input = dir + "/input.txt";
  write_token_file_bytes(input, "First Citizen: before we proceed any further, hear me speak.\n");
  write_token_file_bytes(dir + "/one.txt", "x");
  ASSERT_TRUE(std::filesystem::create_directory(dir + "/folder"));
  struct Case {
    std::string bytes;
    std::string message;
  };
  std::vector<Case> cases{
      {dir + "/folder", "cannot read " + dir +
                            "/folder: it is a folder, not a file: give one file (to tokenize the "
                            "files of a folder, join them first: cat DIR/*.txt > input.txt)"},
      {dir + "/missing.txt", "cannot open " + dir + "/missing.txt: No such file or directory"},
      {input + "/x", "cannot open " + input + "/x: Not a directory"},
      {dir + "/one.txt", dir + "/one.txt's 1 bytes leave train empty at --val-fraction 0.1"},
  };
  if (::geteuid() != 0) {  // root reads any file
    write_token_file_bytes(dir + "/secret.txt", "abc");
    ASSERT_EQ(::chmod((dir + "/secret.txt").c_str(), 0), 0);
    cases.push_back({dir + "/secret.txt", "cannot open " + dir + "/secret.txt: Permission denied"});
  }
  const std::string out = dir + "/out";
  for (const auto& c : cases) {
    SCOPED_TRACE(c.bytes);
    auto r = run_cli({cli_path(), "data", "tokenize", "--bytes", c.bytes, "--out", out});
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find(c.message), std::string::npos)
        << "expected '" << c.message << "' in: " << r.output;
    const std::string line = r.output.substr(0, r.output.find_last_not_of('\n') + 1);
    EXPECT_EQ(line.find('\n'), std::string::npos) << "not one line: " << r.output;
    EXPECT_FALSE(std::filesystem::exists(out)) << "--out was made before the input was refused";
  }
  // --out naming a file.
  auto r = run_cli({cli_path(), "data", "tokenize", "--bytes", input, "--out", dir + "/one.txt"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--out " + dir + "/one.txt is a file, not a folder"), std::string::npos)
      << r.output;
  // The library's reader: the same lines, and the bytes as tokens.
  expect_one_line_naming(error_of([&] { data::read_byte_tokens(dir + "/folder"); }),
                         "it is a folder, not a file", dir + "/folder");
  expect_one_line_naming(error_of([&] { data::read_byte_tokens(dir + "/missing.txt"); }),
                         "No such file or directory", dir + "/missing.txt");
  EXPECT_EQ(data::read_byte_tokens(dir + "/one.txt"), std::vector<uint16_t>{'x'});
  write_token_file_bytes(dir + "/empty.txt", "");
  EXPECT_TRUE(data::read_byte_tokens(dir + "/empty.txt").empty());
  // A token file's reader says the same of a folder, and what to give.
  expect_one_line_naming(
      error_of([&] { data::TokenDataset ds(dir + "/folder", data::TokenDatasetOptions(4)); }),
      "TokenDataset: cannot read " + dir +
          "/folder: it is a folder, not a token file: give one of its files (e.g. train.bin or "
          "val.bin)",
      dir + "/folder");
  // A FIFO is refused before it is opened: open() would wait for a writer.
  ASSERT_EQ(::mkfifo((dir + "/fifo").c_str(), 0600), 0);
  expect_one_line_naming(
      error_of([&] { data::TokenDataset ds(dir + "/fifo", data::TokenDatasetOptions(4)); }),
      "TokenDataset: cannot read " + dir + "/fifo: not a regular file", dir + "/fifo");
  remove_tree(dir);
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
