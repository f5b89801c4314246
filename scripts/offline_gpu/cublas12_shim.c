/* libcublas.so.12 for a machine that has only CUDA 13's cuBLAS and no network.
 *
 * faiss-gpu-cu12 (the FAISS GPU wheel `scripts/setup.sh` installs next to CUDA 12's pip
 * libraries) links libcublas.so.12 / libcublasLt.so.12. The lent GPU machines carry CUDA 13
 * only, and CUDA 12's cuBLAS is several hundred MB, more than a device call may carry. The
 * eight cuBLAS entry points FAISS calls (`objdump -T libfaiss*.so | grep libcublas`) have the
 * same C signatures and enum values in cuBLAS 12 and 13, so this library, named
 * libcublas.so.12 with that symbol version, forwards each to libcublas.so.13.
 * A benchmark harness for that one machine, not part of ance-train: users get the real
 * CUDA 12 libraries from pip. Built by scripts/offline_gpu/pack_checks.sh:
 *
 *   gcc -shared -fPIC -O2 -Wl,-soname,libcublas.so.12 \
 *       -Wl,--version-script=cublas12_shim.map cublas12_shim.c -ldl -o libcublas.so.12
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

typedef int status_t;  /* cublasStatus_t */
typedef void *handle_t; /* cublasHandle_t */

static void *real(const char *name) {
  static void *lib;
  if (!lib) lib = dlopen("libcublas.so.13", RTLD_NOW | RTLD_GLOBAL);
  void *fn = lib ? dlsym(lib, name) : NULL;
  if (!fn) {
    fprintf(stderr, "cublas12_shim: %s not found in libcublas.so.13 (%s)\n", name, dlerror());
    abort();
  }
  return fn;
}

#define FORWARD(name, params, args)                               \
  status_t name params {                                          \
    static status_t(*fn) params;                                  \
    if (!fn) fn = (status_t(*) params)real(#name);                \
    return fn args;                                               \
  }

FORWARD(cublasCreate_v2, (handle_t *h), (h))
FORWARD(cublasDestroy_v2, (handle_t h), (h))
FORWARD(cublasSetStream_v2, (handle_t h, void *stream), (h, stream))
FORWARD(cublasGetMathMode, (handle_t h, int *mode), (h, mode))
FORWARD(cublasSetMathMode, (handle_t h, int mode), (h, mode))
FORWARD(cublasSgemmEx,
        (handle_t h, int ta, int tb, int m, int n, int k, const float *alpha, const void *A,
         int at, int lda, const void *B, int bt, int ldb, const float *beta, void *C, int ct,
         int ldc),
        (h, ta, tb, m, n, k, alpha, A, at, lda, B, bt, ldb, beta, C, ct, ldc))
FORWARD(cublasGemmEx,
        (handle_t h, int ta, int tb, int m, int n, int k, const void *alpha, const void *A,
         int at, int lda, const void *B, int bt, int ldb, const void *beta, void *C, int ct,
         int ldc, int compute, int algo),
        (h, ta, tb, m, n, k, alpha, A, at, lda, B, bt, ldb, beta, C, ct, ldc, compute, algo))
FORWARD(cublasGemmStridedBatchedEx,
        (handle_t h, int ta, int tb, int m, int n, int k, const void *alpha, const void *A,
         int at, int lda, long long sa, const void *B, int bt, int ldb, long long sb,
         const void *beta, void *C, int ct, int ldc, long long sc, int batches, int compute,
         int algo),
        (h, ta, tb, m, n, k, alpha, A, at, lda, sa, B, bt, ldb, sb, beta, C, ct, ldc, sc,
         batches, compute, algo))
