/* NCCL linked into another library, as a torch built with a static NCCL has it inside
 * libtorch_cuda.so. Linked with -Bsymbolic, the library's own code calls NCCL without the dynamic
 * linker: the probe finds NCCL here, yet a preloaded shim never sees these calls. */
#include <stddef.h>

int ncclGetVersion(int *version) {
    *version = 23007;
    return 0;
}

int ncclAllReduce(const void *s, void *r, size_t count, int type, int op, void *comm,
                  void *stream) {
    (void)s; (void)r; (void)count; (void)type; (void)op; (void)comm; (void)stream;
    return 0;
}

/* The framework's collective: calls the NCCL inside this library. */
int framework_all_reduce(void) { return ncclAllReduce(NULL, NULL, 1, 0, 0, NULL, NULL); }
