#pragma once

// Internal: one way to turn an exception into the one line paratrain shows users, for errors that
// wrap another (a replica's, a stage's, an engine's).

#include <exception>
#include <string>

namespace paratrain {
namespace detail {

/// The first line of the message, without libtorch's C++ backtrace and without c10d's
/// "[path/file.cc:123] " location prefixes: the engine's or the library's words only.
std::string error_message(const std::exception& e);

/// The whole message of a captured exception (a replica's, a stage's) without libtorch's C++
/// backtrace; "unknown exception" for one that is no std::exception.
std::string error_message(const std::exception_ptr& error);

}  // namespace detail
}  // namespace paratrain
