#include "errors.h"

#include "paratrain/base/option_error.h"

#include <c10/util/Exception.h>

#include <cstdint>
#include <utility>

namespace paratrain {
namespace detail {

std::string error_message(const std::exception& e) {
  std::string text = e.what();
  if (auto c10_error = dynamic_cast<const c10::Error*>(&e)) {
    text = c10_error->what_without_backtrace();
  }
  text = text.substr(0, text.find('\n'));
  while (!text.empty() && text[0] == '[') {
    auto close = text.find("] ");
    if (close == std::string::npos) {
      break;
    }
    text = text.substr(close + 2);
  }
  return text;
}

std::string error_message(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace detail
}  // namespace paratrain

namespace paratrain {

OptionError::OptionError(std::string field, const std::string& message, c10::SourceLocation where)
    : c10::Error(where, message), field_(std::move(field)) {}

}  // namespace paratrain
