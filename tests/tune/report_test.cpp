// paratrain tune report: the HTML file is self-contained, and headless Chromium (Debian's
// chromium) renders its plots.

#include "paratrain/tune/report.h"
#include "paratrain/data/image.h"
#include "paratrain/launch/launch.h"
#include "paratrain/tune/tuner.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

namespace paratrain {
namespace tune {
namespace {

// Pixels within `tolerance` of an RGB color.
int64_t pixels_of(const torch::Tensor& rgb, int r, int g, int b, int tolerance = 12) {
  const auto img = rgb.to(torch::kInt32);
  const auto near = (img[0] - r).abs().le(tolerance) & (img[1] - g).abs().le(tolerance) &
                    (img[2] - b).abs().le(tolerance);
  return near.sum().item<int64_t>();
}

TEST(TuneReport, ChromiumRendersTheSelfContainedPlots) {
  const std::string dir = ::testing::TempDir() + testing::unique_token("tune-report");
  std::filesystem::create_directories(dir);
  SearchSpace space;
  space.add("lr=loguniform(1e-4, 1)");
  space.add("width=choice(16, 32)");
  tune(space,
       TunerOptions()
           .storage(dir + "/s.db")
           .study("r")
           .metric("loss")
           .num_samples(10)
           .cpus(2)
           .trial_dir(dir + "/t")
           .output("none")
           .scheduler(SchedulerOptions().kind("asha").max_t(6).reduction_factor(2)),
       [](TrialContext& t) {
         const double lr = to_double(t.config().at("lr"));
         for (int it = 1; it <= 6; ++it) {
           t.report({{"loss", std::pow(std::log10(lr) + 2, 2) + 1.0 / it}});
         }
       });
  const std::string html_path = dir + "/report.html";
  const auto r = testing::run_process({testing::cli_path(), "tune", "report", "--storage",
                                       dir + "/s.db", "--study", "r", "--out", html_path},
                                      {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(html_path);
  const std::string html((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(html.find("<script"), std::string::npos);
  EXPECT_EQ(html.find("src="), std::string::npos);
  EXPECT_EQ(html.find("href="), std::string::npos);
  size_t svgs = 0;
  for (size_t at = html.find("<svg"); at != std::string::npos; at = html.find("<svg", at + 1)) {
    ++svgs;
  }
  EXPECT_EQ(svgs, 4u) << "history, curves and one scatter per parameter";
  EXPECT_NE(html.find("<td>9</td>"), std::string::npos) << "the table lists trial 9";

  const auto missing =
      testing::run_process({testing::cli_path(), "tune", "report", "--storage", dir + "/s.db",
                            "--study", "nope", "--out", dir + "/x.html"},
                           {}, 60);
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.output.find("no study 'nope' in " + dir + "/s.db (it has r)"),
            std::string::npos)
      << missing.output;

  const std::string chromium = dist::find_program("chromium");
  if (chromium.empty()) {
    paratrain::testing::remove_tree(dir);
    GTEST_SKIP() << "no chromium to render the report (scripts/setup.sh installs it)";
  }
  const std::string shot = dir + "/shot.png";
  const auto c = testing::run_process(
      {chromium, "--headless", "--no-sandbox", "--disable-gpu", "--user-data-dir=" + dir + "/c",
       "--screenshot=" + shot, "--window-size=1280,1400", "file://" + html_path},
      {{"HOME", dir}}, 120);
  ASSERT_TRUE(std::filesystem::exists(shot)) << c.output;
  const torch::Tensor png = data::read_image(shot);
  // The history's and scatters' dots are #1f77b4, the best-so-far line #d62728: rendered SVG
  // leaves thousands of such pixels, a page whose plots failed to draw none.
  EXPECT_GT(pixels_of(png, 0x1f, 0x77, 0xb4), 1000);
  EXPECT_GT(pixels_of(png, 0xd6, 0x27, 0x28), 100);
  paratrain::testing::remove_tree(dir);
}

}  // namespace
}  // namespace tune
}  // namespace paratrain
