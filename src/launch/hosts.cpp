// The launcher's host-side helpers: GPU lists (--devices), Open MPI host files (--hostfile),
// finding a program as execvp would, and picking a free TCP port.

#include "paratrain/launch/launch.h"

#include "launch_internal.h"

#include <c10/util/Exception.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

namespace paratrain {
namespace dist {

std::vector<int> parse_device_list(const std::string& text) {
  TORCH_CHECK(!text.empty(), "--devices is empty: give GPUs such as 0,1,3 or cuda:0,cuda:1");
  std::vector<int> devices;
  std::set<int> seen;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    // "cuda:1", spelled as train's --devices spells a device, is physical GPU 1 here too.
    const std::string index = item.rfind("cuda:", 0) == 0 ? item.substr(5) : item;
    TORCH_CHECK(!index.empty() && index.find_first_not_of("0123456789") == std::string::npos &&
                    index.size() < 6,
                "--devices '", text, "': '", item,
                "' is not a GPU index; give non-negative integers such as 0,1,3, or "
                "cuda:0,cuda:1");
    int d = std::stoi(index);
    TORCH_CHECK(seen.insert(d).second, "--devices '", text, "' lists GPU ", d,
                " twice; each device can serve one worker");
    devices.push_back(d);
  }
  TORCH_CHECK(text.back() != ',', "--devices '", text, "' ends with a comma");
  return devices;
}

std::vector<HostfileEntry> read_hostfile(const std::string& path) {
  std::ifstream in(path);
  TORCH_CHECK(in.good(), "cannot read --hostfile ", path, ": ", strerror(errno));
  std::vector<HostfileEntry> out;
  std::set<std::string> seen;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    line = line.substr(0, line.find('#'));
    std::istringstream words(line);
    HostfileEntry e;
    e.line = number;
    if (!(words >> e.host)) {
      continue;
    }
    std::string word;
    while (words >> word) {
      if (word.rfind("slots=", 0) == 0) {
        const std::string n = word.substr(6);
        TORCH_CHECK(!n.empty() && n.size() < 6 &&
                        n.find_first_not_of("0123456789") == std::string::npos && std::stoi(n) > 0,
                    "--hostfile ", path, " line ", number, ": '", word,
                    "' is not a slot count; write slots=N with N >= 1");
        e.slots = std::stoi(n);
      }
    }
    TORCH_CHECK(seen.insert(e.host).second, "--hostfile ", path, " line ", number, ": host '",
                e.host, "' is listed twice; give it one line with its slots");
    out.push_back(e);
  }
  TORCH_CHECK(!out.empty(), "--hostfile ", path, " lists no host");
  return out;
}

std::string format_device_list(const std::vector<int>& devices) {
  std::string list;
  for (int d : devices) {
    list += (list.empty() ? "" : ",") + std::to_string(d);
  }
  return list;
}

namespace launch_internal {

// An executable regular file (access(X_OK) alone also accepts directories).
bool runnable(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

}  // namespace launch_internal

std::string find_program(const std::string& name) {
  if (name.empty()) {
    return "";
  }
  if (name.find('/') != std::string::npos) {
    return launch_internal::runnable(name) ? name : "";
  }
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/local/bin:/usr/bin:/bin");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    if (launch_internal::runnable(candidate)) {
      return candidate;
    }
  }
  return "";
}

int pick_free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  TORCH_CHECK(fd >= 0, "cannot open a socket to find a free port: ", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
            ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  ::close(fd);
  TORCH_CHECK(ok, "cannot find a free port on 127.0.0.1: ", std::strerror(errno));
  return ntohs(addr.sin_port);
}

}  // namespace dist
}  // namespace paratrain
