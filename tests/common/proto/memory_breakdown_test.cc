// The memory components' names (common/memory_components.h) and their MemoryBreakdown fields
// (common/proto/memory_breakdown.h).
#include "common/proto/memory_breakdown.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "common/memory_components.h"

namespace lathe {
namespace {

using C = MemoryComponent;

TEST(MemoryComponentTest, NamesMatchDesignInBreakdownOrder) {
  const std::vector<std::pair<C, absl::string_view>> expected = {
      {C::kWeights, "weights"},          {C::kTrainable, "trainable"},
      {C::kGradients, "gradients"},      {C::kOptimizer, "optimizer"},
      {C::kActivations, "activations"},  {C::kLogits, "logits"},
      {C::kCommBuffers, "comm_buffers"}, {C::kOverhead, "overhead"},
  };
  ASSERT_EQ(expected.size(), kMemoryComponents.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(kMemoryComponents[i], expected[i].first);
    EXPECT_EQ(MemoryComponentName(expected[i].first), expected[i].second);
    // The proto field of the same name is the (i+1)-th: the order is the proto's.
    const auto* field =
        v1::MemoryBreakdown::descriptor()->FindFieldByNumber(static_cast<int>(i) + 1);
    ASSERT_NE(field, nullptr);
    EXPECT_EQ(field->name(), std::string(expected[i].second));
  }
}

TEST(MemoryBreakdownTest, EachComponentHasItsOwnField) {
  v1::MemoryBreakdown memory;
  for (size_t i = 0; i < kMemoryComponents.size(); ++i) {
    SetComponentBytes(&memory, kMemoryComponents[i], 1000 + i);
  }
  for (size_t i = 0; i < kMemoryComponents.size(); ++i) {
    EXPECT_EQ(ComponentBytes(memory, kMemoryComponents[i]), 1000 + i);
  }
  EXPECT_EQ(memory.weights(), 1000u);
  EXPECT_EQ(memory.overhead(), 1007u);
  EXPECT_EQ(memory.total(), 0u);
}

}  // namespace
}  // namespace lathe
