#pragma once

// The subcommands of the paratrain CLI, one file each. Each takes the words after its name and
// returns the process exit code; errors are thrown (c10::Error, cli::UsageError) and reported by
// run_guarded() as one line.

#include <functional>
#include <string>
#include <vector>

namespace paratrain {
namespace cli {

int run_info(const std::vector<std::string>& args);
int run_launch(const std::vector<std::string>& args);
int run_train(const std::vector<std::string>& args);
int run_data(const std::vector<std::string>& args);
int run_tune(const std::vector<std::string>& args);
int run_checkpoint(const std::vector<std::string>& args);
int run_generate(const std::vector<std::string>& args);
/// Runs the paratrain-bench program beside this one (bench/main.cpp) in this process's place.
int run_bench(const std::vector<std::string>& args);

/// One subcommand: how it is called, what it does (one line), and its entry point. The help
/// texts and the dispatch are generated from tables of these (command_table.cpp), so a new
/// command is listed once.
struct Command {
  const char* name;
  const char* synopsis;  // what follows the name in the help ("[opts] -- PROG"), may be ""
  const char* summary;
  int (*run)(const std::vector<std::string>& args);
};

/// `paratrain <command>`.
const std::vector<Command>& commands();

/// The entry of `table` called `name`; null when there is none.
const Command* find_command(const std::vector<Command>& table, const std::string& name);

/// Runs the command called `name` in `table` with `args`; throws UsageError naming the choices
/// when there is none (`what` names the kind: "command", "benchmark").
int dispatch(const std::vector<Command>& table,
             const std::string& name,
             const std::vector<std::string>& args,
             const char* what);

/// The help of `table` under `usage`: one aligned row per entry under `heading` (plural, e.g.
/// "commands").
std::string help_text(const std::string& usage,
                      const std::string& heading,
                      const std::vector<Command>& table);

/// The whole command line after the program's name (`train --epochs 2`): dispatches to the
/// command and turns its exceptions into one line on stderr and the exit code (run_guarded).
int run_command_line(std::vector<std::string> args);

/// Runs `run`, the body of `paratrain <command>`, and turns its exceptions into one line on
/// stderr and the exit code: 2 for a bad command line (UsageError), 1 for everything else.
int run_guarded(const std::string& command, const std::function<int()>& run);

/// Absolute path of this program (paratrain, or paratrain-bench), which commands run again as
/// workers or mpirun shims: by default this process's own file.
std::string self_path();
/// `relative` (a file name, or a path like "../share/paratrain/x.py") taken from the directory of
/// self_path(): the programs, libraries and scripts installed with this one, found from its own
/// file rather than from PATH or the library path, which might find another version's.
std::string beside_self(const std::string& relative);
/// Makes self_path() return `path`: for a program that runs command lines in-process (the tests)
/// and is not itself the paratrain executable.
void set_self_path(const std::string& path);

}  // namespace cli
}  // namespace paratrain
