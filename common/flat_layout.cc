#include "common/flat_layout.h"

#include <algorithm>

namespace lathe {

int64_t ShardNumel(int64_t numel, int64_t world) { return (numel + world - 1) / world; }

FlatRange OwnedRange(int64_t numel, int64_t rank, int64_t world) {
  const int64_t shard = ShardNumel(numel, world);
  const int64_t begin = std::min(numel, rank * shard);
  return {begin, std::min(numel, begin + shard)};
}

FlatRange Intersect(const FlatRange& a, const FlatRange& b) {
  const int64_t begin = std::max(a.begin, b.begin);
  return {begin, std::max(begin, std::min(a.end, b.end))};
}

void FlatLayout::Add(std::string name, std::vector<int64_t> shape, bool weight_decay) {
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  entries.push_back({std::move(name), std::move(shape), numel, count, weight_decay});
  numel += count;
}

}  // namespace lathe
