// LATHE_HOST_DEVICE marks inline functions that both the CPU kernels (compiled by the C++
// compiler) and the CUDA kernels (compiled by nvcc) call.
#ifndef LATHE_KERNELS_HOST_DEVICE_H_
#define LATHE_KERNELS_HOST_DEVICE_H_

#if defined(__CUDACC__)
#define LATHE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define LATHE_HOST_DEVICE inline
#endif

#endif  // LATHE_KERNELS_HOST_DEVICE_H_
