// The command table of the paratrain CLI, and the command line's dispatch through it.

#include "commands.h"

#include "args.h"

#include <iostream>

namespace paratrain {
namespace cli {

const std::vector<Command>& commands() {
  static const std::vector<Command> table{
      {"info", "", "libtorch version, backends in this build, CPU threads, CUDA devices", run_info},
      {"launch", "[opts] -- PROG", "start PROG once per rank with torchrun's environment",
       run_launch},
      {"train", "[opts]",
       "train a zoo model on Fashion-MNIST or an ImageFolder, or a GPT on token files: alone, "
       "DDP, DataParallel or a pipeline",
       run_train},
      {"data", "<command> [opts]",
       "dataset tools: make-imagefolder (Fashion-MNIST as JPEG/PNG/WebP files), tokenize (a "
       "file's bytes as GPT token files)",
       run_data},
      {"tune", "[opts] [-- COMMAND] | report [opts] | serve [opts]",
       "hyperparameter search (grid, random, TPE, BOHB; ASHA, Hyperband, median) over train "
       "jobs or any command",
       run_tune},
      {"checkpoint", "<command> [opts]",
       "checkpoint tools: consolidate (a sharded FSDP checkpoint as one safetensors file, or as "
       "a Hugging Face model directory)",
       run_checkpoint},
      {"generate", "[opts]",
       "continue token ids with a GPT (greedy or sampled), as transformers' generate()",
       run_generate},
      {"bench", "<name> [opts]",
       "run a benchmark (the paratrain-bench program); `paratrain bench --help` lists them",
       run_bench},
  };
  return table;
}

int run_command_line(std::vector<std::string> args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    std::cout << help_text("paratrain <command> [options]", "commands", commands());
    return args.empty() ? 2 : 0;
  }
  const std::string command = args[0];
  args.erase(args.begin());
  const Command* known = find_command(commands(), command);
  if (known == nullptr) {
    std::cerr << "paratrain: unknown command '" << command
              << "'; run `paratrain --help` for the list" << std::endl;
    return 2;
  }
  return run_guarded(command, [&] { return known->run(args); });
}

}  // namespace cli
}  // namespace paratrain
