// paratrain: the command-line front end. Subcommands live one per file; commands.cpp dispatches
// (run_command_line) and process.cpp decides how a command's errors end the process, so that
// tests can run command lines in-process.
//
// This program itself links only the launcher library, which needs no libtorch: `paratrain
// launch` runs here and starts in a few milliseconds, where loading libtorch costs about a
// CPU-second per process. `paratrain bench` runs the paratrain-bench program. Every other command
// lives in libparatrain_commands, loaded here on first use (commands_main.cpp).

#include "commands.h"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <iostream>
#include <string>
#include <vector>

namespace {

// libparatrain_commands of this paratrain, by path from the program's own file: ../LIBDIR once
// installed (bin/ and lib/), and .. in the build tree (bin/ inside it). Never a search of the
// library path, which might find another version's. "" when neither exists.
std::string commands_library() {
  for (const char* relative : {"../" PARATRAIN_INSTALL_LIBDIR "/", "../"}) {
    const std::string candidate =
        paratrain::cli::beside_self(std::string(relative) + "libparatrain_commands.so");
    if (::access(candidate.c_str(), R_OK) == 0) {
      return candidate;
    }
  }
  return "";
}

int run_commands_library(int argc, char** argv) {
  const std::string path = commands_library();
  if (path.empty()) {
    std::cerr << "paratrain: libparatrain_commands.so is not beside this program (in ../"
              << PARATRAIN_INSTALL_LIBDIR << " or ..); reinstall paratrain" << std::endl;
    return 1;
  }
  void* library = ::dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (library == nullptr) {
    std::cerr << "paratrain: cannot load its commands: " << ::dlerror() << std::endl;
    return 1;
  }
  using Main = int (*)(int, char**);
  auto main = reinterpret_cast<Main>(::dlsym(library, "paratrain_commands_main"));
  if (main == nullptr) {
    std::cerr << "paratrain: " << ::dlerror() << "; reinstall paratrain" << std::endl;
    return 1;
  }
  return main(argc, argv);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string command = argc > 1 ? argv[1] : "";
  const std::vector<std::string> args(argv + std::min(argc, 2), argv + argc);
  if (command == "launch") {
    return paratrain::cli::run_guarded("launch", [&] { return paratrain::cli::run_launch(args); });
  }
  if (command == "bench") {  // the paratrain-bench program, in this one's place
    return paratrain::cli::run_guarded("bench", [&] { return paratrain::cli::run_bench(args); });
  }
  return run_commands_library(argc, argv);
}
