// paratrain checkpoint: tools for checkpoints. consolidate writes the whole model of a sharded
// FSDP checkpoint (save_sharded_checkpoint, include/paratrain/parallel/fsdp_checkpoint.h) as one
// safetensors file, without ranks or a model: for evaluation, export, or Hugging Face.

#include "args.h"
#include "commands.h"

#include "paratrain/models/gpt.h"
#include "paratrain/parallel/fsdp_checkpoint.h"

#include <iostream>
#include <set>
#include <sstream>
#include <utility>

namespace paratrain {
namespace cli {

namespace {

const CommandSpec& consolidate_spec() {
  static const CommandSpec spec{
      "paratrain checkpoint consolidate",
      "paratrain checkpoint consolidate DIR --out FILE [--names hf]: writes every parameter of\n"
      "the sharded FSDP checkpoint in the directory DIR (its fsdp.json and one\n"
      "rank-R-of-W.safetensors per rank, or the newest of `paratrain train --strategy fsdp\n"
      "--checkpoint-dir DIR`) to one safetensors file, by the model's names, in the dtype they\n"
      "were saved in, with the checkpoint's metadata. It needs no ranks, and holds one copy of\n"
      "the weights in memory (not the optimizer's state).",
      {
          {"out", "FILE",
           "the safetensors file to write (required; outside DIR, and not named as a "
           "checkpoint's file; an existing one is replaced atomically)"},
          {"names", "module|hf",
           "the tensors' names: module (the model's own, the default) or hf (those of Hugging "
           "Face's GPT2LMHeadModel, transformer.h.0.attn.c_attn.weight)"},
      }};
  return spec;
}

// CommandSpec has no positional arguments: DIR is taken out of the words first, as the first word
// that is neither an option nor an option's value.
std::pair<std::string, std::vector<std::string>> take_directory(
    const std::vector<std::string>& argv, const CommandSpec& spec) {
  std::set<std::string> with_value{"--config"};
  for (const OptionSpec& o : spec.options) {
    std::stringstream names(o.names);
    for (std::string name; !o.value.empty() && std::getline(names, name, ',');) {
      with_value.insert("--" + name);
    }
  }
  std::string dir;
  std::vector<std::string> rest;
  for (size_t i = 0; i < argv.size(); ++i) {
    if (dir.empty() && !argv[i].empty() && argv[i][0] != '-') {
      dir = argv[i];
      continue;  // a second one is left to Args, which refuses it with the other stray words
    }
    rest.push_back(argv[i]);
    if (with_value.count(argv[i]) && i + 1 < argv.size()) {
      rest.push_back(argv[++i]);
    }
  }
  return {dir, rest};
}

int consolidate(const std::vector<std::string>& argv) {
  const auto [dir, words] = take_directory(argv, consolidate_spec());
  Args args(words, consolidate_spec());
  if (args.has("help")) {
    std::cout << args.help();
    return 0;
  }
  if (dir.empty() || !args.has("out")) {
    throw UsageError("give the checkpoint's directory and --out FILE: consolidate DIR --out FILE");
  }
  const std::string names = args.get("names", "module");
  if (names != "module" && names != "hf") {
    throw UsageError("unknown --names '" + names +
                     "': give module (the model's own) or hf (Hugging Face GPT-2's)");
  }
  const std::string out = args.get("out");
  const ConsolidatedCheckpoint c = consolidate_sharded_checkpoint(
      dir, out,
      names == "hf" ? models::hf_gpt2_name : std::function<std::string(const std::string&)>());
  std::cout << "paratrain checkpoint: wrote " << c.parameters << " parameters (" << c.tensors
            << " tensors) of " << dir << " to " << out << std::endl;
  return 0;
}

// `paratrain checkpoint <command>`.
const std::vector<Command>& checkpoint_commands() {
  static const std::vector<Command> table{
      {"consolidate", "DIR --out FILE [--names hf]",
       "write a sharded FSDP checkpoint's whole model as one safetensors file", consolidate},
  };
  return table;
}

}  // namespace

int run_checkpoint(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::cout << help_text("paratrain checkpoint <command> [options]", "commands",
                           checkpoint_commands());
    return args.empty() ? 2 : 0;
  }
  return dispatch(checkpoint_commands(), args[0], {args.begin() + 1, args.end()},
                  "checkpoint command");
}

}  // namespace cli
}  // namespace paratrain
