#include "worker/engine/torch_compat.h"

#include "absl/strings/str_cat.h"

namespace lathe {

absl::Status StatusFromTorchError(const c10::Error& error, absl::string_view context) {
  std::string message = error.what_without_backtrace();
  if (size_t newline = message.find('\n'); newline != std::string::npos) message.resize(newline);
  bool out_of_memory = message.find("out of memory") != std::string::npos ||
                       message.find("DefaultCPUAllocator: can't allocate") != std::string::npos;
  std::string text = absl::StrCat(context, ": ", message);
  return out_of_memory ? absl::ResourceExhaustedError(text) : absl::InternalError(text);
}

}  // namespace lathe
