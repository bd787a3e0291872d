// An error the HTTP API reports to its client: the status and OpenAI's error object
// ({"error": {"message", "type", "param", "code"}}).
#pragma once

#include <string>

#include "tandem/core/error.h"

namespace tandem::server {

class ApiError : public Error {
 public:
  ApiError(int status, std::string message, std::string param = {}, std::string code = {})
      : Error(message), status_(status), param_(std::move(param)), code_(std::move(code)) {}
  int status() const { return status_; }
  const std::string& param() const { return param_; }
  const std::string& code() const { return code_; }
  // OpenAI's type for the status: invalid_request_error, authentication_error, ...
  const char* type() const;

 private:
  int status_;
  std::string param_, code_;
};

// Throws ApiError(400, ...) naming the offending parameter.
template <class... Parts>
[[noreturn]] void bad_request(const std::string& param, Parts&&... parts) {
  std::ostringstream os;
  (os << ... << std::forward<Parts>(parts));
  throw ApiError(400, os.str(), param);
}

}  // namespace tandem::server
