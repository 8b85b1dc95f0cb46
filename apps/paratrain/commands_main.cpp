// The entry point of libparatrain_commands, which the paratrain program loads for every command
// but `launch` (main.cpp).

#include "commands.h"

#include "paratrain/util/allocator.h"

#include <string>
#include <vector>

extern "C" __attribute__((visibility("default"))) int paratrain_commands_main(int argc,
                                                                              char** argv) {
  paratrain::cpu::keep_freed_memory();  // Note [Freed memory on the CPU]
  return paratrain::cli::run_command_line(std::vector<std::string>(argv + 1, argv + argc));
}
