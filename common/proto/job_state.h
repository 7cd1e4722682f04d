// Predicates and names over the API's job states and devices, shared by the coordinator and
// the client.
#ifndef LATHE_COMMON_PROTO_JOB_STATE_H_
#define LATHE_COMMON_PROTO_JOB_STATE_H_

#include <string>

#include "lathe/v1/job.pb.h"

namespace lathe {

// True for the states a job never leaves: SUCCEEDED, FAILED, CANCELLED.
inline bool IsFinalState(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
         state == v1::JOB_STATE_CANCELLED;
}

// "cpu" or "cuda", as users write them in specs (an unset device is a CPU).
inline std::string DeviceName(v1::Device device) {
  return device == v1::DEVICE_CUDA ? "cuda" : "cpu";
}

}  // namespace lathe

#endif  // LATHE_COMMON_PROTO_JOB_STATE_H_
