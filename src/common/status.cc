// Names for status codes, stable across versions: they appear in JSON error bodies.
#include "common/status.h"

namespace hetero {

const char* code_name(Code code) {
  switch (code) {
    case Code::kOk:
      return "ok";
    case Code::kInvalidArgument:
      return "invalid_argument";
    case Code::kNotFound:
      return "not_found";
    case Code::kFailedPrecondition:
      return "failed_precondition";
    case Code::kDataLoss:
      return "data_loss";
    case Code::kUnavailable:
      return "unavailable";
    case Code::kDeadlineExceeded:
      return "deadline_exceeded";
    case Code::kResourceExhausted:
      return "resource_exhausted";
    case Code::kInternal:
      return "internal";
  }
  return "unknown";
}

std::string Status::to_string() const {
  if (is_ok()) return "ok";
  return std::string(code_name(code_)) + ": " + message_;
}

}  // namespace hetero
