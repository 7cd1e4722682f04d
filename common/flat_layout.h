// How a unit's tensors are laid out in one flat buffer and split across ranks
// (docs/sharding.md): used by the engine's ZeRO layer (worker/shard) and by the planner
// (planner/model_states.h), so that both slice alike.
//
// A unit's tensors of one kind (frozen or trainable) are concatenated, in the model's fixed
// order, into a flat buffer of `numel` elements. The buffer is padded to world * shard_numel
// elements, shard_numel = ceil(numel / world), and rank r owns the contiguous slice
// [r * shard_numel, (r + 1) * shard_numel); the padding (at most world - 1 elements, all in
// the last ranks' slices) is never read as a tensor and stays zero.
//
// Thread-safety: value types and pure functions.
#ifndef LATHE_COMMON_FLAT_LAYOUT_H_
#define LATHE_COMMON_FLAT_LAYOUT_H_

#include <cstdint>
#include <string>
#include <vector>

namespace lathe {

// Elements each of `world` ranks holds of a flat buffer of `numel`: ceil(numel / world).
int64_t ShardNumel(int64_t numel, int64_t world);

// A half-open range of flat indices.
struct FlatRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};

// The logical (unpadded) part of the buffer that `rank` owns: [rank * S, min(numel, (rank + 1)
// * S)), empty when the rank's slice is all padding.
FlatRange OwnedRange(int64_t numel, int64_t rank, int64_t world);

// The overlap of two ranges (empty, begin == end, when they do not meet).
FlatRange Intersect(const FlatRange& a, const FlatRange& b);

// One tensor's place in a flat buffer.
struct FlatEntry {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // first element in the flat buffer
  int64_t numel = 0;
  bool weight_decay = true;
  FlatRange range() const { return {offset, offset + numel}; }
};

// The tensors of one kind of one unit, in order.
struct FlatLayout {
  std::vector<FlatEntry> entries;
  int64_t numel = 0;  // sum of the entries' numel

  // Appends a tensor of `shape` at the end of the buffer.
  void Add(std::string name, std::vector<int64_t> shape, bool weight_decay);
};

}  // namespace lathe

#endif  // LATHE_COMMON_FLAT_LAYOUT_H_
