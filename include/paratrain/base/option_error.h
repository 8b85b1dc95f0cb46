#pragma once

// A bad option, named by its field: the library says what is wrong in its own terms (the option
// structs' field names, "checkpoint_dir"), and a command line maps each field to its flag
// ("--checkpoint-dir") rather than checking the same rule again in its own words.
//
//   PARATRAIN_CHECK_OPTION(o.keep() >= 1, "keep", "keep must be >= 1, got ", o.keep());
//   ...
//   catch (const paratrain::OptionError& e) { e.field(); e.what_without_backtrace(); }

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <string>

namespace paratrain {

class OptionError : public c10::Error {
 public:
  /// `where`: the check that failed (PARATRAIN_CHECK_OPTION gives it).
  OptionError(std::string field,
              const std::string& message,
              c10::SourceLocation where = {"", "", 0});
  /// The option's name in the API: "checkpoint_dir", "keep".
  const std::string& field() const { return field_; }

 private:
  std::string field_;
};

}  // namespace paratrain

/// Throws paratrain::OptionError(field, c10::str(message...)) when `cond` is false.
#define PARATRAIN_CHECK_OPTION(cond, field, ...)                                       \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      throw ::paratrain::OptionError(                                                  \
          (field), ::c10::str(__VA_ARGS__),                                            \
          ::c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)}); \
    }                                                                                  \
  } while (false)
