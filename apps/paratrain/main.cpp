// paratrain: the command-line front end. Subcommands live one per file; this file only dispatches
// and turns exceptions into one line on stderr and an exit code (2 for a bad command line, 1 for
// everything else), the one place that decides how the process ends.

#include "args.h"
#include "commands.h"

#include <c10/util/Exception.h>

#include <unistd.h>

#include <climits>
#include <iostream>

namespace paratrain {
namespace cli {

std::string self_path() {
  char exe[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  return n > 0 ? std::string(exe, static_cast<size_t>(n)) : "paratrain";
}

}  // namespace cli
}  // namespace paratrain

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  namespace cli = paratrain::cli;
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    std::cout << cli::help_text("paratrain <command> [options]", "commands", cli::commands(), true);
    return args.empty() ? 2 : 0;
  }
  const std::string command = args[0];
  args.erase(args.begin());
  const cli::Command* known = cli::find_command(cli::commands(), command);
  if (known == nullptr) {
    std::cerr << "paratrain: unknown command '" << command
              << "'; run `paratrain --help` for the list" << std::endl;
    return 2;
  }
  try {
    return known->run(args);
  } catch (const paratrain::cli::UsageError& e) {
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
