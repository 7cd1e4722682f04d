// Request ids for JobService.SubmitJob: a random UUID (version 4) per submission, so that a
// retried submission is recognised and does not create a second job.
//
// Thread-safety: thread-safe (each call opens /dev/urandom on its own).
#ifndef LATHE_CLIENT_REQUEST_ID_H_
#define LATHE_CLIENT_REQUEST_ID_H_

#include <string>

#include "absl/status/statusor.h"

namespace lathe {

// A random UUID v4 in its canonical form, "xxxxxxxx-xxxx-4xxx-yxxx-xxxxxxxxxxxx" (lowercase
// hex, y one of 8, 9, a, b), from 16 bytes of /dev/urandom. INTERNAL naming the device when
// it cannot be read.
absl::StatusOr<std::string> NewRequestId();

}  // namespace lathe

#endif  // LATHE_CLIENT_REQUEST_ID_H_
