#include "paratrain/launch/env.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <climits>
#include <cstdlib>

namespace paratrain {
namespace dist {

int parse_int(const std::string& text, const std::string& what) {
  const char* begin = text.c_str();
  char* end = nullptr;
  errno = 0;
  long value = std::strtol(begin, &end, 10);
  TORCH_CHECK(!text.empty() && end != begin && *end == '\0' && errno == 0 && value >= INT_MIN &&
                  value <= INT_MAX,
              what, "='", text, "' is not an integer");
  return static_cast<int>(value);
}

namespace {

struct Dialect {
  const char* name;
  const char* rank;
  const char* world_size;
  const char* local_rank;
  const char* local_world_size;
  const char* group_rank;
};

// Order matters: the first dialect whose rank and world size are both set wins. torchrun comes
// first so that `paratrain launch` inside a Slurm allocation still means what it says.
constexpr Dialect kDialects[] = {
    {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"},
    {"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_NODE_RANK"},
    {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE",
     "SLURM_NODEID"},
};

}  // namespace

RankInfo discover_rank_info(const std::function<const char*(const char*)>& getenv) {
  auto get = [&](const char* name) -> const char* {
    const char* v = getenv(name);
    return (v != nullptr && v[0] != '\0') ? v : nullptr;
  };
  RankInfo info;
  for (const Dialect& d : kDialects) {
    if (get(d.rank) == nullptr || get(d.world_size) == nullptr) {
      continue;
    }
    info.source = d.name;
    info.rank = parse_int(get(d.rank), d.rank);
    info.world_size = parse_int(get(d.world_size), d.world_size);
    TORCH_CHECK(info.world_size >= 1, d.world_size, "=", info.world_size,
                " is not a valid world size: it must be at least 1");
    TORCH_CHECK(info.rank >= 0 && info.rank < info.world_size, d.rank, "=", info.rank,
                " is out of range for ", d.world_size, "=", info.world_size, ": it must be in [0, ",
                info.world_size - 1, "]");
    info.local_rank = get(d.local_rank) ? parse_int(get(d.local_rank), d.local_rank) : info.rank;
    // SLURM_NTASKS_PER_NODE may read "2(x3)" on heterogeneous allocations; only a plain number is
    // taken as the local world size, otherwise assume one node.
    const char* lws = get(d.local_world_size);
    if (lws != nullptr && std::string(d.name) == "slurm" &&
        std::string(lws).find_first_not_of("0123456789") != std::string::npos) {
      lws = nullptr;
    }
    info.local_world_size = lws ? parse_int(lws, d.local_world_size) : info.world_size;
    TORCH_CHECK(info.local_world_size >= 1 && info.local_world_size <= info.world_size,
                d.local_world_size, "=", info.local_world_size, " is out of range for ",
                d.world_size, "=", info.world_size);
    TORCH_CHECK(info.local_rank >= 0 && info.local_rank < info.local_world_size, d.local_rank, "=",
                info.local_rank, " is out of range: it must be in [0, ", info.local_world_size - 1,
                "]");
    info.group_rank = get(d.group_rank) ? parse_int(get(d.group_rank), d.group_rank)
                                        : info.rank / info.local_world_size;
    break;
  }
  if (get("MASTER_ADDR")) {
    info.master_addr = get("MASTER_ADDR");
  }
  if (get("MASTER_PORT")) {
    info.master_port = parse_int(get("MASTER_PORT"), "MASTER_PORT");
    TORCH_CHECK(info.master_port > 0 && info.master_port < 65536, "MASTER_PORT=", info.master_port,
                " is not a TCP port: it must be in [1, 65535]");
  }
  return info;
}

RankInfo discover_rank_info() {
  return discover_rank_info([](const char* name) { return std::getenv(name); });
}

}  // namespace dist
}  // namespace paratrain
