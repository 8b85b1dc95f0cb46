// Which addresses a job's store and rendezvous serve on, seen from inside the job.
//   store_probe ADDR[:PORT]...
// Every rank joins the job (env://); once all have joined, each tries a TCP connection to each
// ADDR at PORT (MASTER_PORT when none is given) from its own host, and prints
// "rank R: ADDR:PORT accepts" or "... refuses"; then "rank R: ok".

#include <paratrain/paratrain.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <string>

// In the test programs' one binary (main.cpp): run() is this program's main.
namespace paratrain_test_programs {
namespace store_probe {

namespace {

bool accepts(const std::string& host, int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    std::cerr << "store_probe: '" << host << "' is not an IPv4 address" << std::endl;
    std::exit(2);
  }
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return ok;
}

}  // namespace

int run(int argc, char** argv) {
  auto pg = paratrain::dist::init_process_group();
  pg->barrier()->wait();
  {
    const char* master_port = std::getenv("MASTER_PORT");
    for (int i = 1; i < argc; ++i) {
      std::string host = argv[i];
      int port = master_port ? std::atoi(master_port) : 0;
      const auto colon = host.find(':');
      if (colon != std::string::npos) {
        port = std::atoi(host.c_str() + colon + 1);
        host.resize(colon);
      }
      std::cout << "rank " << pg->rank() << ": " << host << ":" << port
                << (accepts(host, port) ? " accepts" : " refuses") << std::endl;
    }
  }
  pg->barrier()->wait();
  std::cout << "rank " << pg->rank() << ": ok" << std::endl;
  return 0;
}

}  // namespace store_probe
}  // namespace paratrain_test_programs
