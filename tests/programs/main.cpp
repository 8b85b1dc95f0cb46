// The processes the multi-process tests start, as one program: it runs the worker that its name
// (argv[0]) names. The build links each worker's name to it (tests/CMakeLists.txt), so a test
// starts tests/ddp_worker as before. One program instead of nine because each libtorch program
// costs a compile of its own (about 25 CPU-seconds here, most of it loading the precompiled
// header and generating the same libtorch code again), twice per CI run.

#include "paratrain/util/allocator.h"

#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>

namespace paratrain_test_programs {
#define PARATRAIN_TEST_PROGRAM(name) \
  namespace name {                   \
  int run(int argc, char** argv);    \
  }
PARATRAIN_TEST_PROGRAM(collective_worker)
PARATRAIN_TEST_PROGRAM(ddp_worker)
PARATRAIN_TEST_PROGRAM(elastic_worker)
PARATRAIN_TEST_PROGRAM(fsdp_worker)
PARATRAIN_TEST_PROGRAM(join_worker)
PARATRAIN_TEST_PROGRAM(pipeline_worker)
PARATRAIN_TEST_PROGRAM(spawn_probe)
PARATRAIN_TEST_PROGRAM(store_probe)
PARATRAIN_TEST_PROGRAM(syncbn_worker)
PARATRAIN_TEST_PROGRAM(tp_worker)
PARATRAIN_TEST_PROGRAM(zero_worker)
#undef PARATRAIN_TEST_PROGRAM
}  // namespace paratrain_test_programs

int main(int argc, char** argv) {
  paratrain::cpu::keep_freed_memory();  // as paratrain and its examples do
  namespace p = paratrain_test_programs;
  struct Program {
    const char* name;
    int (*run)(int, char**);
  };
  static const Program programs[] = {{"collective_worker", p::collective_worker::run},
                                     {"ddp_worker", p::ddp_worker::run},
                                     {"elastic_worker", p::elastic_worker::run},
                                     {"fsdp_worker", p::fsdp_worker::run},
                                     {"join_worker", p::join_worker::run},
                                     {"pipeline_worker", p::pipeline_worker::run},
                                     {"spawn_probe", p::spawn_probe::run},
                                     {"store_probe", p::store_probe::run},
                                     {"syncbn_worker", p::syncbn_worker::run},
                                     {"tp_worker", p::tp_worker::run},
                                     {"zero_worker", p::zero_worker::run}};
  const char* slash = std::strrchr(argv[0], '/');
  std::string name = slash != nullptr ? slash + 1 : argv[0];
  // A worker that starts itself again through /proc/self/exe (paratrain::dist::spawn) comes back
  // as test_programs: the name it was started under rides along in the environment.
  const char* inherited = std::getenv("PARATRAIN_TEST_PROGRAM");
  if (name == "test_programs" && inherited != nullptr) {
    name = inherited;
  }
  for (const Program& program : programs) {
    if (name == program.name) {
      ::setenv("PARATRAIN_TEST_PROGRAM", program.name, 1);
      return program.run(argc, argv);
    }
  }
  std::cerr << "test_programs: started as '" << name
            << "', which names no test program: run it through one of its links (ddp_worker, "
               "collective_worker, ...)"
            << std::endl;
  return 2;
}
