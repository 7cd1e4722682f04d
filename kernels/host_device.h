// Inlining macros of the raw-pointer kernels.
//
// LATHE_KERNEL_INLINE marks the small helpers that the CPU kernels' loops call (conversions,
// exp, selects). They must be inlined even into the AVX2 clones of LATHE_CPU_DISPATCH
// kernels (kernels/cpu/vector_math.h): GCC does not inline a function compiled for another
// target unless told to, and a call per element stops the vectoriser.
//
// LATHE_HOST_DEVICE marks inline helpers that both the CPU kernels (C++ compiler) and the CUDA
// kernels (nvcc) call.
#ifndef LATHE_KERNELS_HOST_DEVICE_H_
#define LATHE_KERNELS_HOST_DEVICE_H_

#if defined(__GNUC__) || defined(__clang__)
#define LATHE_KERNEL_INLINE __attribute__((always_inline)) inline
#else
#define LATHE_KERNEL_INLINE inline
#endif

#if defined(__CUDACC__)
#define LATHE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define LATHE_HOST_DEVICE LATHE_KERNEL_INLINE
#endif

#endif  // LATHE_KERNELS_HOST_DEVICE_H_
