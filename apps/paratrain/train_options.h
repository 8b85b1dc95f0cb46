#pragma once

// paratrain train's command line, shared by train_options.cpp (the option table, and every check
// that can fail before anything is loaded or launched) and train.cpp (running what they allow).
// Everything is read and checked up front so that a bad command line fails with exit code 2
// before a launcher starts ranks or a dataset is read.

#include "args.h"

#include "paratrain/base/option_error.h"
#include "paratrain/models/gpt.h"
#include "paratrain/paratrain.h"

#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

namespace paratrain {
namespace cli {
namespace train_detail {

/// The run's shape, read from the command line and checked (read_settings); the optimizer,
/// schedule, checkpoint and metrics flags go to TrainerOptions instead (loop_options).
struct TrainSettings {
  std::string model_name;
  std::string dataset;
  std::string strategy;
  std::string data_dir;
  std::string head;                // "" or "custom"
  bool gpt = false;                // --model gpt or a GPT-2 preset: trained on --dataset tokens
  models::GptOptions gpt_options;  // its shapes, --vocab and --context applied
  std::string device_kind;         // "cpu" or "cuda"
  int epochs = 1;
  int steps = 0;
  int batch_size = 64;
  double lr = 0.05;
  double momentum = 0.9;
  double weight_decay = 0.0;
  int seed = 0;
  int workers = 1;
  int nproc = 0;
  bool json = false;
  int image_size = 0;
  int channels = 0;
  bool piped = false;  // --strategy pipeline
  int stages = 2;
  int chunks = 4;
  std::vector<torch::Device> dp_devices;     // --strategy dp
  std::vector<torch::Device> stage_devices;  // --strategy pipeline
  pipeline::Schedule schedule = pipeline::Schedule::kGPipe;
  amp::AmpOptions amp_options;
};

const CommandSpec& train_spec();

/// Whether --model `name` is a GPT: a GPT-2 preset, or "gpt".
bool is_gpt(const std::string& name);

/// A GPT's shape: --model gpt's --layers, --width and --heads, or a preset's, with --vocab and
/// --context applied; with --load-weights DIR, a Hugging Face model directory, its config.json's,
/// --context shortening it. Throws UsageError for flags that do not go together, c10::Error for a
/// config.json paratrain's GPT-2 cannot follow.
models::GptOptions read_gpt(const Args& args, const std::string& name);

/// Started by a launcher that already made the ranks.
bool inside_a_job();

/// --strategy ddp --nproc-per-node N outside a job: this process launches the ranks instead of
/// training.
bool becomes_launcher(const TrainSettings& s);

/// Throws UsageError for the first bad flag, in the order the checks were always made.
TrainSettings read_settings(const Args& args);

/// The optimizer, schedule, accumulation, clipping, checkpoint and metrics flags.
TrainerOptions loop_options(const Args& args, const TrainSettings& s);

/// Text of the library (an OptionError's, ReplicaDivergence's) in the command line's words: each
/// option field it names becomes its flag ("checkpoint_dir" -> "--checkpoint-dir").
/// `more`: fields of another option struct the text may name (a dataset's "root").
std::string in_flags(const std::string& text, const std::map<std::string, std::string>& more = {});
std::string flag_message(const OptionError& e);

}  // namespace train_detail
}  // namespace cli
}  // namespace paratrain
