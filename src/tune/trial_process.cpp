#include "trial_process.h"

#include "paratrain/base/child_process.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace paratrain {
namespace tune {
namespace detail {

Process start_process(const ProcessSpec& spec) {
  Process p;
  p.log_fd = ::open(spec.log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  TORCH_CHECK(p.log_fd >= 0, "tune: cannot open trial log ", spec.log_path, ": ",
              std::strerror(errno));
  // In its own process group, a trial that read the terminal would stop for good (SIGTTIN): it
  // reads /dev/null, as the launcher's workers do.
  const int dev_null = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  try {
    ChildProcess child(ChildOptions(spec.argv)
                           .program(spec.program)
                           .environment(environment_with(spec.env))
                           .inherit_environment(false)
                           .stdin_fd(dev_null)
                           .stderr_fd(p.log_fd)
                           .capture_stdout(true)
                           .cores(spec.cores));
    p.pid = child.pid();
    p.out_fd = child.release_stdout();
  } catch (...) {
    ::close(p.log_fd);
    if (dev_null >= 0) {
      ::close(dev_null);
    }
    throw;
  }
  if (dev_null >= 0) {
    ::close(dev_null);
  }
  return p;
}

}  // namespace detail
}  // namespace tune
}  // namespace paratrain
