// Search spaces, searchers and schedulers of paratrain::tune, against Ray Tune's, Optuna's and
// HpBandSter's documented rules.

#include "paratrain/tune/scheduler.h"
#include "paratrain/tune/searcher.h"
#include "paratrain/tune/space.h"
#include "paratrain/tune/storage.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <set>

namespace paratrain {
namespace tune {
namespace {

using testing::error_of;

TEST(TuneSpace, ParsesRayTunesDistributions) {
  EXPECT_EQ(Domain::parse("uniform(0, 0.5)").to_string(), "uniform(0, 0.5)");
  EXPECT_EQ(Domain::parse(" loguniform( 1e-3 ,0.3 ) ").to_string(), "loguniform(0.001, 0.3)");
  EXPECT_EQ(Domain::parse("quniform(0, 1, 0.25)").to_string(), "quniform(0, 1, 0.25)");
  EXPECT_EQ(Domain::parse("qloguniform(1, 100, 5)").to_string(), "qloguniform(1, 100, 5)");
  EXPECT_EQ(Domain::parse("randint(2, 9)").to_string(), "randint(2, 9)");
  const Domain c = Domain::parse("choice(32, 0.5, sgd, 'a b')");
  ASSERT_EQ(c.values().size(), 4u);
  EXPECT_EQ(std::get<int64_t>(c.values()[0]), 32);
  EXPECT_EQ(std::get<double>(c.values()[1]), 0.5);
  EXPECT_EQ(std::get<std::string>(c.values()[2]), "sgd");
  EXPECT_EQ(std::get<std::string>(c.values()[3]), "a b");
  EXPECT_EQ(Domain::parse(c.to_string()).to_string(), c.to_string());  // reads back
  EXPECT_EQ(Domain::parse("grid_search([1, 2, 3])").values().size(), 3u);
  EXPECT_EQ(Domain::parse("choice(\"1\")").to_string(), "choice(\"1\")");  // a string stays one
}

TEST(TuneSpace, BadInputIsOneClearError) {
  EXPECT_NE(error_of([] { Domain::parse("normal(0, 1)"); }).find("unknown distribution 'normal'"),
            std::string::npos);
  EXPECT_NE(error_of([] { Domain::parse("uniform(1, 1)"); }).find("needs low < high"),
            std::string::npos);
  EXPECT_NE(error_of([] { Domain::parse("randint(5, 2)"); }).find("needs low < high"),
            std::string::npos);
  EXPECT_NE(error_of([] { Domain::parse("loguniform(0, 1)"); }).find("needs low > 0"),
            std::string::npos);
  EXPECT_NE(error_of([] { Domain::parse("choice()"); }).find("at least one value"),
            std::string::npos);
  EXPECT_NE(error_of([] { Domain::parse("choice([])"); }).find("at least one value"),
            std::string::npos);
  EXPECT_NE(error_of([] { Domain::parse("quniform(0, 1, 0)"); }).find("needs q > 0"),
            std::string::npos);
  EXPECT_NE(error_of([] { Domain::parse("uniform(0, x)"); }).find("not a number: 'x'"),
            std::string::npos);
  EXPECT_NE(error_of([] { Domain::parse("uniform(0)"); }).find("takes 2 arguments"),
            std::string::npos);
  EXPECT_NE(error_of([] { Domain::parse("lr"); }).find("is not a distribution"), std::string::npos);
  SearchSpace s;
  s.add("lr=uniform(0, 1)");
  EXPECT_NE(error_of([&] { s.add("lr=uniform(0, 2)"); }).find("given twice"), std::string::npos);
  EXPECT_NE(error_of([&] { s.add("uniform(0, 2)"); }).find("NAME=DISTRIBUTION"), std::string::npos);
  EXPECT_NE(error_of([&] { s.add("a b=uniform(0, 2)"); }).find("not a valid parameter name"),
            std::string::npos);
}

TEST(TuneSpace, SamplesStayInTheirDomains) {
  std::mt19937_64 rng(1);
  const Domain ri = Domain::randint(2, 5), lu = Domain::loguniform(1e-4, 1e-1),
               qu = Domain::quniform(0, 1, 0.25), u = Domain::uniform(-1, 1);
  std::set<int64_t> ints;
  int below_1e3 = 0;
  for (int i = 0; i < 4000; ++i) {
    ints.insert(std::get<int64_t>(ri.sample(rng)));
    const double l = std::get<double>(lu.sample(rng));
    ASSERT_TRUE(l >= 1e-4 && l <= 1e-1) << l;
    below_1e3 += l < 1e-3;
    const double q = std::get<double>(qu.sample(rng));
    ASSERT_DOUBLE_EQ(q, std::round(q / 0.25) * 0.25);
    const double x = std::get<double>(u.sample(rng));
    ASSERT_TRUE(x >= -1 && x < 1);
  }
  EXPECT_EQ(ints, (std::set<int64_t>{2, 3, 4}));     // Ray's randint: high is exclusive
  EXPECT_NEAR(below_1e3 / 4000.0, 1.0 / 3.0, 0.05);  // uniform in log space: 1 decade of 3
}

SearchSpace two_params() {
  SearchSpace s;
  s.add("lr=loguniform(1e-4, 1)");
  s.add("width=choice(16, 32, 64)");
  return s;
}

TEST(TuneSearcher, GridWalksEveryCombinationNumSamplesTimes) {
  SearchSpace s;
  s.add("a=grid_search(1, 2)");
  s.add("b=grid_search(x, y, z)");
  s.add("lr=uniform(0, 1)");
  auto grid = make_searcher(s, SearcherOptions().kind("grid").num_samples(2));
  std::vector<std::string> seen;
  for (int64_t n = 0; n < 12; ++n) {
    const auto c = grid->suggest(n);
    ASSERT_TRUE(c) << n;
    seen.push_back(to_string(c->at("a")) + to_string(c->at("b")));
  }
  EXPECT_FALSE(grid->suggest(12));
  const std::vector<std::string> pass{"1x", "1y", "1z", "2x", "2y", "2z"};
  EXPECT_EQ(std::vector<std::string>(seen.begin(), seen.begin() + 6), pass);
  EXPECT_EQ(std::vector<std::string>(seen.begin() + 6, seen.end()), pass);
}

TEST(TuneSearcher, SeededSearchersAreReproducible) {
  for (const char* kind : {"random", "tpe", "bohb"}) {
    auto a = make_searcher(two_params(), SearcherOptions().kind(kind).seed(7).num_samples(50));
    auto b = make_searcher(two_params(), SearcherOptions().kind(kind).seed(7).num_samples(50));
    auto c = make_searcher(two_params(), SearcherOptions().kind(kind).seed(8).num_samples(50));
    int differ = 0;
    for (int64_t n = 0; n < 30; ++n) {
      const Config ca = *a->suggest(n), cb = *b->suggest(n), cc = *c->suggest(n);
      ASSERT_EQ(to_string(ca), to_string(cb)) << kind << " trial " << n;
      differ += to_string(ca) != to_string(cc);
      const double loss = std::pow(std::log10(to_double(ca.at("lr"))) + 2, 2);
      for (auto* s : {a.get(), b.get(), c.get()}) {
        s->on_result(n, ca, 1, loss);
        s->on_complete(n, ca, Outcome::kComplete, loss);
      }
    }
    EXPECT_GT(differ, 20) << kind;
  }
}

// Over 60 trials on loss = (log10 lr + 2)^2 + [width != 32], the model-based searchers'
// later proposals are much closer to the optimum (lr 1e-2, width 32) than random search's.
double later_mean_loss(const char* kind, uint64_t seed) {
  auto s = make_searcher(two_params(), SearcherOptions().kind(kind).seed(seed).num_samples(60));
  double later = 0;
  for (int64_t n = 0; n < 60; ++n) {
    const Config c = *s->suggest(n);
    const double loss = std::pow(std::log10(to_double(c.at("lr"))) + 2, 2) +
                        (std::get<int64_t>(c.at("width")) == 32 ? 0 : 1);
    for (int64_t budget : {1, 3}) {
      s->on_result(n, c, budget, loss);
      s->on_rung(n, c, budget, loss);
    }
    s->on_complete(n, c, Outcome::kComplete, loss);
    later += n >= 30 ? loss / 30 : 0;
  }
  return later;
}

TEST(TuneSearcher, TpeAndBohbLearnFromResults) {
  double random = 0, tpe = 0, bohb = 0;
  for (uint64_t seed = 0; seed < 3; ++seed) {
    random += later_mean_loss("random", seed) / 3;
    tpe += later_mean_loss("tpe", seed) / 3;
    bohb += later_mean_loss("bohb", seed) / 3;
  }
  EXPECT_LT(tpe, 0.5 * random) << "tpe " << tpe << " random " << random;
  EXPECT_LT(bohb, 0.6 * random) << "bohb " << bohb << " random " << random;
}

TEST(TuneSearcher, ModelSearchersRefuseGrids) {
  SearchSpace s;
  s.add("a=grid_search(1, 2)");
  EXPECT_NE(error_of([&] {
              make_searcher(s, SearcherOptions().kind("tpe"));
            }).find("needs the grid (or random) searcher"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              make_searcher(s, SearcherOptions().kind("cmaes"));
            }).find("unknown searcher 'cmaes'"),
            std::string::npos);
}

TEST(TuneScheduler, AshaStopsBelowTheRungsTopQuarter) {
  // Ray's AsyncHyperBandScheduler with grace_period 1, reduction_factor 2, max_t 4: rungs at
  // 1 and 2 (and 4 = max_t). At a rung, a trial stops when its reward is below the rung's
  // (1 - 1/rf) percentile of the rewards recorded before it.
  auto asha = make_scheduler(SchedulerOptions().kind("asha").max_t(4).reduction_factor(2));
  EXPECT_EQ(asha->on_result(0, 1, 1.0), Decision::kContinue);  // first at the rung
  EXPECT_EQ(asha->on_result(1, 1, 2.0), Decision::kStop);      // worse than the median (1.0)
  EXPECT_EQ(asha->on_result(2, 1, 0.5), Decision::kContinue);  // better
  EXPECT_EQ(asha->on_result(3, 1, 1.2), Decision::kStop);      // median of {1, 2, .5} is 1
  EXPECT_EQ(asha->on_result(0, 2, 0.9), Decision::kContinue);
  EXPECT_EQ(asha->on_result(2, 2, 0.95), Decision::kStop);
  EXPECT_EQ(asha->on_result(0, 3, 0.9), Decision::kContinue);  // between rungs
  EXPECT_EQ(asha->on_result(0, 4, 0.8), Decision::kComplete);  // max_t
}

TEST(TuneScheduler, AshaNamesTheRungItRecordedAResultAt) {
  // grace 1, rf 3, max_t 9: rungs at 1 and 3. BOHB learns from exactly these results.
  auto asha = make_scheduler(SchedulerOptions().kind("asha").max_t(9).reduction_factor(3));
  EXPECT_EQ(asha->last_rung(), 0);
  asha->on_result(0, 1, 1.0);
  EXPECT_EQ(asha->last_rung(), 1);
  asha->on_result(0, 2, 1.0);
  EXPECT_EQ(asha->last_rung(), 0);  // between rungs
  EXPECT_EQ(asha->on_result(1, 1, 2.0), Decision::kStop);
  EXPECT_EQ(asha->last_rung(), 1);  // a stopped trial's result counts at its rung too
  asha->on_result(0, 3, 0.5);
  EXPECT_EQ(asha->last_rung(), 3);
  asha->on_result(0, 4, 0.5);
  EXPECT_EQ(asha->last_rung(), 0);
  auto fifo = make_scheduler(SchedulerOptions().kind("fifo").max_t(9));
  fifo->on_result(0, 1, 1.0);
  EXPECT_EQ(fifo->last_rung(), 0);
}

TEST(TuneScheduler, MedianRuleComparesRunningMeans) {
  auto median = make_scheduler(SchedulerOptions().kind("median").grace_period(1));
  for (int64_t n = 0; n < 3; ++n) {  // three trials with losses 1, 2, 3 at iterations 1..3
    for (int64_t it = 1; it <= 3; ++it) {
      EXPECT_EQ(median->on_result(n, it, 1.0 + static_cast<double>(n)), Decision::kContinue);
    }
  }
  EXPECT_EQ(median->on_result(3, 1, 5.0), Decision::kContinue);  // within the grace period
  EXPECT_EQ(median->on_result(3, 2, 2.5), Decision::kStop);      // best 2.5 worse than 2
  EXPECT_EQ(median->on_result(4, 1, 5.0), Decision::kContinue);
  EXPECT_EQ(median->on_result(4, 2, 1.5), Decision::kContinue);  // better than the median
}

TEST(TuneScheduler, HyperbandPromotesTheBestThirdOfAFullRung) {
  // max_t 9, eta 3: s_max 2; the first bracket has 9 trials at 1, 3 at 3, 1 at 9.
  auto hb = make_scheduler(SchedulerOptions().kind("hyperband").max_t(9));
  for (int64_t n = 0; n < 9; ++n) {
    hb->on_trial_add(n);
  }
  for (int64_t n = 0; n < 9; ++n) {
    EXPECT_EQ(hb->on_result(n, 1, static_cast<double>((n * 5) % 9)), Decision::kPause);
    if (n < 8) {
      EXPECT_TRUE(hb->take_promoted().empty()) << "promoted before the rung was full";
    }
  }
  std::vector<int64_t> promoted = hb->take_promoted();  // losses 0, 1, 2: trials 0, 2, 4
  std::sort(promoted.begin(), promoted.end());
  EXPECT_EQ(promoted, (std::vector<int64_t>{0, 2, 4}));
  EXPECT_EQ(hb->take_dropped().size(), 6u);
  EXPECT_EQ(hb->on_result(0, 2, 0.1), Decision::kContinue);  // below the next rung's budget 3
  EXPECT_EQ(hb->on_result(0, 3, 0.5), Decision::kPause);
  EXPECT_EQ(hb->on_result(2, 3, 0.2), Decision::kPause);
  hb->on_trial_end(4, 9.0);  // crashed before its milestone: counted as the worst
  EXPECT_EQ(hb->take_promoted(), (std::vector<int64_t>{2}));
  EXPECT_EQ(hb->take_dropped(), (std::vector<int64_t>{0}));
  EXPECT_EQ(hb->on_result(2, 9, 0.1), Decision::kComplete);
  hb->on_trial_add(9);  // the next bracket (s = 1): 3 trials at 3 iterations
  EXPECT_EQ(hb->on_result(9, 1, 1.0), Decision::kContinue);
  EXPECT_EQ(hb->on_result(9, 3, 1.0), Decision::kPause);
  hb->on_no_more_trials();  // it closes with one trial, which goes on
  EXPECT_EQ(hb->take_promoted(), (std::vector<int64_t>{9}));
}

TEST(TuneScheduler, BadOptions) {
  EXPECT_NE(error_of([] {
              make_scheduler(SchedulerOptions().kind("bohb"));
            }).find("unknown scheduler 'bohb'; use fifo, asha, hyperband, median or pbt"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              make_scheduler(SchedulerOptions().kind("asha").reduction_factor(1));
            }).find("reduction_factor must be > 1"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              make_scheduler(SchedulerOptions().kind("asha").max_t(2).grace_period(3));
            }).find("must be >= grace_period"),
            std::string::npos);
  auto fifo = make_scheduler(SchedulerOptions().kind("fifo").max_t(2));
  EXPECT_EQ(fifo->on_result(0, 1, 0), Decision::kContinue);
  EXPECT_EQ(fifo->on_result(0, 2, 0), Decision::kComplete);
}

TEST(TuneStorage, KeepsTrialsAndRefusesAnotherSpace) {
  const std::string dir = ::testing::TempDir() + testing::unique_token("tune-storage");
  std::filesystem::create_directories(dir);
  const std::string url = "sqlite:///" + dir + "/s.db";
  const StudySpec spec{"s", two_params().canonical(), "loss", "min"};
  {
    auto st = open_storage(url);
    st->open_study(spec);
    TrialRecord r;
    r.number = 0;
    r.config = {{"lr", 0.01}, {"width", int64_t{32}}, {"opt", std::string("sgd")}};
    r.state = TrialState::kRunning;
    r.worker = "w:0";
    st->add_trial(r);
    EXPECT_TRUE(st->add_result(0, 1, 0.5, "{\"loss\": 0.5}", "w:0"));
    EXPECT_TRUE(st->add_result(0, 2, 0.25, "{\"loss\": 0.25}", "w:0"));
    EXPECT_FALSE(st->add_result(0, 3, 0.1, "{\"loss\": 0.1}", "w:9"));  // not its holder
    r.state = TrialState::kComplete;
    r.exit_status = 3;
    r.log_path = "x.log";
    EXPECT_FALSE(st->update_trial(r, TrialState::kPending, ""));     // it is RUNNING
    EXPECT_FALSE(st->update_trial(r, TrialState::kRunning, "w:9"));  // not w:9's
    EXPECT_TRUE(st->update_trial(r, TrialState::kRunning, "w:0"));
    EXPECT_FALSE(st->update_trial(r, TrialState::kRunning, ""));  // moved on: refused
    // Reserving, claiming and releasing: each succeeds once.
    EXPECT_EQ(st->reserve_trial(3, "w:1"), 1);
    EXPECT_EQ(st->reserve_trial(3, "w:2"), 2);
    EXPECT_EQ(st->reserve_trial(3, "w:1"), -1);  // the study has its 3 trials
    EXPECT_EQ(st->heartbeat("w:1"), (std::vector<int64_t>{1}));
    EXPECT_FALSE(st->release_trial(1, "w:2", 1e300));  // not w:2's
    EXPECT_FALSE(st->release_trial(1, "w:1", 0));      // its heartbeat is newer than that
    EXPECT_TRUE(st->release_trial(1, "w:1", 1e300));
    EXPECT_TRUE(st->heartbeat("w:1").empty());
    EXPECT_TRUE(st->claim_trial(1, "w:2"));
    EXPECT_FALSE(st->claim_trial(1, "w:1"));
    EXPECT_NE(error_of([&] { st->add_trial(r); }).find("UNIQUE"), std::string::npos);
  }
  auto st = open_storage(dir + "/s.db");  // a plain path is the same file
  st->open_study(spec);
  const auto trials = st->load_trials();
  ASSERT_EQ(trials.size(), 3u);
  EXPECT_EQ(trials[1].attempts, 1);
  EXPECT_EQ(trials[1].worker, "w:2");
  EXPECT_EQ(trials[0].state, TrialState::kComplete);
  EXPECT_EQ(trials[0].exit_status, 3);
  EXPECT_EQ(trials[0].log_path, "x.log");
  EXPECT_EQ(std::get<double>(trials[0].config.at("lr")), 0.01);
  EXPECT_EQ(std::get<int64_t>(trials[0].config.at("width")), 32);
  EXPECT_EQ(std::get<std::string>(trials[0].config.at("opt")), "sgd");
  EXPECT_EQ(trials[0].results, (std::vector<std::pair<int64_t, double>>{{1, 0.5}, {2, 0.25}}));
  StudySpec other = spec;
  other.space = "lr=uniform(0, 1)\n";
  const std::string e = error_of([&] { open_storage(url)->open_study(other); });
  EXPECT_NE(e.find("exists with a different search space (stored: lr=loguniform(0.0001, 1);"
                   "width=choice(16, 32, 64); given: lr=uniform(0, 1)); its trials are kept"),
            std::string::npos)
      << e;
  EXPECT_EQ(open_storage(url)->load_trials().size(), 0u);  // no study opened: nothing loaded
  other = spec;
  other.mode = "max";
  EXPECT_NE(error_of([&] { open_storage(url)->open_study(other); }).find("--mode min"),
            std::string::npos);
  EXPECT_NE(error_of([] { open_storage("mysql://x/y"); }).find("unknown storage scheme 'mysql'"),
            std::string::npos);
  EXPECT_NE(error_of([] { open_storage("sqlite://x.db"); }).find("malformed storage URL"),
            std::string::npos);
  EXPECT_NE(error_of([] { open_storage("/nonexistent-dir/x/s.db"); }).find("cannot open SQLite"),
            std::string::npos);
  paratrain::testing::remove_tree(dir);
}

}  // namespace
}  // namespace tune
}  // namespace paratrain
