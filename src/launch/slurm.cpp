// Slurm's host lists and the variables srun and sbatch set (slurm.h). Written here because Slurm
// ships no library for it that a program outside Slurm may link (libslurm's hostlist functions
// are internal), and `scontrol show hostnames` needs a Slurm configuration on the node.

#include "paratrain/launch/slurm.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <string>

extern char** environ;

namespace paratrain {
namespace dist {
namespace {

// A host list larger than any cluster: a typo such as n[1-99999999] must not eat the memory.
constexpr size_t kMaxHosts = 1 << 20;

// One comma-separated item of a bracket group: "07" or "01-04", as (low, high, width).
struct Range {
  unsigned long low = 0;
  unsigned long high = 0;
  size_t width = 0;
};

Range parse_range(const std::string& list, const std::string& item) {
  const size_t dash = item.find('-');
  const std::string lo = item.substr(0, dash);
  const std::string hi = dash == std::string::npos ? lo : item.substr(dash + 1);
  auto digits = [](const std::string& s) {
    return !s.empty() && s.size() <= 9 && s.find_first_not_of("0123456789") == std::string::npos;
  };
  TORCH_CHECK(digits(lo) && digits(hi), "node list '", list, "': '[", item,
              "]' is not a range: write numbers such as [1-4,7]");
  Range r{std::stoul(lo), std::stoul(hi), lo.size()};
  TORCH_CHECK(r.low <= r.high, "node list '", list, "': the range '", item, "' runs backwards");
  return r;
}

// The names "<prefix><n>" for every prefix, then every n of the group's ranges in order (Slurm's
// order), zero-padded to each range's width.
std::vector<std::string> expand_group(const std::string& list,
                                      const std::vector<std::string>& prefixes,
                                      const std::string& group) {
  std::vector<Range> ranges;
  size_t count = 0;
  for (size_t start = 0;;) {
    const size_t comma = group.find(',', start);
    ranges.push_back(parse_range(list, group.substr(start, comma - start)));
    count += ranges.back().high - ranges.back().low + 1;
    TORCH_CHECK(count <= kMaxHosts && count * prefixes.size() <= kMaxHosts, "node list '", list,
                "' names more than ", kMaxHosts, " hosts");
    if (comma == std::string::npos) {
      break;
    }
    start = comma + 1;
  }
  std::vector<std::string> out;
  for (const auto& p : prefixes) {
    for (const Range& r : ranges) {
      for (unsigned long n = r.low; n <= r.high; ++n) {
        std::string number = std::to_string(n);
        if (number.size() < r.width) {
          number.insert(0, r.width - number.size(), '0');
        }
        out.push_back(p + number);
      }
    }
  }
  return out;
}

// One host expression, such as "gpu-a[01-04,07]" or "a[1-2]b[3-4]".
std::vector<std::string> expand_one(const std::string& list, const std::string& expr) {
  std::vector<std::string> names{""};
  bool grouped = false;
  size_t at = 0;
  while (at < expr.size()) {
    const size_t open = expr.find('[', at);
    const std::string text = expr.substr(at, open - at);
    if (open == std::string::npos) {
      // As scontrol: text may follow a bracket group only when another group follows it.
      TORCH_CHECK(!grouped || text.empty(), "node list '", list, "': '", expr,
                  "' has text after its last bracket group");
      for (auto& n : names) {
        n += text;
      }
      break;
    }
    const size_t close = expr.find(']', open);
    TORCH_CHECK(close != std::string::npos, "node list '", list, "': '", expr,
                "' opens a bracket it never closes");
    for (auto& n : names) {
      n += text;
    }
    names = expand_group(list, names, expr.substr(open + 1, close - open - 1));
    grouped = true;
    at = close + 1;
  }
  return names;
}

}  // namespace

std::vector<std::string> expand_hostlist(const std::string& list) {
  std::vector<std::string> hosts;
  std::string expr;
  int depth = 0;
  auto flush = [&] {
    if (!expr.empty()) {
      for (auto& h : expand_one(list, expr)) {
        hosts.push_back(std::move(h));
      }
      TORCH_CHECK(hosts.size() <= kMaxHosts, "node list '", list, "' names more than ", kMaxHosts,
                  " hosts");
    }
    expr.clear();
  };
  for (char c : list) {
    if (depth == 0 && (c == ',' || c == ' ' || c == '\t' || c == '\n')) {
      flush();
      continue;
    }
    if (c == '[' || c == ']') {
      depth += c == '[' ? 1 : -1;
      TORCH_CHECK(depth == 0 || depth == 1, "node list '", list, "' has ",
                  depth > 1 ? "a bracket inside a bracket" : "a ']' without its '['");
    }
    expr += c;
  }
  TORCH_CHECK(depth == 0, "node list '", list, "' opens a bracket it never closes");
  flush();
  TORCH_CHECK(!hosts.empty(), "node list '", list, "' names no host");
  return hosts;
}

namespace {

std::string value(const std::map<std::string, std::string>& env, const std::string& name) {
  const auto it = env.find(name);
  return it == env.end() ? "" : it->second;
}

int count_variable(const std::map<std::string, std::string>& env, const std::string& name) {
  const std::string v = value(env, name);
  TORCH_CHECK(!v.empty() && v.size() <= 6 && v.find_first_not_of("0123456789") == std::string::npos,
              name, "='", v, "' is not a number: this is not an allocation Slurm made");
  return std::stoi(v);
}

// Whether srun's step variables describe this job: they name nodes of its allocation (a batch
// script submitted from inside another job's step inherits that step's).
bool in_step(const std::map<std::string, std::string>& env) {
  const std::string step = value(env, "SLURM_STEP_NODELIST");
  if (step.empty()) {
    return false;
  }
  try {
    const std::vector<std::string> job = expand_hostlist(value(env, "SLURM_JOB_NODELIST"));
    for (const auto& host : expand_hostlist(step)) {
      if (std::find(job.begin(), job.end(), host) == job.end()) {
        return false;
      }
    }
  } catch (const c10::Error&) {
    // Without a readable job list, the step's is all there is (its errors are reported below).
  }
  return true;
}

}  // namespace

std::optional<SlurmPlacement> slurm_placement(const std::map<std::string, std::string>& env) {
  if (value(env, "SLURM_JOB_ID").empty()) {
    return std::nullopt;
  }
  SlurmPlacement p;
  p.job_id = value(env, "SLURM_JOB_ID");
  // Under srun, the step's nodes (all of the allocation's, or those -N, -w or --relative chose):
  // srun gives SLURM_NODEID and SLURM_NNODES relative to them.
  const bool step = in_step(env);
  const char* list_name = step ? "SLURM_STEP_NODELIST" : "SLURM_JOB_NODELIST";
  const std::string list = value(env, list_name);
  TORCH_CHECK(!list.empty(), "SLURM_JOB_ID is set (", p.job_id,
              ") but SLURM_JOB_NODELIST is not: run paratrain launch through srun or sbatch, or "
              "give --nnodes, --node-rank and --master-addr");
  try {
    p.hosts = expand_hostlist(list);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, list_name, ": ", e.what_without_backtrace(),
                "; give --nnodes, --node-rank and --master-addr instead");
  }
  const char* count_name = step && !value(env, "SLURM_STEP_NUM_NODES").empty()
                               ? "SLURM_STEP_NUM_NODES"
                           : !value(env, "SLURM_NNODES").empty() ? "SLURM_NNODES"
                                                                 : "SLURM_JOB_NUM_NODES";
  p.nnodes = value(env, count_name).empty() ? static_cast<int>(p.hosts.size())
                                            : count_variable(env, count_name);
  TORCH_CHECK(p.nnodes == static_cast<int>(p.hosts.size()), count_name, "=", p.nnodes, " but ",
              list_name, " '", list, "' names ", p.hosts.size(), " host",
              p.hosts.size() == 1 ? "" : "s", ": the allocation's variables disagree");
  // A batch script runs on the first node only: with several, the others would never come.
  TORCH_CHECK(step || p.nnodes == 1, "the Slurm allocation has ", p.nnodes,
              " nodes, but this is not an srun step: start one paratrain launch per node with "
              "srun --ntasks-per-node 1, or give --nnodes 1 to run on this node alone");
  p.node_rank = value(env, "SLURM_NODEID").empty() ? 0 : count_variable(env, "SLURM_NODEID");
  TORCH_CHECK(p.node_rank < p.nnodes, "SLURM_NODEID=", p.node_rank, " is beyond ", list_name, " '",
              list, "' (", p.nnodes, " host", p.nnodes == 1 ? "" : "s",
              "): start paratrain launch with srun inside the allocation");
  // srun's step: one launcher per node, or several would claim each node rank.
  if (!value(env, "SLURM_STEP_NUM_TASKS").empty() && !value(env, "SLURM_STEP_NUM_NODES").empty()) {
    const int tasks = count_variable(env, "SLURM_STEP_NUM_TASKS");
    const int nodes = count_variable(env, "SLURM_STEP_NUM_NODES");
    TORCH_CHECK(tasks <= nodes, "srun started ", tasks, " tasks on ", nodes, " node",
                nodes == 1 ? "" : "s",
                ": paratrain launch starts a node's workers itself; run one "
                "per node (srun --ntasks-per-node 1)");
  }
  p.master_addr = p.hosts.front();
  return p;
}

std::map<std::string, std::string> current_environment() {
  std::map<std::string, std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string kv = *e;
    const size_t eq = kv.find('=');
    if (eq != std::string::npos) {
      env.emplace(kv.substr(0, eq), kv.substr(eq + 1));
    }
  }
  return env;
}

}  // namespace dist
}  // namespace paratrain
