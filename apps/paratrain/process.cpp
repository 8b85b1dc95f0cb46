// What every command shares about its process, the `launch` that runs without libtorch
// included: how its errors end it, and the program's own path.

#include "args.h"
#include "commands.h"

#include <c10/util/Exception.h>

#include <unistd.h>

#include <climits>
#include <iostream>

namespace paratrain {
namespace cli {

namespace {
std::string& self_path_override() {
  static std::string path;
  return path;
}
}  // namespace

std::string self_path() {
  if (!self_path_override().empty()) {
    return self_path_override();
  }
  char exe[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  return n > 0 ? std::string(exe, static_cast<size_t>(n)) : "paratrain";
}

std::string beside_self(const std::string& relative) {
  const std::string self = self_path();
  return self.substr(0, self.rfind('/') + 1) + relative;
}

void set_self_path(const std::string& path) {
  self_path_override() = path;
}

int run_guarded(const std::string& command, const std::function<int()>& run) {
  try {
    return run();
  } catch (const UsageError& e) {
    std::cerr << "paratrain " << command << ": " << e.what() << " (see `paratrain " << command
              << " --help`)" << std::endl;
    return 2;
  } catch (const c10::Error& e) {
    std::cerr << "paratrain " << command << ": error: " << e.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "paratrain " << command << ": error: " << e.what() << std::endl;
    return 1;
  }
}

}  // namespace cli
}  // namespace paratrain
