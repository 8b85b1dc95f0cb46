// paratrain: the command-line front end. Subcommands live one per file; commands.cpp dispatches
// and decides how the process ends (run_command_line), so that tests can run command lines
// in-process.

#include "commands.h"

#include "paratrain/util/allocator.h"

#include <string>
#include <vector>

int main(int argc, char** argv) {
  paratrain::cpu::keep_freed_memory();  // Note [Freed memory on the CPU]
  return paratrain::cli::run_command_line(std::vector<std::string>(argv + 1, argv + argc));
}
