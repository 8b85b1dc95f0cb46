// Command tables, shared by the paratrain CLI and the paratrain-bench program: the help and the
// dispatch made from them, so a new command is listed once.

#include "commands.h"

#include "args.h"

#include <algorithm>
#include <sstream>

namespace paratrain {
namespace cli {

const Command* find_command(const std::vector<Command>& table, const std::string& name) {
  for (const auto& c : table) {
    if (name == c.name) {
      return &c;
    }
  }
  return nullptr;
}

int dispatch(const std::vector<Command>& table,
             const std::string& name,
             const std::vector<std::string>& args,
             const char* what) {
  if (const Command* c = find_command(table, name)) {
    return c->run(args);
  }
  std::string names;
  for (const auto& c : table) {
    names += (names.empty() ? "" : ", ") + std::string(c.name);
  }
  throw UsageError("unknown " + std::string(what) + " '" + name + "'; available: " + names);
}

namespace {

// "  NAME SYNOPSIS   summary" with the summaries aligned at `column`.
void add_rows(std::ostringstream& out, const std::vector<Command>& table, size_t column) {
  for (const auto& c : table) {
    std::string head = "  " + std::string(c.name);
    if (c.synopsis[0] != '\0') {
      head += std::string(" ") + c.synopsis;
    }
    out << head << std::string(column > head.size() ? column - head.size() : 1, ' ') << c.summary
        << '\n';
  }
}

size_t widest(const std::vector<Command>& table) {
  size_t w = 0;
  for (const auto& c : table) {
    w = std::max(
        w, std::char_traits<char>::length(c.name) + std::char_traits<char>::length(c.synopsis) + 1);
  }
  return w;
}

}  // namespace

std::string help_text(const std::string& usage,
                      const std::string& heading,
                      const std::vector<Command>& table) {
  const size_t column = 2 + widest(table) + 2;
  std::ostringstream out;
  out << "usage: " << usage << "\n\n" << heading << ":\n";
  add_rows(out, table, column);
  // "paratrain <command> [options]" -> "run `paratrain <command> --help` for its options"
  out << "\nrun `" << usage.substr(0, usage.find(" [")) << " --help` for its options\n";
  return out.str();
}

}  // namespace cli
}  // namespace paratrain
