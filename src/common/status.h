// Status and Result<T>: how expected failures travel (bad request, peer gone, timeout, checksum
// mismatch). Broken invariants use HETERO_CHECK instead, which aborts with file and line.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <variant>

namespace hetero {

enum class Code : int {
  kOk = 0,
  kInvalidArgument,     // the caller sent something malformed
  kNotFound,            // a file, tensor or route that does not exist
  kFailedPrecondition,  // e.g. fingerprint mismatch: refused, nothing changed
  kDataLoss,            // checksum mismatch, truncated segment
  kUnavailable,         // peer gone; transient, may be retried
  kDeadlineExceeded,    // stall past a deadline; transient
  kResourceExhausted,   // out of memory (host or device) for this request; nothing else broken
  kInternal,
};

const char* code_name(Code code);
// Transient errors are the only ones worth retrying (peer gone, deadline).
inline bool is_transient(Code code) {
  return code == Code::kUnavailable || code == Code::kDeadlineExceeded;
}

class Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status ok() { return Status(); }
  bool is_ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string to_string() const;

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

inline Status invalid_argument(std::string m) { return {Code::kInvalidArgument, std::move(m)}; }
inline Status not_found(std::string m) { return {Code::kNotFound, std::move(m)}; }
inline Status failed_precondition(std::string m) {
  return {Code::kFailedPrecondition, std::move(m)};
}
inline Status data_loss(std::string m) { return {Code::kDataLoss, std::move(m)}; }
inline Status unavailable(std::string m) { return {Code::kUnavailable, std::move(m)}; }
inline Status resource_exhausted(std::string m) { return {Code::kResourceExhausted, std::move(m)}; }
inline Status internal_error(std::string m) { return {Code::kInternal, std::move(m)}; }

// A value or the Status that explains why there is none.
template <typename T>
class Result {
 public:
  Result(T value) : v_(std::move(value)) {}
  Result(Status status) : v_(std::move(status)) {}
  bool is_ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return is_ok() ? kOk : std::get<Status>(v_);
  }
  T& value() { return std::get<T>(v_); }
  const T& value() const { return std::get<T>(v_); }
  T* operator->() { return &value(); }
  T& operator*() { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace hetero

#define HETERO_CHECK(cond)                                                          \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                 \
    }                                                                               \
  } while (0)

#define HETERO_CONCAT_INNER(a, b) a##b
#define HETERO_CONCAT(a, b) HETERO_CONCAT_INNER(a, b)

// Propagate a non-ok Status from an expression returning Status.
#define HETERO_RETURN_IF_ERROR(expr)                    \
  do {                                                  \
    ::hetero::Status hetero_status_ = (expr);           \
    if (!hetero_status_.is_ok()) return hetero_status_; \
  } while (0)

// Assign the value of a Result<T> expression to lhs, or return its Status.
#define HETERO_ASSIGN_OR_RETURN(lhs, expr)                   \
  auto HETERO_CONCAT(hetero_result_, __LINE__) = (expr);     \
  if (!HETERO_CONCAT(hetero_result_, __LINE__).is_ok())      \
    return HETERO_CONCAT(hetero_result_, __LINE__).status(); \
  lhs = std::move(HETERO_CONCAT(hetero_result_, __LINE__).value())
