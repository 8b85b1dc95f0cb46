// The Chrome-trace timeline: a bounded number of events, and a count of the ones it dropped.

#include "test_util.h"

#include "paratrain/util/trace.h"

#include <cstdio>
#include <fstream>
#include <iterator>

#include <gtest/gtest.h>

namespace paratrain {
namespace testing {
namespace {

TEST(Trace, KeepsAtMostMaxEventsAndSaysHowManyItDropped) {
  trace::Tracer tracer(3, /*max_events=*/3);
  const auto t0 = trace::Clock::now();
  for (int i = 0; i < 5; ++i) {
    tracer.complete("span " + std::to_string(i), "compute", t0, t0 + std::chrono::microseconds(i));
  }
  EXPECT_EQ(tracer.size(), 3u);
  EXPECT_EQ(tracer.dropped(), 2u);
  const std::string path = "/tmp/" + unique_token("trace") + ".json";
  tracer.write(path);
  std::ifstream in(path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("\"span 2\""), std::string::npos) << text;
  EXPECT_EQ(text.find("\"span 3\""), std::string::npos) << text;
  EXPECT_NE(text.find("trace full: 2 later spans left out (max_events 3)"), std::string::npos)
      << text;
  EXPECT_NE(text.find("\"rank 3\""), std::string::npos) << text;
  std::remove(path.c_str());
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
