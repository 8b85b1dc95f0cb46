// paratrain bench: the benchmarks are a program of their own, paratrain-bench (bench/main.cpp),
// so the CLI neither carries nor depends on them; this command runs it in the CLI's place.

#include "commands.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iostream>
#include <stdexcept>

namespace paratrain {
namespace cli {

int run_bench(const std::vector<std::string>& args) {
  const std::string program = beside_self("paratrain-bench");
  std::vector<std::string> words{program};
  words.insert(words.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& w : words) {
    argv.push_back(&w[0]);
  }
  argv.push_back(nullptr);
  std::cout.flush();
  std::cerr.flush();
  ::execv(program.c_str(), argv.data());
  // Not TORCH_CHECK: its message would carry this file's path into the installed program.
  throw std::runtime_error("cannot run " + program + ": " + std::strerror(errno) +
                           "; the benchmarks are a program of their own, built and installed "
                           "beside paratrain (CMake target paratrain_bench)");
}

}  // namespace cli
}  // namespace paratrain
