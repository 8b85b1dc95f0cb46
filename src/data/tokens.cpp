#include "paratrain/data/tokens.h"

#include "paratrain/util/atomic_file.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

namespace paratrain {
namespace data {

namespace {

constexpr size_t kLlmcHeaderBytes = kLlmcHeaderInts * sizeof(int32_t);
// llm.c's model checkpoints (gpt2_124M.bin), which a user may give by mistake.
constexpr int32_t kLlmcModelMagic = 20240326;

// Little-endian reads from bytes, whatever the host's byte order.
int32_t le_int32_at(const unsigned char* p, size_t i) {
  const unsigned char* q = p + 4 * i;
  const uint32_t v = static_cast<uint32_t>(q[0]) | static_cast<uint32_t>(q[1]) << 8 |
                     static_cast<uint32_t>(q[2]) << 16 | static_cast<uint32_t>(q[3]) << 24;
  return static_cast<int32_t>(v);
}

int64_t le_uint16_at(const unsigned char* p, int64_t i) {
  const unsigned char* q = p + 2 * i;
  return static_cast<int64_t>(q[0]) | static_cast<int64_t>(q[1]) << 8;
}

// splitmix64: neighbouring (seed, index) pairs give unrelated window starts.
uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

struct TokenFileLayout {
  std::string format;
  size_t offset = 0;  // bytes before the first token
  int64_t tokens = 0;
};

// Which format the file is, from its first bytes and its size; one line naming the file for
// anything that is not whole tokens of either. The rule: a file whose first int32 is 20240520 is
// llm.c's (as raw tokens it would start with 55432, past GPT-2's 50257); a file whose first 1024
// bytes read as llm.c's header but for the magic (version 1 and the token count its size gives)
// was made for llm.c too, and its magic is named rather than its header read as tokens.
TokenFileLayout token_file_layout(const std::string& path, const unsigned char* p, size_t bytes) {
  const bool header_sized = bytes >= kLlmcHeaderBytes;
  const int32_t first = bytes >= 4 ? le_int32_at(p, 0) : 0;
  if (first == kLlmcTokensMagic) {
    TORCH_CHECK(header_sized, "TokenDataset: ", path, " starts with llm.c's magic ",
                kLlmcTokensMagic, " but is ", bytes, " bytes, shorter than its ", kLlmcHeaderBytes,
                "-byte header");
    const int32_t version = le_int32_at(p, 1);
    TORCH_CHECK(version == kLlmcTokensVersion, "TokenDataset: ", path,
                " is an llm.c token file of version ", version, "; paratrain reads version ",
                kLlmcTokensVersion, " (uint16 GPT-2 tokens)");
    const size_t body = bytes - kLlmcHeaderBytes;
    TORCH_CHECK(body % 2 == 0, "TokenDataset: ", path, " holds ", body,
                " bytes after its llm.c header, an odd number: not whole uint16 tokens "
                "(truncated?)");
    const int32_t count = le_int32_at(p, 2);
    TORCH_CHECK(static_cast<int64_t>(count) == static_cast<int64_t>(body / 2),
                "TokenDataset: ", path, ": its llm.c header counts ", count,
                " tokens but the file holds ", body / 2, " (truncated or appended to?)");
    return {"llmc", kLlmcHeaderBytes, count};
  }
  const bool llmc_shaped = header_sized && (bytes - kLlmcHeaderBytes) % 2 == 0 &&
                           le_int32_at(p, 1) == kLlmcTokensVersion &&
                           static_cast<int64_t>(le_int32_at(p, 2)) ==
                               static_cast<int64_t>((bytes - kLlmcHeaderBytes) / 2);
  TORCH_CHECK(!llmc_shaped, "TokenDataset: ", path, " has llm.c's header (version 1, a count of ",
              le_int32_at(p, 2), " tokens that matches its size) but its magic is ", first,
              ", not ", kLlmcTokensMagic,
              first == kLlmcModelMagic ? " (20240326 is llm.c's model checkpoint)" : "");
  TORCH_CHECK(bytes % 2 == 0, "TokenDataset: ", path, " is ", bytes,
              " bytes, an odd number: not whole uint16 tokens (nanoGPT's raw format; llm.c's "
              "starts with the int32 ",
              kLlmcTokensMagic, ")");
  return {"nanogpt", 0, static_cast<int64_t>(bytes / 2)};
}

std::string token_errno_text() {
  return std::strerror(errno);
}

// Maps the whole of `path` read-only into `map` (null for an empty file, which mmap refuses);
// returns its size. The mapping outlives the descriptor.
size_t map_read_only(const std::string& path, void*& map) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "TokenDataset: cannot open ", path, ": ", token_errno_text());
  struct stat st {};
  const bool stated = ::fstat(fd, &st) == 0;
  const std::string stat_error = stated ? "" : token_errno_text();
  if (!stated || !S_ISREG(st.st_mode)) {
    ::close(fd);
    TORCH_CHECK(false, "TokenDataset: cannot read ", path, ": ",
                !stated               ? stat_error
                : S_ISDIR(st.st_mode) ? std::string("it is a folder, not a token file")
                                      : std::string("not a regular file"));
  }
  const auto bytes = static_cast<size_t>(st.st_size);
  void* p = bytes > 0 ? ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0) : nullptr;
  const std::string map_error = p == MAP_FAILED ? token_errno_text() : "";
  ::close(fd);
  TORCH_CHECK(p != MAP_FAILED, "TokenDataset: cannot map ", path, ": ", map_error);
  map = p;
  return bytes;
}

}  // namespace

TokenDataset::TokenDataset(std::string path, TokenDatasetOptions options)
    : path_(std::move(path)), options_(std::move(options)) {
  const int64_t context = options_.context();
  TORCH_CHECK(context >= 1, "TokenDataset: context must be >= 1, got ", context);
  TORCH_CHECK(options_.windows() == "sequential" || options_.windows() == "random",
              "TokenDataset: unknown windows '", options_.windows(),
              "': choose sequential or random");
  TORCH_CHECK(options_.vocab() >= 0, "TokenDataset: vocab must be >= 0 (0: unchecked), got ",
              options_.vocab());
  map_bytes_ = map_read_only(path_, map_);
  try {
    const auto* bytes = static_cast<const unsigned char*>(map_);
    const TokenFileLayout layout = token_file_layout(path_, bytes, map_bytes_);
    format_ = layout.format;
    tokens_ = bytes + layout.offset;
    num_tokens_ = layout.tokens;
    TORCH_CHECK(num_tokens_ >= context + 1, "TokenDataset: ", path_, " holds ", num_tokens_,
                " tokens, fewer than the ", context + 1, " that one sample of context ", context,
                " reads");
  } catch (...) {
    if (map_ != nullptr) {  // the destructor does not run after a throwing constructor
      ::munmap(map_, map_bytes_);
      map_ = nullptr;
    }
    throw;
  }
  if (options_.windows() == "random" && map_ != nullptr) {
    ::madvise(map_, map_bytes_, MADV_RANDOM);  // a hint: no read-ahead past a window
  }
  windows_ = static_cast<size_t>((num_tokens_ - 1) / context);
}

TokenDataset::~TokenDataset() {
  if (map_ != nullptr) {
    ::munmap(map_, map_bytes_);
  }
}

int64_t TokenDataset::window_start(size_t index) const {
  TORCH_CHECK(index < windows_, "TokenDataset: index ", index, " out of range for ", windows_,
              " samples of ", path_);
  const int64_t context = options_.context();
  if (options_.windows() == "sequential") {
    return static_cast<int64_t>(index) * context;
  }
  // Uniform in [0, n - context - 1]; the modulo's bias is below 2^-30 for any file under 2^34
  // tokens.
  const auto starts = static_cast<uint64_t>(num_tokens_ - context);
  const uint64_t draw = splitmix64(splitmix64(options_.seed()) ^ static_cast<uint64_t>(index));
  return static_cast<int64_t>(draw % starts);
}

int64_t TokenDataset::token(int64_t position) const {
  TORCH_CHECK(position >= 0 && position < num_tokens_, "TokenDataset: position ", position,
              " out of range for the ", num_tokens_, " tokens of ", path_);
  return le_uint16_at(tokens_, position);
}

void TokenDataset::read_window(size_t index, int64_t* data, int64_t* target) const {
  const int64_t start = window_start(index);
  const int64_t context = options_.context();
  const int64_t vocab = options_.vocab();
  for (int64_t k = 0; k <= context; ++k) {
    const int64_t t = le_uint16_at(tokens_, start + k);
    TORCH_CHECK(vocab == 0 || t < vocab, "TokenDataset: ", path_, ": token ", t, " at position ",
                start + k, " is outside the vocabulary of ", vocab,
                " (a file tokenized for another vocabulary? GPT-2's has 50257 tokens)");
    if (k < context) {
      data[k] = t;
    }
    if (k > 0) {
      target[k - 1] = t;
    }
  }
}

Sample TokenDataset::get(size_t index) {
  const int64_t context = options_.context();
  torch::Tensor window = torch::empty({2, context}, torch::kLong);
  int64_t* p = window.data_ptr<int64_t>();
  read_window(index, p, p + context);
  return {window[0], window[1]};
}

std::optional<Batch> TokenDataset::get_batch(const std::vector<size_t>& indices) {
  const int64_t context = options_.context();
  const auto n = static_cast<int64_t>(indices.size());
  Batch batch{torch::empty({n, context}, torch::kLong), torch::empty({n, context}, torch::kLong)};
  int64_t* data = batch.data.data_ptr<int64_t>();
  int64_t* target = batch.target.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    read_window(indices[static_cast<size_t>(i)], data + i * context, target + i * context);
  }
  return batch;
}

std::string TokenDataset::describe(size_t index) const {
  if (index >= windows_) {
    return {};
  }
  const int64_t start = window_start(index);
  return path_ + " tokens [" + std::to_string(start) + ", " +
         std::to_string(start + options_.context()) + "]";
}

// ---- writing ------------------------------------------------------------------------------------

void write_tokens(const std::string& path,
                  const std::vector<uint16_t>& tokens,
                  const std::string& format) {
  TORCH_CHECK(format == "nanogpt" || format == "llmc", "write_tokens: unknown format '", format,
              "': choose nanogpt (raw uint16) or llmc (llm.c's header, then uint16)");
  std::vector<unsigned char> body(tokens.size() * 2);
  for (size_t i = 0; i < tokens.size(); ++i) {  // little-endian on any host
    body[2 * i] = static_cast<unsigned char>(tokens[i] & 0xff);
    body[2 * i + 1] = static_cast<unsigned char>(tokens[i] >> 8);
  }
  std::vector<unsigned char> header;
  if (format == "llmc") {
    TORCH_CHECK(tokens.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()),
                "write_tokens: llm.c's header counts tokens in an int32; ", tokens.size(),
                " tokens are too many for one file of ", path, " (split it into shards)");
    header.assign(kLlmcHeaderBytes, 0);
    const int32_t fields[3] = {kLlmcTokensMagic, kLlmcTokensVersion,
                               static_cast<int32_t>(tokens.size())};
    for (size_t f = 0; f < 3; ++f) {
      const auto v = static_cast<uint32_t>(fields[f]);
      for (size_t b = 0; b < 4; ++b) {
        header[4 * f + b] = static_cast<unsigned char>((v >> (8 * b)) & 0xff);
      }
    }
  }
  write_pieces_atomic(path, {{header.data(), header.size()}, {body.data(), body.size()}});
}

void write_tokens(const std::string& path, const torch::Tensor& tokens, const std::string& format) {
  TORCH_CHECK(tokens.defined() && !tokens.is_floating_point() && !tokens.is_complex() &&
                  tokens.scalar_type() != torch::kBool,
              "write_tokens: token ids must be an integer tensor, got ",
              tokens.defined() ? c10::toString(tokens.scalar_type()) : "an undefined tensor");
  const torch::Tensor ids = tokens.reshape({-1}).to(torch::kCPU, torch::kLong).contiguous();
  const int64_t* p = ids.data_ptr<int64_t>();
  std::vector<uint16_t> values(static_cast<size_t>(ids.numel()));
  for (size_t i = 0; i < values.size(); ++i) {
    TORCH_CHECK(p[i] >= 0 && p[i] <= 65535, "write_tokens: token ", p[i], " at position ", i,
                " does not fit in uint16 [0, 65535]");
    values[i] = static_cast<uint16_t>(p[i]);
  }
  write_tokens(path, values, format);
}

}  // namespace data
}  // namespace paratrain
