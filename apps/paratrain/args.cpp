#include "args.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <sstream>

namespace paratrain {
namespace cli {

namespace {

std::vector<std::string> split_names(const std::string& names) {
  std::vector<std::string> out;
  std::stringstream in(names);
  std::string item;
  while (std::getline(in, item, ',')) {
    out.push_back(item);
  }
  return out;
}

// CLI11's messages, said the way the rest of the CLI says them.
std::string describe(const CLI::ParseError& e, const std::string& config) {
  const std::string what = e.what();
  if (dynamic_cast<const CLI::ArgumentMismatch*>(&e) != nullptr) {
    return what.substr(0, what.find(':')) + " needs a value";
  }
  if (dynamic_cast<const CLI::FileError*>(&e) != nullptr) {
    return "cannot read --config " + config + ": give a readable TOML file";
  }
  if (dynamic_cast<const CLI::ConfigError*>(&e) != nullptr) {
    return "--config " + config + ": " + what;
  }
  return what;
}

// A flag's value: "--json", "--json=false" or `json = true` in a config file.
bool flag_value(const std::string& name, const std::string& text) {
  std::string t = text;
  std::transform(t.begin(), t.end(), t.begin(), [](unsigned char c) { return std::tolower(c); });
  if (t == "true" || t == "1" || t == "yes" || t == "on") {
    return true;
  }
  if (t == "false" || t == "0" || t == "no" || t == "off" || t == "-1") {
    return false;
  }
  throw UsageError("--" + name + " takes no value (or true/false), got '" + text + "'");
}

// The --config FILE of `words` (the last one given), or "".
std::string config_path(const std::vector<std::string>& words) {
  std::string path;
  for (size_t i = 0; i < words.size(); ++i) {
    if (words[i] == "--config" && i + 1 < words.size()) {
      path = words[++i];
    } else if (words[i].rfind("--config=", 0) == 0) {
      path = words[i].substr(9);
    }
  }
  return path;
}

// The items of the config file, read with CLI11's own TOML reader (the one that fills the
// options). Only a regular file: CLI11 would read /dev/zero forever, and a pipe twice.
std::vector<CLI::ConfigItem> read_config(const CLI::App& app, const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    throw UsageError("cannot read --config " + path + ": " +
                     (std::filesystem::exists(path, ec) ? "not a regular file" : "no such file") +
                     "; give a readable TOML file");
  }
  try {
    return app.get_config_formatter_base()->from_file(path);
  } catch (const CLI::Error& e) {
    throw UsageError("--config " + path + ": " + e.what());
  }
}

// Every key of the config file must name an option: CLI11 ignores the others, which would hide a
// misspelt setting.
void check_config_keys(const std::vector<CLI::ConfigItem>& items,
                       const std::string& path,
                       const std::vector<std::string>& known) {
  for (const CLI::ConfigItem& item : items) {
    if (item.name == "++" || item.name == "--") {
      continue;  // the start or end of a [section]; its keys come as items with parents
    }
    const std::string key = item.fullname();
    if (!item.parents.empty() || std::find(known.begin(), known.end(), key) == known.end()) {
      throw UsageError("unknown key '" + key + "' in --config " + path +
                       "; the nearest valid key is '" + nearest(item.name, known) + "'");
    }
  }
}

// CLI11 drops an empty inline value ("--resume=") and would take the next word instead: make it
// an explicit empty word.
std::vector<std::string> split_empty_values(const std::vector<std::string>& words,
                                            const CommandSpec& spec) {
  std::vector<std::string> valued{"config"};
  for (const OptionSpec& o : spec.options) {
    if (!o.value.empty()) {
      const std::vector<std::string> names = split_names(o.names);
      valued.insert(valued.end(), names.begin(), names.end());
    }
  }
  std::vector<std::string> out;
  for (const std::string& w : words) {
    const std::string name = w.size() > 3 ? w.substr(2, w.size() - 3) : "";
    if (w.rfind("--", 0) == 0 && w.back() == '=' && w.find('=') == w.size() - 1 &&
        std::find(valued.begin(), valued.end(), name) != valued.end()) {
      out.push_back(w.substr(0, w.size() - 1));
      out.emplace_back();
    } else {
      out.push_back(w);
    }
  }
  return out;
}

// `text` broken at spaces into lines of at most `width` characters; CLI11 indents each line
// under the option's column but does not wrap.
std::string wrap(const std::string& text, size_t width) {
  std::string out;
  size_t line = 0;
  std::stringstream in(text);
  std::string word;
  while (in >> word) {
    if (line > 0 && line + 1 + word.size() > width) {
      out += '\n';
      line = 0;
    } else if (line > 0) {
      out += ' ';
      ++line;
    }
    out += word;
    line += word.size();
  }
  return out;
}

// `text` as Markdown: outside code spans `<` is escaped (a placeholder such as <rank> would be
// read as HTML); in a table cell, pipes are escaped and line breaks become spaces too.
std::string markdown(const std::string& text, bool cell) {
  std::string out;
  bool code = false;
  for (const char c : text) {
    code = code != (c == '`');
    if (c == '<' && !code) {
      out += "&lt;";
    } else if (cell && c == '|') {
      out += "\\|";
    } else {
      out += cell && c == '\n' ? ' ' : c;
    }
  }
  return out;
}

// The spec as a Markdown section of the reference: the name, the description, a table of the
// options (the internal ones left out) and the footer.
std::string markdown_help(const CommandSpec& spec) {
  std::ostringstream out;
  out << "### `" << spec.name << "`\n\n" << markdown(spec.description, false) << "\n\n";
  out << "| option | what it does |\n| --- | --- |\n";
  for (const OptionSpec& o : spec.options) {
    if (o.help == kInternalOption) {
      continue;
    }
    std::string flags;
    for (const auto& n : split_names(o.names)) {
      flags += (flags.empty() ? "`" : ", `") + std::string(n.size() == 1 ? "-" : "--") + n +
               (o.value.empty() ? "" : " " + o.value) + "`";
    }
    out << "| " << markdown(flags, true) << " | " << markdown(o.help, true) << " |\n";
  }
  out << "| `--config FILE` | read options from a TOML file whose keys are the long option names "
         "(`lr = 0.1`); the command line overrides it |\n";
  if (!spec.footer.empty()) {  // as the help prints it: examples keep their lines
    out << "\n```text\n" << spec.footer << (spec.footer.back() == '\n' ? "" : "\n") << "```\n";
  }
  return out.str();
}

// Every option has a help text unless it is internal.
void check_help_texts(const CommandSpec& spec) {
  for (const OptionSpec& o : spec.options) {
    if (o.help.empty()) {
      throw std::logic_error(spec.name + "'s option --" + split_names(o.names)[0] +
                             " has no help text: give it one, or kInternalOption to hide it");
    }
  }
}

}  // namespace

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream s(text);
  for (std::string item; std::getline(s, item, ',');) {
    if (!item.empty()) {
      out.push_back(item);
    }
  }
  return out;
}

std::string nearest(const std::string& word, const std::vector<std::string>& choices) {
  // Levenshtein distance: CLI11 suggests nothing, and the lists are a few dozen short names.
  std::string best;
  size_t best_distance = std::numeric_limits<size_t>::max();
  for (const std::string& c : choices) {
    std::vector<size_t> row(c.size() + 1);
    for (size_t j = 0; j <= c.size(); ++j) {
      row[j] = j;
    }
    for (size_t i = 1; i <= word.size(); ++i) {
      size_t diagonal = row[0];
      row[0] = i;
      for (size_t j = 1; j <= c.size(); ++j) {
        const size_t up = row[j];
        row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (word[i - 1] != c[j - 1])});
        diagonal = up;
      }
    }
    if (row[c.size()] < best_distance) {
      best_distance = row[c.size()];
      best = c;
    }
  }
  return best;
}

Args::Args(const std::vector<std::string>& argv, const CommandSpec& spec) {
  check_help_texts(spec);
  const auto dash = std::find(argv.begin(), argv.end(), "--");
  const std::vector<std::string> words = split_empty_values({argv.begin(), dash}, spec);
  if (dash != argv.end()) {
    if (!spec.program) {
      throw UsageError("unexpected '--': " + spec.name + " runs no program");
    }
    rest_.assign(dash + 1, argv.end());
  }
  CLI::App app(spec.description, spec.name);
  app.set_help_flag("-h,--help", "print this help and exit");
  app.set_config("--config", "",
                 wrap("read options from a TOML file whose keys are the long option names "
                      "(lr = 0.1); the command line overrides it",
                      68))
      ->type_name("FILE")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.allow_extras(true);  // unknown words are reported below, with the nearest option
  app.footer(spec.footer);
  app.get_formatter()->column_width(30);
  std::vector<std::pair<const OptionSpec*, CLI::Option*>> options;
  std::vector<std::string> known;  // every name and alias
  for (const OptionSpec& o : spec.options) {
    std::string flags;
    for (const auto& n : split_names(o.names)) {
      // A one-letter name is a short option (-m), as torchrun's.
      flags += (flags.empty() ? "" : ",") + std::string(n.size() == 1 ? "-" : "--") + n;
      known.push_back(n);
    }
    const std::string help = wrap(o.help, 68);
    CLI::Option* opt = o.value.empty() ? app.add_flag(flags, help)
                                       : app.add_option(flags, help)
                                             ->type_name(o.value)
                                             ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
    if (o.help == kInternalOption) {
      opt->group("");  // hidden from the help
    }
    options.emplace_back(&o, opt);
  }
  const char* format = std::getenv("PARATRAIN_HELP_FORMAT");
  help_ = format != nullptr && std::string(format) == "markdown" ? markdown_help(spec) : app.help();
  if (std::find(words.begin(), words.end(), "--help") != words.end() ||
      std::find(words.begin(), words.end(), "-h") != words.end()) {
    values_.emplace("help", "1");  // before CLI11 reads any --config file
    return;
  }
  const std::string config = config_path(words);
  std::vector<CLI::ConfigItem> items;
  if (!config.empty()) {
    items = read_config(app, config);
    check_config_keys(items, config, known);
  }
  parse(app, words, spec, known);
  if (values_.count("help")) {
    return;
  }
  for (const auto& [o, opt] : options) {
    const auto& order = app.parse_order();  // the command line's options, not the config's
    collect(*o, *opt,
            std::find(order.begin(), order.end(), opt) == order.end() ? items : decltype(items){});
  }
}

void Args::parse(CLI::App& app,
                 const std::vector<std::string>& words,
                 const CommandSpec& spec,
                 const std::vector<std::string>& known) {
  std::vector<std::string> reversed(words.rbegin(), words.rend());  // CLI11 pops from the back
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    values_.emplace("help", "1");
    return;
  } catch (const CLI::ParseError& e) {
    throw UsageError(describe(e, config_path(words)));
  } catch (const CLI::Error& e) {
    throw UsageError(e.what());
  }
  for (const std::string& w : app.remaining()) {
    const size_t start = w.find_first_not_of('-');
    if (w.size() > 1 && w[0] == '-' && start != std::string::npos) {
      const std::string name = w.substr(start);
      throw UsageError("unknown option " + w + " (the nearest is --" +
                       nearest(name.substr(0, name.find('=')), known) + ")");
    }
    throw UsageError("unexpected '" + w + "'" +
                     (spec.program ? " before the program: put the program after --"
                                   : ": options start with --"));
  }
}

void Args::collect(const OptionSpec& o,
                   const CLI::Option& opt,
                   const std::vector<CLI::ConfigItem>& items) {
  const std::string name = split_names(o.names)[0];
  if (opt.get_expected_min() == 0) {  // a flag
    if (opt.count() > 0 && flag_value(name, opt.results().back())) {
      values_.emplace(name, "1");
    }
    return;
  }
  std::vector<std::string> results = opt.results();
  if (!o.repeatable && results.size() > 1) {
    // Values from a config list (`items` is empty when the command line gave the option) are
    // one value.
    for (const CLI::ConfigItem& item : items) {
      if (item.parents.empty() && results == item.inputs && opt.check_name("--" + item.name)) {
        std::string joined;
        for (const std::string& v : item.inputs) {
          joined += (joined.empty() ? "" : ",") + v;
        }
        results = {joined};
      }
    }
  }
  for (const std::string& r : results) {
    values_.emplace(name, r);
  }
}

std::string Args::get(const std::string& name, const std::string& fallback) const {
  auto range = values_.equal_range(name);
  if (range.first == range.second) {
    return fallback;
  }
  return std::prev(range.second)->second;  // the last one wins, as in most CLIs
}

std::vector<std::string> Args::get_all(const std::string& name) const {
  std::vector<std::string> out;
  auto range = values_.equal_range(name);
  for (auto it = range.first; it != range.second; ++it) {
    out.push_back(it->second);
  }
  return out;
}

int Args::get_int(const std::string& name, int fallback) const {
  if (!has(name)) {
    return fallback;
  }
  std::string text = get(name);
  char* end = nullptr;
  long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || v < -2147483647L || v > 2147483647L) {
    throw UsageError("--" + name + " '" + text + "' is not an integer");
  }
  return static_cast<int>(v);
}

double Args::get_double(const std::string& name, double fallback) const {
  if (!has(name)) {
    return fallback;
  }
  std::string text = get(name);
  char* end = nullptr;
  double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !std::isfinite(v)) {
    throw UsageError("--" + name + " '" + text + "' is not a number");
  }
  return v;
}

long long parse_bytes(const std::string& text, const std::string& what) {
  size_t i = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
    ++i;
  }
  std::string unit = text.substr(i);
  long long scale = 0;
  if (unit.empty() || unit == "B") {
    scale = 1;
  } else if (unit == "K" || unit == "KiB" || unit == "k") {
    scale = 1LL << 10;
  } else if (unit == "M" || unit == "MiB") {
    scale = 1LL << 20;
  } else if (unit == "G" || unit == "GiB") {
    scale = 1LL << 30;
  }
  if (i == 0 || i > 12 || scale == 0) {
    throw UsageError(what + " '" + text + "' is not a size; write it as 4096, 1K, 64M or 1G");
  }
  const long long count = std::stoll(text.substr(0, i));  // at most 12 digits: fits
  if (count > std::numeric_limits<long long>::max() / scale) {
    throw UsageError(what + " '" + text + "' is too large");
  }
  return count * scale;
}

long long Args::get_bytes(const std::string& name, long long fallback) const {
  return has(name) ? parse_bytes(get(name), "--" + name) : fallback;
}

}  // namespace cli
}  // namespace paratrain
