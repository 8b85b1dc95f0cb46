#include "paratrain/data/tokens.h"

#include "paratrain/util/atomic_file.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

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

// llm.c's version 2 (dev/data's --model_desc llama-3) holds uint32 tokens.
constexpr int32_t kLlmcTokensVersionUint32 = 2;
// What a user can do about a token file with an llm.c header paratrain cannot read.
constexpr const char* kLlmcRemedy =
    "Make the file again with llm.c's dev/data scripts for GPT-2 (uint16 tokens) or with "
    "paratrain's data::write_tokens, or give raw uint16 tokens as nanoGPT's prepare.py writes "
    "them";

std::string join_problems(const std::vector<std::string>& problems) {
  std::string out;
  for (const std::string& p : problems) {
    out += (out.empty() ? "" : "; ") + p;
  }
  return out;
}

// What is wrong with the llm.c header at the start of a file of `bytes` (>= 1024) bytes, each as
// the field, its value and what it should be; empty when paratrain reads the file as it is.
std::vector<std::string> llmc_header_problems(const unsigned char* p, size_t bytes) {
  std::vector<std::string> problems;
  const int32_t magic = le_int32_at(p, 0);
  const int32_t version = le_int32_at(p, 1);
  const int32_t count = le_int32_at(p, 2);
  if (magic != kLlmcTokensMagic) {
    problems.push_back("magic " + std::to_string(magic) + ", expected " +
                       std::to_string(kLlmcTokensMagic) + " (llm.c's" +
                       (magic == kLlmcModelMagic
                            ? "; 20240326 marks llm.c's model checkpoints, not token files"
                            : "") +
                       ")");
  }
  if (version != kLlmcTokensVersion) {
    problems.push_back("version " + std::to_string(version) +
                       (version == kLlmcTokensVersionUint32 ? " (uint32 LLaMA-3 tokens)" : "") +
                       ", expected " + std::to_string(kLlmcTokensVersion) +
                       " (uint16 GPT-2 tokens, the only kind paratrain reads)");
  }
  // The count is of the version's tokens: a version 2 file is measured in uint32.
  const size_t token_bytes = version == kLlmcTokensVersionUint32 ? 4 : 2;
  const size_t body = bytes - kLlmcHeaderBytes;
  if (body % token_bytes != 0) {
    problems.push_back("the " + std::to_string(body) + " bytes after the header are not whole " +
                       (token_bytes == 4 ? "uint32" : "uint16") + " tokens (truncated?)");
  } else if (static_cast<int64_t>(count) != static_cast<int64_t>(body / token_bytes)) {
    problems.push_back("token count " + std::to_string(count) +
                       " in the header but the file holds " + std::to_string(body / token_bytes) +
                       " (truncated or appended to?)");
  }
  return problems;
}

// How the first 1024 bytes of a file whose magic is not llm.c's still show llm.c's token header
// (data_common.py's write_datafile: np.zeros(256, int32), then magic, version and count in the
// first three), as words for the error; "" when they do not. Either of two shapes:
//
//   zeros  a version llm.c writes (1: uint16 tokens, 2: uint32) at int32 1, a count an int32 can
//          hold (>= 0) at int32 2, and all of int32 3 to 255 zero, as np.zeros left them;
//   size   a version llm.c writes and the count that the file's size gives (a header whose
//          reserved part was written over).
//
// Neither misfires on real nanoGPT tokens. Read as uint16 tokens, "zeros" is a file whose 3rd
// token is 1 or 2, 4th is 0, and 7th to 512th are all token 0: the same token 506 times in a row
// from its start. Token 0 is "!" in GPT-2's vocabulary, and BPE merges a run of "!" into longer
// tokens ("!!", ...), so GPT-2 text rarely holds token 0 even twice in a row; for tokens drawn
// independently at the rate of GPT-2's commonest token (about 1 in 25) the chance would be under
// 10^-700. Token 0 is "\n" in shakespeare_char's vocabulary and the NUL byte in byte-level files:
// 506 newlines or NULs do not open a text either. The file of all-zero tokens a test or a padding
// step writes has version 0 at int32 1, and stays nanoGPT's. "size" needs the 3rd to 6th tokens
// to spell 1 or 2, then 0, then the file's own length: four given tokens in a row, near one
// chance in 50257^4 (10^-18) for tokens spread over GPT-2's vocabulary. A file that does show
// either shape was written by llm.c's writer (or by a program that copies its layout) and then
// damaged: reading its header as 512 tokens would train on them silently, so it is refused,
// naming what is wrong.
std::string llmc_header_shape(const unsigned char* p, size_t bytes) {
  if (bytes < kLlmcHeaderBytes) {
    return "";
  }
  const int32_t version = le_int32_at(p, 1);
  const int32_t count = le_int32_at(p, 2);
  if (version != kLlmcTokensVersion && version != kLlmcTokensVersionUint32) {
    return "";
  }
  bool reserved_zero = count >= 0;
  for (size_t i = 3; i < kLlmcHeaderInts && reserved_zero; ++i) {
    reserved_zero = le_int32_at(p, i) == 0;
  }
  const std::string at = "version " + std::to_string(version) + " at int32 1, ";
  if (reserved_zero) {
    return at + "a count at int32 2, zeros from int32 3 to 255";
  }
  const size_t token_bytes = version == kLlmcTokensVersionUint32 ? 4 : 2;
  const size_t body = bytes - kLlmcHeaderBytes;
  if (body % token_bytes == 0 &&
      static_cast<int64_t>(count) == static_cast<int64_t>(body / token_bytes)) {
    return at + "a count at int32 2 that matches the file's size";
  }
  return "";
}

// Which format the file is, from its first bytes and its size; one line naming the file for
// anything that is not whole tokens of either. A file whose first int32 is 20240520 is llm.c's
// (as raw tokens it would start with 55432, past GPT-2's 50257); one whose first 1024 bytes show
// llm.c's header under another magic (llmc_header_shape) is refused, naming what is wrong with
// the header, rather than read as tokens header and all; any other is nanoGPT's.
TokenFileLayout token_file_layout(const std::string& path, const unsigned char* p, size_t bytes) {
  const int32_t first = bytes >= 4 ? le_int32_at(p, 0) : 0;
  if (first == kLlmcTokensMagic) {
    TORCH_CHECK(bytes >= kLlmcHeaderBytes, "TokenDataset: ", path, " starts with llm.c's magic ",
                kLlmcTokensMagic, " but is ", bytes, " bytes, shorter than its ", kLlmcHeaderBytes,
                "-byte header");
    const std::vector<std::string> problems = llmc_header_problems(p, bytes);
    TORCH_CHECK(problems.empty(), "TokenDataset: ", path, " is an llm.c token file (magic ",
                kLlmcTokensMagic, ") that paratrain cannot read: ", join_problems(problems), ". ",
                kLlmcRemedy);
    return {"llmc", kLlmcHeaderBytes, le_int32_at(p, 2)};
  }
  const std::string shape = llmc_header_shape(p, bytes);
  TORCH_CHECK(shape.empty(), "TokenDataset: ", path,
              " starts with a 1024-byte header laid out as llm.c's (", shape,
              "), not with tokens, and paratrain cannot read it: ",
              join_problems(llmc_header_problems(p, bytes)), ". ", kLlmcRemedy);
  TORCH_CHECK(bytes % 2 == 0, "TokenDataset: ", path, " is ", bytes,
              " bytes, an odd number: not whole uint16 tokens (nanoGPT's raw format; llm.c's "
              "starts with the int32 ",
              kLlmcTokensMagic, ")");
  return {"nanogpt", 0, static_cast<int64_t>(bytes / 2)};
}

// Closes a descriptor when it goes.
struct FdGuard {
  int fd = -1;
  ~FdGuard() {
    if (fd >= 0) {
      ::close(fd);
    }
  }
};

// Refuses `path` before anything opens it, in one line naming it (after `prefix`): missing or
// unreachable (stat's error), a folder (then `folder_advice`: what to give instead), or, when
// `regular_only`, anything but a plain file. A folder is caught here because open() accepts one
// and only the first read fails: a stream then throws libstdc++'s "basic_filebuf::underflow error
// reading the file: Is a directory", which names neither the file nor what to do. A FIFO is
// refused where the file is to be mapped, since open() would first wait for a writer.
void check_input_path(const std::string& prefix,
                      const std::string& path,
                      const std::string& folder_advice,
                      bool regular_only) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const std::string why = std::strerror(errno);
    TORCH_CHECK(false, prefix, "cannot open ", path, ": ", why);
  }
  TORCH_CHECK(!S_ISDIR(st.st_mode), prefix, "cannot read ", path, ": it is a folder, ",
              folder_advice);
  TORCH_CHECK(!regular_only || S_ISREG(st.st_mode), prefix, "cannot read ", path,
              ": not a regular file (a pipe, socket or device): give a plain file");
}

// Opens `path` read-only; one line naming it when that fails (permission denied, ...).
int open_input(const std::string& prefix, const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const std::string why = std::strerror(errno);
    TORCH_CHECK(false, prefix, "cannot open ", path, ": ", why);
  }
  return fd;
}

// Maps the whole of `path` read-only into `map` (null for an empty file, which mmap refuses);
// returns its size. The mapping outlives the descriptor.
size_t map_read_only(const std::string& path, void*& map) {
  check_input_path("TokenDataset: ", path,
                   "not a token file: give one of its files (e.g. train.bin or val.bin)", true);
  const FdGuard fd{open_input("TokenDataset: ", path)};
  // Stated again through the descriptor: the size mapped is the size of what was opened.
  struct stat st {};
  if (::fstat(fd.fd, &st) != 0) {
    const std::string why = std::strerror(errno);
    TORCH_CHECK(false, "TokenDataset: cannot read ", path, ": ", why);
  }
  TORCH_CHECK(S_ISREG(st.st_mode), "TokenDataset: cannot read ", path,
              ": not a regular file (replaced while it was opened?)");
  const auto bytes = static_cast<size_t>(st.st_size);
  void* p = bytes > 0 ? ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd.fd, 0) : nullptr;
  if (p == MAP_FAILED) {
    const std::string why = std::strerror(errno);
    TORCH_CHECK(false, "TokenDataset: cannot map ", path, ": ", why);
  }
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

// ---- reading bytes ------------------------------------------------------------------------------

std::vector<uint16_t> read_byte_tokens(const std::string& path) {
  // Pipes and devices are read too (`--bytes <(zcat a.gz)`, /dev/stdin); only a folder is refused.
  check_input_path("", path,
                   "not a file: give one file (to tokenize the files of a folder, join them "
                   "first: cat DIR/*.txt > input.txt)",
                   false);
  const FdGuard fd{open_input("", path)};
  std::vector<uint16_t> tokens;
  std::vector<unsigned char> buffer(1 << 16);
  for (;;) {
    const ssize_t n = ::read(fd.fd, buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n < 0) {
      const std::string why = std::strerror(errno);
      TORCH_CHECK(false, "cannot read ", path, ": ", why);
    }
    if (n == 0) {
      return tokens;
    }
    tokens.insert(tokens.end(), buffer.begin(), buffer.begin() + n);
  }
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
