#include "tensorboard_records.h"

#include "tensorboard_event.pb.h"

namespace paratrain {
namespace tensorboard {
namespace detail {

std::string version_event(double wall_time) {
  Event event;
  event.set_wall_time(wall_time);
  event.set_file_version("brain.Event:2");
  return event.SerializeAsString();
}

std::string scalar_event(double wall_time, int64_t step, const std::string& tag, float value) {
  Event event;
  event.set_wall_time(wall_time);
  event.set_step(step);
  Summary::Value* v = event.mutable_summary()->add_value();
  v->set_tag(tag);
  v->set_simple_value(value);
  return event.SerializeAsString();
}

std::string session_start_event(double wall_time, int64_t step) {
  Event event;
  event.set_wall_time(wall_time);
  event.set_step(step);
  event.mutable_session_log()->set_status(SessionLog::START);
  return event.SerializeAsString();
}

}  // namespace detail
}  // namespace tensorboard
}  // namespace paratrain
