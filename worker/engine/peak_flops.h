// The peak FLOP/s that MFU divides by (common/flops.h), for the device a trainer runs on.
//
// Thread-safety: thread-safe (MeasureCpuMatmulFlops runs libtorch on the calling thread's
// intra-op pool).
#ifndef LATHE_WORKER_ENGINE_PEAK_FLOPS_H_
#define LATHE_WORKER_ENGINE_PEAK_FLOPS_H_

#include "common/job_spec.h"
#include "kernels/ops/torch_compat.h"

namespace lathe {

// `configured` when > 0 (a flag or the task: what the operator knows); on CUDA the data-sheet
// peak of the device for `precision` (0 for a device not in common/flops.h's table); on the
// CPU the measured MeasureCpuMatmulFlops (bfloat16 products for a bf16 job where the CPU
// multiplies them natively, float32 otherwise).
double PeakFlopsFor(const at::Device& device, Precision precision, double configured);

// The best matrix-product rate of this CPU over three 2048 x 2048 x 2048 products (after one
// to warm up) through the engine's own products (kernels/ops/matmul.h, oneDNN) on the
// current intra-op threads (the trainer's), in float32, or with `bf16` bfloat16 x bfloat16
// (what a bf16 job's projections run where the CPU multiplies bf16 natively); no data sheet
// says what the library reaches here. Takes some 0.3 s on a 2-core machine, once per
// process, thread count and type (the result is kept).
double MeasureCpuMatmulFlops(bool bf16 = false);

}  // namespace lathe

#endif  // LATHE_WORKER_ENGINE_PEAK_FLOPS_H_
