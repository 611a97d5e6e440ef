// encore::Status — the result of validate/run: a code and a message that names the offending
// argument and what was expected ("x: dtype must be bf16, fp16 or fp32, got int32").
#pragma once
#include <string>
#include <utility>

namespace encore {

enum class StatusCode { kOk = 0, kInvalidArgument, kUnsupported, kCudaError, kInternal };

class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string msg) : code_(code), msg_(std::move(msg)) {}

  static Status ok() { return {}; }
  static Status invalid(std::string msg) { return {StatusCode::kInvalidArgument, std::move(msg)}; }
  static Status unsupported(std::string msg) { return {StatusCode::kUnsupported, std::move(msg)}; }
  static Status cuda_error(std::string msg) { return {StatusCode::kCudaError, std::move(msg)}; }
  static Status internal(std::string msg) { return {StatusCode::kInternal, std::move(msg)}; }

  bool is_ok() const { return code_ == StatusCode::kOk; }
  explicit operator bool() const { return is_ok(); }
  StatusCode code() const { return code_; }
  const std::string& message() const { return msg_; }
  // "invalid argument: x: ..." — code name followed by the message.
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string msg_;
};

const char* status_code_name(StatusCode code);

}  // namespace encore

// Returns early from the enclosing function when `expr` yields a non-ok Status.
#define ENCORE_RETURN_IF_ERROR(expr)        \
  do {                                      \
    ::encore::Status encore_st_ = (expr);   \
    if (!encore_st_.is_ok()) return encore_st_; \
  } while (0)
