// Predicates over the API's job states, shared by the coordinator and the client.
#ifndef LATHE_COMMON_PROTO_JOB_STATE_H_
#define LATHE_COMMON_PROTO_JOB_STATE_H_

#include "lathe/v1/job.pb.h"

namespace lathe {

// True for the states a job never leaves: SUCCEEDED, FAILED, CANCELLED.
inline bool IsFinalState(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
         state == v1::JOB_STATE_CANCELLED;
}

}  // namespace lathe

#endif  // LATHE_COMMON_PROTO_JOB_STATE_H_
