// Job records written under schema 1 (before lathe.v1.Strategy), brought to schema 2 when
// SqliteStore opens the file. Schema 1 kept the strategy in other fields: JobSpec field 8
// (a StrategySpec message: automatic, the five fields, fused_kernels, auto_fields),
// TrainSpec field 4 (micro_batch, 0 for auto) and Plan fields 3-8 and 14. Those numbers are
// reserved in job.proto, so a parsed schema 1 record keeps them as unknown fields; this
// moves them into JobSpec.strategy and Plan.strategy with the same meaning and drops them.
//
// Thread-safety: a pure function of its argument.
#ifndef LATHE_COORDINATOR_STORE_SCHEMA1_RECORDS_H_
#define LATHE_COORDINATOR_STORE_SCHEMA1_RECORDS_H_

#include "lathe/v1/job.pb.h"

namespace lathe {

// Rewrites `job`'s spec and plan as schema 2 holds them. A record without schema 1 fields
// (a job stored by this build) is left as it is.
void MigrateSchema1Record(v1::JobStatus* job);

}  // namespace lathe

#endif  // LATHE_COORDINATOR_STORE_SCHEMA1_RECORDS_H_
