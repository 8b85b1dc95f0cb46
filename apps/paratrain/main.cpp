// paratrain: the command-line front end. Subcommands live one per file; commands.cpp dispatches
// and decides how the process ends (run_command_line), so that tests can run command lines
// in-process.
//
// This program itself links only the launcher library, which needs no libtorch: `paratrain
// launch` runs here and starts in a few milliseconds, where loading libtorch costs about a
// CPU-second per process. Every other command lives in libparatrain_commands, loaded here on
// first use (commands_main.cpp).

#include "commands.h"

#include <dlfcn.h>

#include <iostream>
#include <string>
#include <vector>

namespace {

// The other commands: found through this program's run path ($ORIGIN/../lib once installed).
int run_commands_library(int argc, char** argv) {
  void* library = ::dlopen("libparatrain_commands.so", RTLD_NOW | RTLD_GLOBAL);
  if (library == nullptr) {
    std::cerr << "paratrain: cannot load its commands: " << ::dlerror()
              << "; reinstall paratrain (libparatrain_commands.so belongs in the lib/ directory "
                 "beside its bin/)"
              << std::endl;
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
  if (argc > 1 && std::string(argv[1]) == "launch") {
    const std::vector<std::string> args(argv + 2, argv + argc);
    return paratrain::cli::run_guarded("launch", [&] { return paratrain::cli::run_launch(args); });
  }
  return run_commands_library(argc, argv);
}
