/* Calls the real NCCL the way libtorch_cuda.so does: libnccl.so.2 is this library's DT_NEEDED,
 * and Python loads this library with RTLD_LOCAL, so NCCL sits in a local scope, out of the reach
 * of dlsym(RTLD_NEXT) from a preloaded library. One function per case, each returning NCCL's
 * result. Without a GPU, calls that need a device fail with NCCL's own error codes. */
#include <stddef.h>
#include <string.h>
typedef struct { char internal[128]; } ncclUniqueId;
typedef struct ncclComm *ncclComm_t;
typedef void *stream_t;
int ncclGetVersion(int *);
int ncclGroupStart(void);
int ncclGroupEnd(void);
int ncclAllReduce(const void *, void *, size_t, int, int, ncclComm_t, stream_t);
int ncclBroadcast(const void *, void *, size_t, int, int, ncclComm_t, stream_t);
int ncclReduce(const void *, void *, size_t, int, int, int, ncclComm_t, stream_t);
int ncclAllGather(const void *, void *, size_t, int, ncclComm_t, stream_t);
int ncclReduceScatter(const void *, void *, size_t, int, int, ncclComm_t, stream_t);
/* Weak, as code that probes for an optional NCCL feature declares it: null when no library in
 * the process defines it. */
int ncclAlltoAll(const void *, void *, size_t, int, ncclComm_t, stream_t) __attribute__((weak));
int ncclSend(const void *, size_t, int, int, ncclComm_t, stream_t);
int ncclRecv(void *, size_t, int, int, ncclComm_t, stream_t);
int ncclCommInitRank(ncclComm_t *, int, ncclUniqueId, int);
int ncclCommInitRankConfig(ncclComm_t *, int, ncclUniqueId, int, void *);
int ncclCommInitRankScalable(ncclComm_t *, int, int, int, ncclUniqueId *, void *);
int ncclCommSplit(ncclComm_t, int, int, ncclComm_t *, void *);
int ncclCommAbort(ncclComm_t);
int ncclCommDestroy(ncclComm_t);

#define FLOAT32 7
#define SUM 0
static char buf[64];

int version(void) { int v = 0; int rc = ncclGetVersion(&v); return rc ? -rc : v; }
int group_start(void) { return ncclGroupStart(); }
int group_end(void) { return ncclGroupEnd(); }
int all_reduce(void) { return ncclAllReduce(buf, buf, 4, FLOAT32, SUM, NULL, NULL); }
int all_reduce_null_buffer(void) { return ncclAllReduce(NULL, NULL, 4, FLOAT32, SUM, NULL, NULL); }
int all_reduce_bad_type(void) { return ncclAllReduce(buf, buf, 4, 99, SUM, NULL, NULL); }
int broadcast(void) { return ncclBroadcast(buf, buf, 4, FLOAT32, 0, NULL, NULL); }
int reduce(void) { return ncclReduce(buf, buf, 4, FLOAT32, SUM, 0, NULL, NULL); }
int all_gather(void) { return ncclAllGather(buf, buf, 4, FLOAT32, NULL, NULL); }
int reduce_scatter(void) { return ncclReduceScatter(buf, buf, 4, FLOAT32, SUM, NULL, NULL); }
int all_to_all(void) { return ncclAlltoAll ? ncclAlltoAll(buf, buf, 4, FLOAT32, NULL, NULL) : -1; }
int send(void) { return ncclSend(buf, 4, FLOAT32, 0, NULL, NULL); }
int recv(void) { return ncclRecv(buf, 4, FLOAT32, 0, NULL, NULL); }
static ncclUniqueId id(void) { ncclUniqueId u; memset(&u, 7, sizeof u); return u; }
int init_rank(void) { ncclComm_t c = NULL; return ncclCommInitRank(&c, 1, id(), 0); }
int init_rank_no_ranks(void) { ncclComm_t c = NULL; return ncclCommInitRank(&c, 0, id(), 0); }
int init_rank_config(void) { ncclComm_t c = NULL; return ncclCommInitRankConfig(&c, 1, id(), 0, NULL); }
int init_rank_scalable(void) {
    ncclComm_t c = NULL;
    ncclUniqueId u = id();
    return ncclCommInitRankScalable(&c, 1, 0, 1, &u, NULL);
}
int comm_split(void) { ncclComm_t c = NULL; return ncclCommSplit(NULL, 0, 0, &c, NULL); }
int comm_abort(void) { return ncclCommAbort(NULL); }
int comm_destroy(void) { return ncclCommDestroy(NULL); }

/* Eight threads make their first NCCL calls at once (the shim resolves NCCL on first use):
 * returns how many of their 8 x 1000 group pairs did not succeed. */
#include <pthread.h>
static void *group_pairs(void *failed) {
    for (int i = 0; i < 1000; i++)
        if (ncclGroupStart() != 0 || ncclGroupEnd() != 0)
            __atomic_add_fetch((int *)failed, 1, __ATOMIC_RELAXED);
    return NULL;
}
int group_pairs_in_threads(void) {
    pthread_t threads[8];
    int failed = 0;
    for (int i = 0; i < 8; i++) pthread_create(&threads[i], NULL, group_pairs, &failed);
    for (int i = 0; i < 8; i++) pthread_join(threads[i], NULL);
    return failed;
}
