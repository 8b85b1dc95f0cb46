// A test worker for the launcher, without libtorch so it starts fast. The last argument is a
// token that marks every process of one test (the tests look for it in /proc afterwards).
//
//   launch_probe env TOKEN                  print the environment contract and exit 0
//   launch_probe exit RANK CODE TOKEN       RANK exits with CODE; the others wait (with a child)
//   launch_probe signal RANK SIG TOKEN      RANK kills itself with SIG; the others wait
//   launch_probe wait TOKEN                 print "ready", start a child, wait to be stopped
//   launch_probe spam LINES TOKEN           print LINES long lines as fast as possible
//   launch_probe child TOKEN                (internal) the child the others start

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "<unset>";
}

void start_child(const char* self, const std::string& token) {
  if (::fork() == 0) {
    ::execl(self, self, "child", token.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
}

[[noreturn]] void wait_forever() {
  for (int i = 0; i < 600; ++i) {
    ::sleep(1);
  }
  std::_Exit(99);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: launch_probe MODE ... TOKEN" << std::endl;
    return 2;
  }
  const std::string mode = argv[1];
  const std::string token = argv[argc - 1];
  const int rank = std::atoi(env("RANK").c_str());
  if (mode == "env") {
    std::cout << "ENV";
    for (const char* name :
         {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
          "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "PARATRAIN_BACKEND",
          "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
          "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
          "TORCHELASTIC_USE_AGENT_STORE"}) {
      std::cout << " " << name << "=" << env(name);
    }
    std::cout << std::endl;
    return 0;
  }
  if (mode == "exit" || mode == "signal" || mode == "exit-stubborn") {
    const int who = std::atoi(argv[2]);
    const int what = std::atoi(argv[3]);
    if (mode == "exit-stubborn" && rank != who) {
      ::signal(SIGTERM, SIG_IGN);  // the launcher's stop takes its kill_grace (3 s)
    }
    start_child(argv[0], token);
    std::cout << "ready" << std::endl;
    if (rank == who) {
      ::usleep(300 * 1000);
      if (mode != "signal") {
        std::cout << "rank " << rank << " exiting with " << what << std::endl;
        return what;
      }
      // The default action even under a sanitizer (ASan's SEGV handler would exit 1 instead):
      // what is tested is the launcher's report of a death by signal.
      ::signal(what, SIG_DFL);
      ::raise(what);
    }
    wait_forever();
  }
  if (mode == "wait") {
    start_child(argv[0], token);
    std::cout << "ready" << std::endl;
    wait_forever();
  }
  if (mode == "spam") {
    const int lines = std::atoi(argv[2]);
    std::string body(300, static_cast<char>('a' + rank % 26));
    for (int i = 0; i < lines; ++i) {
      // Unbuffered writes in pieces: a line reaches the launcher in several reads.
      std::string line = "line " + std::to_string(i) + " " + body + " end\n";
      for (size_t off = 0; off < line.size(); off += 100) {
        std::fwrite(line.data() + off, 1, std::min<size_t>(100, line.size() - off), stdout);
        std::fflush(stdout);
      }
    }
    return 0;
  }
  if (mode == "child") {
    wait_forever();
  }
  std::cerr << "unknown mode " << mode << std::endl;
  return 2;
}
