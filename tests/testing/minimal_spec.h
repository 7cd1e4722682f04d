// The smallest valid job spec, for tests of what is made from a spec.
#ifndef LATHE_TESTS_TESTING_MINIMAL_SPEC_H_
#define LATHE_TESTS_TESTING_MINIMAL_SPEC_H_

#include "common/job_spec.h"

namespace lathe::testing {

// name "t", model /m, data /d, 10 steps, output /o; everything else at its default.
inline JobSpec MinimalSpec() {
  JobSpec spec;
  spec.name = "t";
  spec.model.path = "/m";
  spec.data.train = "/d";
  spec.train.steps = 10;
  spec.output = "/o";
  return spec;
}

}  // namespace lathe::testing

#endif  // LATHE_TESTS_TESTING_MINIMAL_SPEC_H_
