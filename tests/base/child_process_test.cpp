// ChildProcess: the one fork/exec of the launcher, the tuner, the benchmarks and the tests.

#include "test_util.h"

#include "paratrain/base/child_process.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>

namespace paratrain {
namespace testing {
namespace {

TEST(ChildProcess, CapturesOutputAndExitCode) {
  ChildProcess child(ChildOptions({"/bin/sh", "-c", "echo out; echo err >&2; exit 3"})
                         .die_with_parent(false)
                         .capture_output(true));
  const std::string text = child.read_all();
  EXPECT_EQ(exit_code(child.wait()), 3);
  EXPECT_EQ(exit_code(child.wait()), 3) << "a second wait returns the same status";
  EXPECT_NE(text.find("out\n"), std::string::npos) << text;
  EXPECT_NE(text.find("err\n"), std::string::npos) << text;
}

TEST(ChildProcess, SeparateStreamsEnvironmentAndProgramPath) {
  // argv[0] is what the program sees; `program` is the file run.
  ::setenv("PARATRAIN_CHILD_KEPT", "kept", 1);
  ::setenv("PARATRAIN_CHILD_GONE", "gone", 1);
  ChildProcess child(
      ChildOptions(
          {"shown-name", "-c", "echo \"$0 $PARATRAIN_CHILD_KEPT $PARATRAIN_CHILD_GONE $SET\" >&2"})
          .program("/bin/sh")
          .environment(environment_with({{"SET", "yes"}}, {"PARATRAIN_CHILD_GONE"}))
          .inherit_environment(false)
          .die_with_parent(false)
          .capture_stdout(true)
          .capture_stderr(true));
  std::string err;
  char buf[256];
  for (;;) {
    const ssize_t n = ::read(child.stderr_fd(), buf, sizeof(buf));
    if (n > 0) {
      err.append(buf, static_cast<size_t>(n));
    } else if (n == 0 || errno != EAGAIN) {
      break;
    } else {
      ::usleep(1000);
    }
  }
  EXPECT_EQ(child.read_all(), "");
  EXPECT_EQ(exit_code(child.wait()), 0);
  ::unsetenv("PARATRAIN_CHILD_KEPT");
  ::unsetenv("PARATRAIN_CHILD_GONE");
  EXPECT_EQ(err, "shown-name kept  yes\n");
}

TEST(ChildProcess, SignalReachesTheGroupAndExecFailureIs127) {
  // The shell's own child (sleep) is in the group too: killing the group ends both, so the
  // pipe, which sleep holds open, reaches end of file.
  ChildProcess child(
      ChildOptions({"/bin/sh", "-c", "sleep 30 & echo started; wait"}).capture_output(true));
  char c;
  for (ssize_t n; (n = ::read(child.stdout_fd(), &c, 1)) != 1;) {
    ASSERT_TRUE(n < 0 && errno == EAGAIN) << "the shell ended before it printed 'started'";
    ::usleep(1000);
  }
  child.signal(SIGTERM);
  const int status = child.wait();
  EXPECT_TRUE(WIFSIGNALED(status)) << status;
  EXPECT_EQ(exit_code(status), 128 + SIGTERM);
  child.read_all();       // returns: nothing in the group holds the pipe any more
  child.signal(SIGKILL);  // reaped: a no-op, not a signal to a recycled pid

  ChildProcess missing(
      ChildOptions({"/nonexistent/program"}).die_with_parent(false).capture_output(true));
  const std::string text = missing.read_all();
  EXPECT_EQ(exit_code(missing.wait()), 127);
  EXPECT_NE(text.find("paratrain: cannot execute /nonexistent/program (errno 2)"),
            std::string::npos)
      << text;
  EXPECT_THROW(ChildProcess(ChildOptions(std::vector<std::string>{})), c10::Error);
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
