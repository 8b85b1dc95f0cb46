// DistributedSampler against index sequences written by PyTorch's own DistributedSampler
// (tests/data/make_sampler_reference.py, run with Debian's python3-torch).

#include "paratrain/data/distributed_sampler.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

namespace paratrain {
namespace data {
namespace {

TEST(DistributedSampler, MatchesPyTorch) {
  std::ifstream in(PARATRAIN_TEST_DATA_DIR "/sampler_reference.txt");
  ASSERT_TRUE(in.good()) << "missing tests/data/sampler_reference.txt";
  std::string line;
  int cases = 0;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') {
      continue;
    }
    std::istringstream s(line);
    size_t size, count;
    int replicas, rank, shuffle, drop_last;
    uint64_t seed, epoch, checksum;
    s >> size >> replicas >> rank >> shuffle >> seed >> drop_last >> epoch >> count >> checksum;
    std::vector<size_t> shown;
    for (size_t v; s >> v;) {
      shown.push_back(v);
    }
    DistributedSampler sampler(size, replicas, rank, shuffle != 0, seed, drop_last != 0);
    sampler.set_epoch(epoch);
    const auto& got = sampler.indices();
    ASSERT_EQ(got.size(), count) << line.substr(0, 80);
    EXPECT_EQ(sampler.num_samples(), count);
    unsigned __int128 sum = 0;
    for (size_t k = 0; k < got.size(); ++k) {
      sum += static_cast<unsigned __int128>(k + 1) * got[k];
    }
    EXPECT_EQ(static_cast<uint64_t>(sum % (static_cast<unsigned __int128>(1) << 61)), checksum)
        << line.substr(0, 80);
    EXPECT_EQ(std::vector<size_t>(got.begin(), got.begin() + static_cast<long>(shown.size())),
              shown)
        << line.substr(0, 80);
    ++cases;
  }
  EXPECT_GE(cases, 50);
}

TEST(DistributedSampler, EpochsDifferAndRanksPartition) {
  DistributedSampler a(100, 2, 0, true, 7);
  DistributedSampler b(100, 2, 1, true, 7);
  std::vector<size_t> all(a.indices());
  all.insert(all.end(), b.indices().begin(), b.indices().end());
  std::sort(all.begin(), all.end());
  for (size_t i = 0; i < 100; ++i) {
    EXPECT_EQ(all[i], i);
  }
  auto first = a.indices();
  a.set_epoch(1);
  EXPECT_NE(a.indices(), first) << "set_epoch must reshuffle";
  a.set_epoch(0);
  EXPECT_EQ(a.indices(), first) << "the same epoch must give the same order";
}

TEST(DistributedSampler, BatchesThroughTheSamplerInterface) {
  DistributedSampler s(10, 3, 1, false);
  auto batch = s.next(3);
  ASSERT_TRUE(batch.has_value());
  EXPECT_EQ(*batch, (std::vector<size_t>{1, 4, 7}));
  batch = s.next(3);
  ASSERT_TRUE(batch.has_value());
  EXPECT_EQ(*batch, (std::vector<size_t>{0}));  // the padding index
  EXPECT_FALSE(s.next(3).has_value());
  s.reset();
  EXPECT_EQ(s.next(1)->front(), 1u);
}

TEST(DistributedSampler, RejectsBadArguments) {
  EXPECT_THROW(DistributedSampler(10, 0, 0), c10::Error);
  try {
    DistributedSampler(10, 2, 2);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace())
                  .find("invalid rank 2, rank should be in the interval [0, 1]"),
              std::string::npos);
  }
}

}  // namespace
}  // namespace data
}  // namespace paratrain
