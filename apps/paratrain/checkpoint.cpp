// paratrain checkpoint: tools for checkpoints. consolidate writes the whole model of a sharded
// FSDP checkpoint (save_sharded_checkpoint, include/paratrain/parallel/fsdp_checkpoint.h) as one
// safetensors file, or a GPT-2's as a Hugging Face model directory, without ranks or a model: for
// evaluation, export, or transformers.

#include "args.h"
#include "commands.h"

#include "paratrain/io/safetensors_shards.h"
#include "paratrain/models/gpt.h"
#include "paratrain/models/gpt_pretrained.h"
#include "paratrain/parallel/fsdp_checkpoint.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <iostream>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace paratrain {
namespace cli {

namespace {

const CommandSpec& consolidate_spec() {
  static const CommandSpec spec{
      "paratrain checkpoint consolidate",
      "paratrain checkpoint consolidate DIR --out FILE|OUTDIR [--names hf]: writes every\n"
      "parameter and buffer of the sharded FSDP checkpoint in the directory DIR (the newest\n"
      "of save_sharded_checkpoint or of `paratrain train --strategy fsdp --checkpoint-dir\n"
      "DIR`; ckpt-N.json with one ckpt-N.rank-R.safetensors per rank, or an earlier version's\n"
      "fsdp.json) to one safetensors file, by the model's names, in the dtype they\n"
      "were saved in, with the checkpoint's metadata. A checkpoint made on a device mesh\n"
      "(--tp, --dp-shard, --dp-replicate) gives the whole model too: the tensor-parallel parts\n"
      "are joined. With --names hf and an --out that does not\n"
      "end in .safetensors, it writes a Hugging Face model directory instead, as\n"
      "GPT2LMHeadModel.save_pretrained does: config.json and model.safetensors, or shards of at\n"
      "most --max-shard-size with model.safetensors.index.json; from_pretrained(OUTDIR) loads it.\n"
      "It needs no ranks, and holds one copy of the weights in memory (not the optimizer's\n"
      "state).",
      {
          {"out", "FILE|OUTDIR",
           "the safetensors file to write (outside DIR, and not named as a checkpoint's file; "
           "an existing one is replaced atomically), or with --names hf a new model directory "
           "(one that holds a model's files already is refused: nothing is written over)"},
          {"names", "module|hf",
           "the tensors' names: module (the model's own, the default) or hf (those of Hugging "
           "Face's GPT2LMHeadModel, transformer.h.0.attn.c_attn.weight)"},
          {"max-shard-size", "SIZE",
           "OUTDIR: the largest weights file, as save_pretrained's max_shard_size (500KB, 5GB; "
           "default 5GB)"},
          {"heads", "H",
           "OUTDIR: the model's attention heads (config.json's n_head), for a checkpoint that "
           "does not record them (paratrain train's do)"},
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

// --out with --names hf and no .safetensors ending: a Hugging Face model directory.
bool writes_hf_directory(const Args& args) {
  const std::string out = args.get("out");
  const std::string suffix = ".safetensors";
  return args.get("names", "module") == "hf" &&
         !(out.size() >= suffix.size() &&
           out.compare(out.size() - suffix.size(), suffix.size(), suffix) == 0);
}

// The checkpoint's GPT-2 shape: the weights give all but the heads, which paratrain train's run
// configuration (or --heads) gives; its dropout goes to config.json too.
models::GptOptions hf_shape(const Args& args, const ConsolidatedModel& model) {
  const nlohmann::json config =
      model.config.empty() ? nlohmann::json::object() : nlohmann::json::parse(model.config);
  const nlohmann::json gpt = config.value("gpt", nlohmann::json::object());
  const int64_t recorded = gpt.value("heads", int64_t{0});
  const int64_t heads = args.get_int("heads", static_cast<int>(recorded));
  if (heads == 0) {
    throw UsageError(
        "the checkpoint does not record the model's attention heads (n_head), which no "
        "tensor's shape tells: give --heads H");
  }
  if (recorded != 0 && heads != recorded) {
    throw UsageError("--heads " + std::to_string(heads) + " differs from the checkpoint's " +
                     std::to_string(recorded) + " heads: drop --heads");
  }
  return models::gpt2_options_of_weights(model.tensors, heads).dropout(gpt.value("dropout", 0.1));
}

int consolidate_to_hf_directory(const Args& args, const std::string& dir) {
  const std::string out = args.get("out");
  int64_t max_shard = models::kHfDefaultMaxShardBytes;
  if (args.has("max-shard-size")) {
    try {
      max_shard = parse_shard_size(args.get("max-shard-size"));
    } catch (const c10::Error& e) {
      throw UsageError("--max-shard-size " + std::string(e.what_without_backtrace()));
    }
  }
  models::check_gpt2_pretrained_target(out);  // before the checkpoint is read
  const ConsolidatedModel model = consolidate_sharded_model(dir, models::hf_gpt2_name);
  models::save_gpt2_pretrained(out, model.tensors, hf_shape(args, model), max_shard);
  std::cout << "paratrain checkpoint: wrote " << model.counts.parameters << " parameters ("
            << model.counts.tensors << " tensors) of " << dir << " to " << out
            << " as a Hugging Face GPT-2 (config.json, "
            << (std::filesystem::exists(out + "/" + kSafetensorsIndexFile)
                    ? "shards and " + std::string(kSafetensorsIndexFile)
                    : std::string(kSafetensorsWeightsFile))
            << ")" << std::endl;
  return 0;
}

int consolidate(const std::vector<std::string>& argv) {
  const auto [dir, words] = take_directory(argv, consolidate_spec());
  Args args(words, consolidate_spec());
  if (args.has("help")) {
    std::cout << args.help();
    return 0;
  }
  if (dir.empty() || !args.has("out")) {
    throw UsageError(
        "give the checkpoint's directory and --out FILE: consolidate DIR --out FILE (or "
        "--names hf --out OUTDIR)");
  }
  const std::string names = args.get("names", "module");
  if (names != "module" && names != "hf") {
    throw UsageError("unknown --names '" + names +
                     "': give module (the model's own) or hf (Hugging Face GPT-2's)");
  }
  if (writes_hf_directory(args)) {
    return consolidate_to_hf_directory(args, dir);
  }
  for (const char* flag : {"max-shard-size", "heads"}) {
    if (args.has(flag)) {
      throw UsageError(std::string("--") + flag +
                       " goes with a Hugging Face model directory: --names hf --out OUTDIR "
                       "(not a .safetensors file)");
    }
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
      {"consolidate", "DIR --out FILE|OUTDIR [--names hf]",
       "write a sharded FSDP checkpoint's whole model as one safetensors file, or a GPT-2's as "
       "a Hugging Face model directory",
       consolidate},
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
