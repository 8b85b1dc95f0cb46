// The safetensors files that checkpoints and weights use: a round trip, a mis-shaped tensor, a
// header read as JSON (escapes, key order, unknown keys, nesting and size limits), and metadata.

#include "test_util.h"

#include "paratrain/io/safetensors.h"
#include "paratrain/models/registry.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <fstream>

namespace paratrain {
namespace testing {
namespace {

TEST(Safetensors, RoundTripAndMisshapedTensor) {
  std::string path = "/tmp/" + unique_token("st") + ".safetensors";
  std::map<std::string, torch::Tensor> state{
      {"a", torch::randn({3, 4})},
      {"b", torch::arange(5, torch::kLong)},
      {"c", torch::randn({2}).to(torch::kBFloat16)},
      {"d", torch::ones({0, 3})},
  };
  save_safetensors(state, path);
  auto back = load_safetensors(path);
  ASSERT_EQ(back.size(), 4u);
  for (const auto& kv : state) {
    EXPECT_TRUE(torch::equal(back.at(kv.first), kv.second)) << kv.first;
  }
  // A weight of the wrong shape is named with both shapes.
  auto model = models::make("linear");
  auto weights = module_state(*model);
  weights["fc.weight"] = torch::zeros({10, 783});
  try {
    load_module_state(*model, weights);
    FAIL() << "no error for a mis-shaped tensor";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace())
                  .find("'fc.weight' has shape [10, 783] in the file but [10, 784] in the model"),
              std::string::npos)
        << e.what_without_backtrace();
  }
  // Header length that does not fit the file.
  {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    uint64_t n = 1000;
    f.write(reinterpret_cast<const char*>(&n), 8);
    f << "{}";
  }
  EXPECT_THROW(load_safetensors(path), c10::Error);
  std::remove(path.c_str());
}

// A safetensors file made of `header` (padded to 8 bytes, as the format does) and `payload`.
std::string safetensors_bytes(std::string header, const std::string& payload = "") {
  while (header.size() % 8 != 0) {
    header += ' ';
  }
  std::string out;
  for (int i = 0; i < 8; ++i) {
    out += static_cast<char>((header.size() >> (8 * i)) & 0xff);
  }
  return out + header + payload;
}

TEST(Safetensors, HeaderIsReadAsJson) {
  // JSON's escapes in names, keys in any order, and unknown keys beside the known ones.
  const std::string payload(8, '\0');
  const auto ok = safetensors_bytes(
      R"({"b\u00e9ta\n":{"data_offsets":[0,8],"x":[[{}]],"shape":[2],"dtype":"F32"},)"
      R"("__metadata__":{"format":"pt"}})",
      payload);
  const auto tensors = load_safetensors_bytes(ok.data(), ok.size(), "ok");
  ASSERT_EQ(tensors.size(), 1u);
  EXPECT_EQ(tensors.begin()->first, "b\xc3\xa9ta\n");
  EXPECT_EQ(tensors.begin()->second.sizes(), torch::IntArrayRef({2}));

  auto error = [&](const std::string& header) {
    const auto bytes = safetensors_bytes(header, payload);
    return error_of([&] { load_safetensors_bytes(bytes.data(), bytes.size(), "f"); });
  };
  const std::string deep = std::string(100, '[') + std::string(100, ']');
  EXPECT_NE(error(R"({"__metadata__":)" + deep + "}").find("values nested more than 64 deep"),
            std::string::npos);
  EXPECT_NE(error(R"({"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})")
                .find("the shape of 'a' holds 2.5, not an integer"),
            std::string::npos);
  EXPECT_NE(error(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,18446744073709551615]}})")
                .find("data_offsets of 'a' holds a number beyond 64 bits"),
            std::string::npos);
  EXPECT_NE(error(R"({"a":{"dtype":"F32","shape":[2]}})").find("'a' lacks dtype or data_offsets"),
            std::string::npos);
  EXPECT_NE(error(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})")
                .find("data_offsets of 'a' must hold two numbers"),
            std::string::npos);
  EXPECT_NE(error(R"({"a":{"dtype":"F32",)")
                .find("f is not a valid safetensors file: the header "
                      "is not JSON (parse error at line 1"),
            std::string::npos);
  EXPECT_NE(error("[1]").find("the header is not a JSON object"), std::string::npos);
  EXPECT_NE(error(R"({"a":[1]})").find("tensor 'a' is not an object"), std::string::npos);
  EXPECT_NE(error(R"({"a":{"dtype":"F32","shape":[[2]],"data_offsets":[0,8]}})")
                .find("the shape of 'a' holds a nested value"),
            std::string::npos);
  std::string long_shape = R"({"a":{"dtype":"F32","data_offsets":[0,8],"shape":[1)";
  for (int i = 0; i < 64; ++i) {
    long_shape += ",1";
  }
  EXPECT_NE(error(long_shape + "]}}").find("the shape of 'a' holds more than 64 values"),
            std::string::npos);
  // What the reader does not need is dropped as it is read, however large or deep (to the
  // nesting limit).
  std::string many_ones;
  for (int i = 0; i < 50000; ++i) {
    many_ones += "1,";
  }
  const auto dropped = safetensors_bytes(
      R"({"__metadata__":{"big":[)" + many_ones + R"([[[]]]]},)" +
          R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"extra":{"k":[1,2,3]}}})",
      payload);
  EXPECT_EQ(load_safetensors_bytes(dropped.data(), dropped.size(), "f").size(), 1u);

  // Names that JSON escapes round-trip; a name that is not UTF-8 is refused when saved, since
  // no reader would accept the file.
  const std::string path = "/tmp/" + unique_token("names") + ".safetensors";
  const std::string odd =
      "q\"u\\o\nt\x01"
      "e \xc3\xa9";
  save_safetensors({{odd, torch::ones({2})}}, path);
  EXPECT_EQ(load_safetensors(path).count(odd), 1u);
  std::remove(path.c_str());
  EXPECT_NE(error_of([&] {
              save_safetensors({{"bad\xff", torch::ones({1})}}, path);
            }).find("the tensor name 'bad\xff' is not valid UTF-8"),
            std::string::npos);
}

// The header's __metadata__: written with the tensors, read back alone (without the tensors) or
// from memory, and a filter that reads only some tensors.
TEST(Safetensors, MetadataAndFilteredReads) {
  const std::string path = "/tmp/" + unique_token("meta") + ".safetensors";
  const std::map<std::string, torch::Tensor> tensors{{"a.x", torch::ones({2})},
                                                     {"b.y", torch::arange(3)}};
  const SafetensorsParts parts =
      encode_safetensors(tensors, {{"step", "7"}, {"json", "{\"k\":1}"}});
  {
    std::ofstream f(path, std::ios::binary);
    f << parts.header;
    for (const auto& t : parts.tensors) {
      f.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
    }
  }
  const std::map<std::string, std::string> want{
      {"format", "pt"}, {"json", "{\"k\":1}"}, {"step", "7"}};
  EXPECT_EQ(load_safetensors_metadata(path), want);
  EXPECT_EQ(load_safetensors(path).size(), 2u);
  const auto only_a = load_safetensors(path, [](const std::string& n) { return n[0] == 'a'; });
  ASSERT_EQ(only_a.size(), 1u);
  EXPECT_TRUE(torch::equal(only_a.at("a.x"), tensors.at("a.x")));
  // A file without metadata has none; a value that is not text comes back as its JSON.
  const auto bare = safetensors_bytes(R"({"__metadata__":{"n":[1,2]}})");
  EXPECT_EQ(safetensors_metadata_bytes(bare.data(), bare.size()).at("n"), "[1,2]");
  const auto none = safetensors_bytes("{}");
  EXPECT_TRUE(safetensors_metadata_bytes(none.data(), none.size()).empty());
  EXPECT_NE(error_of([&] {
              encode_safetensors(tensors, {{"k", "bad\xff"}});
            }).find("the metadata value 'bad\xff' is not valid UTF-8"),
            std::string::npos);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
