#pragma once

// Token files for language models, in the two formats the GPT-2 training code people use writes:
//
//   nanoGPT  raw little-endian uint16 tokens, nothing else (prepare.py's train.bin, val.bin)
//   llm.c    a header of 256 little-endian int32 (magic 20240520, version 1, the token count),
//            then the uint16 tokens (dev/data/*.py's fineweb_train_000001.bin, ...)
//
// A TokenDataset maps the file read-only (mmap), so a file of billions of tokens costs no memory
// up front and pages are read as windows touch them. Sample i is a window of context + 1 tokens
// starting at window_start(i): data = tokens[s, s + context), target = tokens[s + 1, s + context
// + 1), both int64 [context], nanoGPT's get_batch() pair; a batch is then [B, context] each.
//
//   auto train = std::make_shared<data::TokenDataset>(
//       "shakespeare_char/train.bin",
//       data::TokenDatasetOptions(256).windows("random").seed(1337).vocab(65));
//   data::write_tokens("val.bin", tokens, "llmc");  // std::vector<uint16_t>, atomically

#include "paratrain/data/dataset.h"

#include <torch/arg.h>
#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace paratrain {
namespace data {

/// llm.c's token files: header[0], then header[1] (uint16 GPT-2 tokens; llm.c's version 2 holds
/// uint32 LLaMA-3 tokens, which paratrain does not read), then the token count; 256 int32 in all,
/// the rest zero.
constexpr int32_t kLlmcTokensMagic = 20240520;
constexpr int32_t kLlmcTokensVersion = 1;
constexpr size_t kLlmcHeaderInts = 256;

struct TokenDatasetOptions {
  /* implicit */ TokenDatasetOptions(int64_t context) : context_(context) {}
  /// Tokens per sample (nanoGPT's block_size); each sample reads context + 1 tokens.
  TORCH_ARG(int64_t, context);
  /// Where sample i starts. "sequential": at i * context, windows side by side (evaluation).
  /// "random": at a position drawn from (seed, i), uniform in [0, tokens - context - 1], as
  /// nanoGPT's torch.randint offsets but fixed per index, so a resumed run reads the same windows.
  /// Both give (tokens - 1) / context samples: an epoch reads about every token once.
  TORCH_ARG(std::string, windows) = "sequential";
  /// The seed of the "random" windows' positions.
  TORCH_ARG(uint64_t, seed) = 0;
  /// When > 0, a token >= vocab is an error naming the file and position (checked per window,
  /// when it is read): a file tokenized for another vocabulary would otherwise index past the
  /// embedding.
  TORCH_ARG(int64_t, vocab) = 0;
};

class TokenDataset : public Dataset {
 public:
  /// Maps `path` and checks it: a size that is not whole tokens, an llm.c header whose version or
  /// count is wrong, a header laid out as llm.c's (a version of 1 or 2, then zeros; or a count
  /// that matches the size) under another magic, fewer than context + 1 tokens, a missing file, a
  /// folder. Each is a c10::Error of one line naming the file and, for a header, each field that
  /// is wrong with its value and the expected one.
  TokenDataset(std::string path, TokenDatasetOptions options);
  ~TokenDataset() override;
  TokenDataset(const TokenDataset&) = delete;
  TokenDataset& operator=(const TokenDataset&) = delete;

  size_t size() const override { return windows_; }
  /// Thread-safe (reads the mapping only).
  Sample get(size_t index) override;
  /// data and target [indices.size(), context], filled straight from the mapping.
  std::optional<Batch> get_batch(const std::vector<size_t>& indices) override;
  /// "PATH tokens [s, s + context]".
  std::string describe(size_t index) const override;

  /// The first token of sample `index`.
  int64_t window_start(size_t index) const;
  /// The token at `position` (< num_tokens()).
  int64_t token(int64_t position) const;
  int64_t num_tokens() const { return num_tokens_; }
  /// "nanogpt" or "llmc".
  const std::string& format() const { return format_; }
  const std::string& path() const { return path_; }
  const TokenDatasetOptions& options() const { return options_; }

 private:
  // Writes the window of sample `index` as int64: data to `data`, target to `target`.
  void read_window(size_t index, int64_t* data, int64_t* target) const;

  std::string path_;
  TokenDatasetOptions options_;
  std::string format_;
  void* map_ = nullptr;  // the whole file, PROT_READ
  size_t map_bytes_ = 0;
  const unsigned char* tokens_ = nullptr;  // the first token's first byte in the mapping
  int64_t num_tokens_ = 0;
  size_t windows_ = 0;
};

/// The bytes of `path` as tokens, one per byte (a vocabulary of 256): what `paratrain data
/// tokenize` splits into train.bin and val.bin. A folder, a missing or unreadable path is a
/// c10::Error of one line naming it, raised before anything is read; pipes and devices are read
/// to their end. An empty file gives no tokens.
std::vector<uint16_t> read_byte_tokens(const std::string& path);

/// Writes `tokens` to `path` as "nanogpt" (raw uint16) or "llmc" (llm.c's header, then the
/// tokens), atomically (write_pieces_atomic: a crash leaves the old file or the new one).
void write_tokens(const std::string& path,
                  const std::vector<uint16_t>& tokens,
                  const std::string& format = "nanogpt");
/// The same for a tensor of integer token ids (any shape, read in order), each in [0, 65535].
void write_tokens(const std::string& path,
                  const torch::Tensor& tokens,
                  const std::string& format = "nanogpt");

}  // namespace data
}  // namespace paratrain
