#include "worker/engine/lr_schedule.h"

#include <cmath>

#include "gtest/gtest.h"

namespace lathe {
namespace {

TEST(LearningRate, WarmupRisesLinearlyFromZero) {
  ScheduleSpec schedule{ScheduleKind::kConstant, 4};
  EXPECT_DOUBLE_EQ(LearningRate(schedule, 1.0, 0, 10), 0.0);
  EXPECT_DOUBLE_EQ(LearningRate(schedule, 1.0, 1, 10), 0.25);
  EXPECT_DOUBLE_EQ(LearningRate(schedule, 1.0, 3, 10), 0.75);
  EXPECT_DOUBLE_EQ(LearningRate(schedule, 1.0, 4, 10), 1.0);
  EXPECT_DOUBLE_EQ(LearningRate(schedule, 1.0, 9, 10), 1.0);
}

TEST(LearningRate, CosineDecaysToZeroAfterWarmup) {
  ScheduleSpec schedule{ScheduleKind::kCosine, 2};
  EXPECT_DOUBLE_EQ(LearningRate(schedule, 2.0, 2, 12), 2.0);
  // Half way through the decay: cos(pi/2) = 0, so half the peak.
  EXPECT_NEAR(LearningRate(schedule, 2.0, 7, 12), 1.0, 1e-12);
  EXPECT_NEAR(LearningRate(schedule, 2.0, 11, 12), 2.0 * 0.5 * (1 + std::cos(M_PI * 0.9)), 1e-12);
}

TEST(LearningRate, LinearDecaysToZero) {
  ScheduleSpec schedule{ScheduleKind::kLinear, 0};
  EXPECT_DOUBLE_EQ(LearningRate(schedule, 1.0, 0, 4), 1.0);
  EXPECT_DOUBLE_EQ(LearningRate(schedule, 1.0, 1, 4), 0.75);
  EXPECT_DOUBLE_EQ(LearningRate(schedule, 1.0, 3, 4), 0.25);
}

}  // namespace
}  // namespace lathe
