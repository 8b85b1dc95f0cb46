// The command-line table (apps/paratrain/args.h): every option has a help text or is internal, and
// the help as Markdown, from which docs/reference.md is generated.

#include "args.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace paratrain {
namespace cli {
namespace {

CommandSpec spec_with(const OptionSpec& option) {
  return CommandSpec{"paratrain example", "Does <things>.", {option}, "an example:\n  run it\n"};
}

TEST(Args, RefusesAnOptionWithoutHelp) {
  try {
    Args args({}, spec_with({"silent", "", ""}));
    FAIL() << "an option without help text was taken";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("--silent has no help text"), std::string::npos)
        << e.what();
  }
}

TEST(Args, InternalOptionsWorkButAreHidden) {
  const CommandSpec spec = spec_with({"worker", "", kInternalOption});
  Args args({"--worker"}, spec);
  EXPECT_TRUE(args.has("worker"));
  EXPECT_EQ(args.help().find("--worker"), std::string::npos) << args.help();
}

// Sets an environment variable for its lifetime, then puts back what was there.
struct ScopedEnv {
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    old_ = had_ ? old : "";
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_) {
      ::setenv(name_, old_.c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  const char* name_;
  bool had_;
  std::string old_;
};

TEST(Args, MarkdownHelpEscapesWhatMarkdownWouldRead) {
  std::string md;
  {
    ScopedEnv markdown("PARATRAIN_HELP_FORMAT", "markdown");
    md = Args({}, spec_with({"mode,m", "a|b", "a or b; <rank> is kept, `x<y` too"})).help();
  }
  EXPECT_NE(md.find("### `paratrain example`\n\nDoes &lt;things>."), std::string::npos) << md;
  EXPECT_NE(md.find("| `--mode a\\|b`, `-m a\\|b` | a or b; &lt;rank> is kept, `x<y` too |"),
            std::string::npos)
      << md;
  EXPECT_NE(md.find("```text\nan example:\n  run it\n```"), std::string::npos) << md;
}

}  // namespace
}  // namespace cli
}  // namespace paratrain
