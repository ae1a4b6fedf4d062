/*
 * The self-check: elasticft_shim_probe() reports what the shim found (whether it records and why
 * not, which library defines NCCL and its version, the entry points that NCCL lacks, the CUDA
 * runtime used for timing), for the worker's self-check (elasticft/diag/shimcheck.py).
 */
#include "shim.h"

#include <dlfcn.h>
#include <stdio.h>

/* ======================================================================================== */
/* The self-check                                                                           */
/* ======================================================================================== */

static const char *const k_exported[] = {
    "ncclAllReduce", "ncclBroadcast", "ncclReduce", "ncclAllGather", "ncclReduceScatter",
    "ncclAlltoAll", "ncclSend", "ncclRecv", "ncclGroupStart", "ncclGroupEnd",
    "ncclCommInitRank", "ncclCommInitRankConfig", "ncclCommInitRankScalable", "ncclCommSplit",
    "ncclCommAbort", "ncclCommDestroy",
};

static size_t json_string(char *out, size_t n, const char *s) {
    size_t w = 0;
    if (w < n) out[w++] = '"';
    for (; s && *s && w + 2 < n; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') { out[w++] = '\\'; out[w++] = (char)c; }
        else if (c >= 0x20) out[w++] = (char)c;
    }
    if (w < n) out[w++] = '"';
    if (w < n) out[w] = 0;
    return w;
}

#define APPEND(...) do {                                                        \
        int k_ = snprintf(out + w, w < n ? n - w : 0, __VA_ARGS__);            \
        if (k_ > 0) w += (size_t)k_;                                            \
    } while (0)
#define APPEND_STR(s) do { if (w < n) w += json_string(out + w, n - w, (s)); } while (0)

/* Writes a JSON object describing the shim into out: whether it records, why not, which
 * library defines NCCL and its version, the exported entry points NCCL lacks, and the CUDA
 * runtime used for timing. Returns the NCCL version code, or 0 when no NCCL is loaded. */
EXPORT int elasticft_shim_probe(char *out, size_t n) {
    size_t w = 0;
    int recording = enabled();
    typedef ncclResult_t (*version_fn)(int *);
    static real_t version_slot = {"ncclGetVersion", NULL, 1};
    version_fn get_version = (version_fn)resolve(&version_slot);
    int version = 0;
    if (get_version && get_version(&version) != ncclSuccess) version = 0;
    Dl_info info;
    const char *library = get_version && dladdr((void *)get_version, &info) ? info.dli_fname : "";
    APPEND("{\"recording\":%d,\"reason\":", recording);
    APPEND_STR(recording ? "" : g_init_error);
    APPEND(",\"version\":%d,\"library\":", version);
    APPEND_STR(library);
    APPEND(",\"missing\":[");
    int first = 1;
    for (size_t i = 0; get_version && i < sizeof k_exported / sizeof *k_exported; i++) {
        if (find_real(k_exported[i])) continue;
        if (!first) APPEND(",");
        APPEND_STR(k_exported[i]);
        first = 0;
    }
    int timed = recording && cuda_usable();
    APPEND("],\"cuda_events\":%d,\"cudart\":", timed);
    APPEND_STR(timed ? cuda_library() : "");
    APPEND("}");
    if (n) out[w < n ? w : n - 1] = 0;
    return version;
}

/* How many calls the shim has recorded so far in this process (its record counter). The worker
 * reads it around the collectives torch issues on NCCL process groups: NCCL found by the probe
 * does not prove that torch's calls reach the shim (an NCCL linked into libtorch_cuda.so calls
 * itself without the dynamic linker), a counter that moves does (shimcheck.interception). */
EXPORT uint64_t elasticft_shim_records(void) {
    return __atomic_load_n(&g_seq, __ATOMIC_RELAXED);
}
