#include "worker/engine/loss_scaler.h"

#include <vector>

#include "gtest/gtest.h"

namespace lathe {
namespace {

TEST(LossScaler, StartsAt2To16AndHalvesAndSkipsOnOverflow) {
  LossScaler scaler(/*enabled=*/true);
  EXPECT_EQ(scaler.scale(), 65536.0);
  EXPECT_FALSE(scaler.Update(/*gradients_finite=*/false));
  EXPECT_EQ(scaler.scale(), 32768.0);
  EXPECT_FALSE(scaler.Update(false));
  EXPECT_EQ(scaler.scale(), 16384.0);
  EXPECT_TRUE(scaler.Update(true));
  EXPECT_EQ(scaler.scale(), 16384.0);
}

TEST(LossScaler, DoublesAfter2000CleanStepsInARow) {
  LossScaler scaler(true);
  for (int i = 0; i < 1999; ++i) ASSERT_TRUE(scaler.Update(true));
  EXPECT_EQ(scaler.scale(), 65536.0);
  EXPECT_TRUE(scaler.Update(true));  // the 2000th clean step
  EXPECT_EQ(scaler.scale(), 131072.0);
  EXPECT_EQ(scaler.state().clean_steps, 0);
}

TEST(LossScaler, AnOverflowRestartsTheCleanCount) {
  LossScalerOptions options;
  options.growth_interval = 3;
  LossScaler scaler(true, options);
  // Scripted sequence of finite (1) and overflowing (0) steps, with the scale after each.
  const std::vector<std::pair<bool, double>> script = {
      {true, 65536}, {true, 65536}, {false, 32768}, {true, 32768},  {true, 32768},
      {true, 65536}, {true, 65536}, {true, 65536},  {true, 131072}, {false, 65536}};
  for (size_t i = 0; i < script.size(); ++i) {
    EXPECT_EQ(scaler.Update(script[i].first), script[i].first) << "step " << i;
    EXPECT_EQ(scaler.scale(), script[i].second) << "step " << i;
  }
}

TEST(LossScaler, NeverFallsBelowTheMinimum) {
  LossScalerOptions options;
  options.initial_scale = 4;
  LossScaler scaler(true, options);
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(scaler.Update(false));
  EXPECT_EQ(scaler.scale(), 1.0);
}

TEST(LossScaler, DisabledKeepsScaleOneButStillSkipsNonFiniteSteps) {
  LossScaler scaler(/*enabled=*/false);
  EXPECT_EQ(scaler.scale(), 1.0);
  EXPECT_FALSE(scaler.Update(false));
  for (int i = 0; i < 2500; ++i) ASSERT_TRUE(scaler.Update(true));
  EXPECT_EQ(scaler.scale(), 1.0);
}

TEST(LossScaler, RestoredStateContinuesTheSameSequence) {
  LossScalerOptions options;
  options.growth_interval = 4;
  LossScaler a(true, options);
  for (bool finite : {true, false, true, true}) a.Update(finite);
  LossScaler b(true, options);
  b.Restore(a.state());
  EXPECT_EQ(b.scale(), 32768.0);
  for (int i = 0; i < 6; ++i) {
    a.Update(true);
    b.Update(true);
    EXPECT_EQ(a.scale(), b.scale());
  }
  // Two clean steps before the restore and two after make four: doubled, then doubled
  // again four steps later.
  EXPECT_EQ(b.scale(), 131072.0);
}

}  // namespace
}  // namespace lathe
