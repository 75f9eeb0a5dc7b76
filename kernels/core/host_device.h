// LOOM_HOST_DEVICE: the mark of a function that the CPU kernels and the CUDA kernels share
// (kernels/core's arithmetic headers): host and device, inlined, under nvcc; plain inline
// in a C++ compiler.
#pragma once

#if defined(__CUDACC__)
#define LOOM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define LOOM_HOST_DEVICE inline
#endif
