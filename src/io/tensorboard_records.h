#pragma once

// Internal: TensorBoard's Event records, serialized, for SummaryWriter (tensorboard.cpp).
//
// Why a translation unit of its own: it is the only code that includes the Protocol Buffers
// headers, and it is compiled without libtorch's include directories. Official libtorch builds
// and the PyTorch wheels ship protobuf headers of their own version there, which would shadow the
// installed protoc's and break its generated code; libtorch's protobuf symbols are hidden, so
// only the headers clash. This header names no protobuf type.

#include <cstdint>
#include <string>

namespace paratrain {
namespace tensorboard {
namespace detail {

/// The first record of every event file: file_version "brain.Event:2".
std::string version_event(double wall_time);
/// One scalar summary (TensorBoard's scalars are float32).
std::string scalar_event(double wall_time, int64_t step, const std::string& tag, float value);
/// SessionLog START at `step`: TensorBoard drops what earlier files logged at or after it.
std::string session_start_event(double wall_time, int64_t step);

}  // namespace detail
}  // namespace tensorboard
}  // namespace paratrain
