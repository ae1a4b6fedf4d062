/*
 * elasticft NCCL shim: times every NCCL call of a worker, for the agent's hang and slow-rank
 * detectors. Loaded with LD_PRELOAD; it defines the NCCL entry points, forwards each call to the
 * real NCCL (found lazily with dlsym(RTLD_NEXT)) and always returns NCCL's own result.
 *
 * Per call it publishes a record (seq, op, bytes, communicator key, per-communicator seq,
 * enqueue time) into this rank's ring in shared memory (layout in elasticft/diag/ring.py).
 * Completion comes from a pair of CUDA events recorded around the call on its stream and polled
 * by a background thread. libcudart is resolved at run time with dlopen (the copy the process
 * already loaded when there is one), so the shim has no link-time CUDA dependency; without it,
 * completion is the time the call returned on the host (flag FLAG_HOST_COMPLETION).
 *
 * Rules: a recorder failure never reaches NCCL, never blocks a call for long (one uncontended
 * mutex around the pending list), and when ELASTICFT_DIAG_SHIM is not "1" or the ring cannot be
 * opened every entry point is a tail call to the real function.
 *
 * Environment: ELASTICFT_DIAG_SHIM=1 enables it; ELASTICFT_DIAG_RING_DIR holds the rings;
 * RANK names the ring (rank-<RANK>.nccl.ring); ELASTICFT_DIAG_CUDART overrides the libcudart path.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))
#define LIKELY(x) __builtin_expect(!!(x), 1)

/* ---- NCCL types, as far as the shim needs them (ABI-compatible with nccl.h) ---- */
typedef int ncclResult_t;
typedef struct ncclComm *ncclComm_t;
typedef int ncclDataType_t;
typedef int ncclRedOp_t;
typedef struct { char internal[128]; } ncclUniqueId;
typedef struct ncclConfig ncclConfig_t;
typedef void *cudaStream_t;
typedef void *cudaEvent_t;
enum { ncclSuccess = 0, ncclInternalError = 3 };

/* ---- ring layout: keep in step with elasticft/diag/ring.py ---- */
#define RING_MAGIC 0x52544645u
#define RING_VERSION 1u
#define HEADER_SIZE 128
#define DEFAULT_CAPACITY 4096u
#define FLAG_TIMED 1u
#define FLAG_HOST_COMPLETION 2u

typedef struct {
    uint32_t magic, version, capacity, record_size;
    int32_t pid, rank;
    uint64_t head, heartbeat_ns, flags, step, step_ns;
    char source[16];
} ring_header_t;

typedef struct {
    uint64_t seq, comm, bytes, enqueue_ns, complete_ns;
    double value;
    uint32_t op;
    int32_t peer;
    uint32_t flags, comm_seq;
} ring_record_t;

_Static_assert(sizeof(ring_header_t) == 80, "header layout");
_Static_assert(sizeof(ring_record_t) == 64, "record layout");

enum {
    OP_ALL_REDUCE = 1, OP_BROADCAST = 2, OP_REDUCE = 3, OP_ALL_GATHER = 4,
    OP_REDUCE_SCATTER = 5, OP_ALL_TO_ALL = 6, OP_SEND = 7, OP_RECV = 8,
    OP_COMM_INIT = 10, OP_COMM_ABORT = 11, OP_COMM_DESTROY = 12,
};

/* ---- state ---- */
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static volatile int g_enabled;           /* 1 only after a successful init */
static ring_header_t *g_header;
static ring_record_t *g_records;
static uint32_t g_capacity;
static uint64_t g_seq;                   /* atomically incremented */

/* Communicator table: pointer -> key shared by all members, and a per-communicator counter. */
#define MAX_COMMS 256
typedef struct { ncclComm_t comm; uint64_t key; uint32_t seq; } comm_entry_t;
static comm_entry_t g_comms[MAX_COMMS];
static pthread_mutex_t g_comm_lock = PTHREAD_MUTEX_INITIALIZER;

/* CUDA runtime, resolved at the first timed call. */
typedef int (*event_create_fn)(cudaEvent_t *, unsigned int);
typedef int (*event_record_fn)(cudaEvent_t, cudaStream_t);
typedef int (*event_query_fn)(cudaEvent_t);
typedef int (*event_destroy_fn)(cudaEvent_t);
typedef int (*event_elapsed_fn)(float *, cudaEvent_t, cudaEvent_t);
typedef int (*stream_capturing_fn)(cudaStream_t, int *);
static struct {
    int state; /* 0 unresolved, 1 usable, -1 not available */
    event_create_fn create;
    event_record_fn record;
    event_query_fn query;
    event_destroy_fn destroy;
    event_elapsed_fn elapsed;
    stream_capturing_fn capturing;
} g_cuda;
static pthread_mutex_t g_cuda_lock = PTHREAD_MUTEX_INITIALIZER;

/* Records waiting for their end event, polled by the background thread. */
#define MAX_PENDING 4096
typedef struct { uint64_t seq; cudaEvent_t start, end; } pending_t;
static pending_t g_pending[MAX_PENDING];
static int g_npending;
static pthread_mutex_t g_pending_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_poller_started;

/* Calls made between ncclGroupStart and ncclGroupEnd are launched at the outermost GroupEnd. */
#define MAX_DEFERRED 256
static __thread int t_group_depth;
static __thread int t_ndeferred;
static __thread struct { uint64_t seq; cudaStream_t stream; cudaEvent_t start; } t_deferred[MAX_DEFERRED];

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void disable_in_child(void) { g_enabled = 0; }

static void shim_init(void) {
    const char *on = getenv("ELASTICFT_DIAG_SHIM");
    const char *dir = getenv("ELASTICFT_DIAG_RING_DIR");
    const char *rank = getenv("RANK");
    if (!on || strcmp(on, "1") != 0 || !dir || !*dir) return;
    char path[4096];
    if (snprintf(path, sizeof path, "%s/rank-%s.nccl.ring", dir, rank && *rank ? rank : "0") >=
        (int)sizeof path)
        return;
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) return;
    struct stat st;
    size_t size = 0;
    if (fstat(fd, &st) == 0) size = (size_t)st.st_size;
    if (size < HEADER_SIZE + sizeof(ring_record_t)) {
        size = HEADER_SIZE + (size_t)DEFAULT_CAPACITY * sizeof(ring_record_t);
        if (ftruncate(fd, (off_t)size) != 0) { close(fd); return; }
    }
    void *map = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (map == MAP_FAILED) return;
    ring_header_t *h = (ring_header_t *)map;
    uint32_t capacity = (uint32_t)((size - HEADER_SIZE) / sizeof(ring_record_t));
    if (h->magic == RING_MAGIC && h->record_size == sizeof(ring_record_t) && h->capacity &&
        h->capacity <= capacity)
        capacity = h->capacity;
    h->capacity = capacity;
    h->record_size = sizeof(ring_record_t);
    h->version = RING_VERSION;
    h->pid = (int32_t)getpid();
    h->rank = rank ? atoi(rank) : 0;
    h->head = 0;
    h->flags = 0;
    memset(h->source, 0, sizeof h->source);
    memcpy(h->source, "nccl", 4);
    __atomic_store_n(&h->magic, RING_MAGIC, __ATOMIC_RELEASE);
    g_header = h;
    g_records = (ring_record_t *)((char *)map + HEADER_SIZE);
    g_capacity = capacity;
    pthread_atfork(NULL, NULL, disable_in_child);
    g_enabled = 1;
}

static inline int enabled(void) {
    if (LIKELY(g_enabled)) return 1;
    pthread_once(&g_once, shim_init);
    return g_enabled;
}

static void *real_symbol(const char *name) {
    void *fn = dlsym(RTLD_NEXT, name);
    return fn;
}

/* ---- CUDA runtime ---- */
static void resolve_cuda(void) {
    pthread_mutex_lock(&g_cuda_lock);
    if (g_cuda.state != 0) { pthread_mutex_unlock(&g_cuda_lock); return; }
    void *lib = NULL;
    const char *override = getenv("ELASTICFT_DIAG_CUDART");
    static const char *names[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0",
                                  "libcudart.so"};
    if (override && *override) {
        /* An explicit choice is final: no search behind the user's back. */
        lib = dlopen(override, RTLD_NOW | RTLD_LOCAL);
    } else {
        /* Prefer the runtime the process already uses, then load one. */
        for (size_t i = 0; !lib && i < sizeof names / sizeof *names; i++)
            lib = dlopen(names[i], RTLD_NOW | RTLD_NOLOAD);
        for (size_t i = 0; !lib && i < sizeof names / sizeof *names; i++)
            lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    }
    if (lib) {
        g_cuda.create = (event_create_fn)dlsym(lib, "cudaEventCreateWithFlags");
        g_cuda.record = (event_record_fn)dlsym(lib, "cudaEventRecord");
        g_cuda.query = (event_query_fn)dlsym(lib, "cudaEventQuery");
        g_cuda.destroy = (event_destroy_fn)dlsym(lib, "cudaEventDestroy");
        g_cuda.elapsed = (event_elapsed_fn)dlsym(lib, "cudaEventElapsedTime");
        g_cuda.capturing = (stream_capturing_fn)dlsym(lib, "cudaStreamIsCapturing");
    }
    int usable = lib && g_cuda.create && g_cuda.record && g_cuda.query && g_cuda.destroy &&
                 g_cuda.elapsed;
    __atomic_store_n(&g_cuda.state, usable ? 1 : -1, __ATOMIC_RELEASE);
    if (usable) __atomic_or_fetch(&g_header->flags, 1ull, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&g_cuda_lock);
}

static int cuda_usable(void) {
    int state = __atomic_load_n(&g_cuda.state, __ATOMIC_ACQUIRE);
    if (state == 0) {
        resolve_cuda();
        state = __atomic_load_n(&g_cuda.state, __ATOMIC_ACQUIRE);
    }
    return state == 1;
}

static ring_record_t *slot_of(uint64_t seq) { return &g_records[(seq - 1) % g_capacity]; }

static void complete(uint64_t seq, uint64_t t, double gpu_ms, uint32_t extra_flags) {
    ring_record_t *r = slot_of(seq);
    if (__atomic_load_n(&r->seq, __ATOMIC_ACQUIRE) != seq) return; /* overwritten after a wrap */
    if (gpu_ms >= 0) r->value = gpu_ms;
    if (extra_flags) __atomic_or_fetch(&r->flags, extra_flags, __ATOMIC_RELAXED);
    __atomic_store_n(&r->complete_ns, t ? t : 1, __ATOMIC_RELEASE);
}

static void *poller(void *arg) {
    (void)arg;
    pending_t done[64];
    for (;;) {
        int ndone = 0, left;
        pthread_mutex_lock(&g_pending_lock);
        for (int i = 0; i < g_npending && ndone < 64;) {
            int rc = g_cuda.query(g_pending[i].end);
            if (rc == 600 /* cudaErrorNotReady */) { i++; continue; }
            done[ndone] = g_pending[i];
            if (rc != 0) done[ndone].seq |= 1ull << 63; /* an error: no GPU time */
            ndone++;
            g_pending[i] = g_pending[--g_npending];
        }
        left = g_npending;
        pthread_mutex_unlock(&g_pending_lock);
        uint64_t t = now_ns();
        for (int i = 0; i < ndone; i++) {
            uint64_t seq = done[i].seq & ~(1ull << 63);
            float ms = -1.0f;
            if (!(done[i].seq >> 63) && g_cuda.elapsed(&ms, done[i].start, done[i].end) != 0)
                ms = -1.0f;
            complete(seq, t, ms, 0);
            g_cuda.destroy(done[i].start);
            g_cuda.destroy(done[i].end);
        }
        __atomic_store_n(&g_header->heartbeat_ns, t, __ATOMIC_RELAXED);
        usleep(left ? 200 : 2000);
    }
    return NULL;
}

static void start_poller(void) {
    pthread_mutex_lock(&g_pending_lock);
    if (!g_poller_started) {
        pthread_t tid;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&tid, &attr, poller, NULL) == 0) g_poller_started = 1;
        else g_poller_started = -1;
        pthread_attr_destroy(&attr);
    }
    pthread_mutex_unlock(&g_pending_lock);
}

static int add_pending(uint64_t seq, cudaEvent_t start, cudaEvent_t end) {
    if (!g_poller_started) start_poller();
    if (g_poller_started < 0) return 0;
    int ok = 0;
    pthread_mutex_lock(&g_pending_lock);
    if (g_npending < MAX_PENDING && g_cuda.query) {
        g_pending[g_npending++] = (pending_t){seq, start, end};
        ok = 1;
    }
    pthread_mutex_unlock(&g_pending_lock);
    return ok;
}

/* ---- communicators ---- */
static uint64_t hash_bytes(const void *data, size_t n) {
    const unsigned char *p = data;
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) { h ^= p[i]; h *= 1099511628211ull; }
    return h ? h : 1;
}

static void remember_comm(ncclComm_t comm, uint64_t key) {
    pthread_mutex_lock(&g_comm_lock);
    int free_slot = -1;
    for (int i = 0; i < MAX_COMMS; i++) {
        if (g_comms[i].comm == comm) { free_slot = i; break; }
        if (free_slot < 0 && g_comms[i].comm == NULL) free_slot = i;
    }
    if (free_slot >= 0) g_comms[free_slot] = (comm_entry_t){comm, key, 0};
    pthread_mutex_unlock(&g_comm_lock);
}

static void forget_comm(ncclComm_t comm) {
    pthread_mutex_lock(&g_comm_lock);
    for (int i = 0; i < MAX_COMMS; i++)
        if (g_comms[i].comm == comm) g_comms[i] = (comm_entry_t){NULL, 0, 0};
    pthread_mutex_unlock(&g_comm_lock);
}

/* The communicator's key and the call's number within it. Unknown communicators (created before
 * the shim saw them) are keyed by their address, which is only meaningful on this rank. */
static uint64_t comm_next(ncclComm_t comm, uint32_t *comm_seq) {
    uint64_t key = (uint64_t)(uintptr_t)comm;
    pthread_mutex_lock(&g_comm_lock);
    for (int i = 0; i < MAX_COMMS; i++) {
        if (g_comms[i].comm == comm) {
            key = g_comms[i].key;
            *comm_seq = ++g_comms[i].seq;
            pthread_mutex_unlock(&g_comm_lock);
            return key;
        }
    }
    pthread_mutex_unlock(&g_comm_lock);
    *comm_seq = 0;
    return key;
}

/* ---- records ---- */
static size_t type_size(ncclDataType_t t) {
    static const unsigned char sizes[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1};
    return (t >= 0 && (size_t)t < sizeof sizes) ? sizes[t] : 1;
}

static uint64_t publish(uint32_t op, uint64_t key, uint32_t comm_seq, uint64_t bytes, int peer) {
    uint64_t seq = __atomic_add_fetch(&g_seq, 1, __ATOMIC_RELAXED);
    ring_record_t *r = slot_of(seq);
    __atomic_store_n(&r->seq, 0, __ATOMIC_RELEASE);
    r->comm = key;
    r->bytes = bytes;
    r->enqueue_ns = now_ns();
    r->complete_ns = 0;
    r->value = 0;
    r->op = op;
    r->peer = peer;
    r->flags = 0;
    r->comm_seq = comm_seq;
    __atomic_store_n(&r->seq, seq, __ATOMIC_RELEASE);
    uint64_t head = __atomic_load_n(&g_header->head, __ATOMIC_RELAXED);
    while (head < seq && !__atomic_compare_exchange_n(&g_header->head, &head, seq, 1,
                                                      __ATOMIC_RELEASE, __ATOMIC_RELAXED)) {
    }
    return seq;
}

/* Starts timing a call on its stream; returns the start event (NULL: not timed). */
static cudaEvent_t begin_timing(cudaStream_t stream) {
    if (!cuda_usable()) return NULL;
    if (g_cuda.capturing) {
        int status = 0;
        if (g_cuda.capturing(stream, &status) != 0 || status != 0) return NULL;
    }
    cudaEvent_t start = NULL;
    if (g_cuda.create(&start, 0 /* cudaEventDefault: timed */) != 0) return NULL;
    if (g_cuda.record(start, stream) != 0) { g_cuda.destroy(start); return NULL; }
    return start;
}

static void end_timing(uint64_t seq, cudaStream_t stream, cudaEvent_t start) {
    cudaEvent_t end = NULL;
    if (g_cuda.create(&end, 0) == 0 && g_cuda.record(end, stream) == 0 &&
        add_pending(seq, start, end)) {
        __atomic_or_fetch(&slot_of(seq)->flags, FLAG_TIMED, __ATOMIC_RELAXED);
        return;
    }
    if (end) g_cuda.destroy(end);
    g_cuda.destroy(start);
    complete(seq, now_ns(), -1, FLAG_HOST_COMPLETION);
}

static void finish_call(uint64_t seq, ncclResult_t rc, cudaStream_t stream, cudaEvent_t start) {
    ring_record_t *r = slot_of(seq);
    if (rc != ncclSuccess && __atomic_load_n(&r->seq, __ATOMIC_ACQUIRE) == seq)
        __atomic_or_fetch(&r->flags, ((uint32_t)rc & 0xffu) << 8, __ATOMIC_RELAXED);
    if (rc != ncclSuccess || !start) {
        if (start) g_cuda.destroy(start);
        complete(seq, now_ns(), -1, FLAG_HOST_COMPLETION);
        return;
    }
    end_timing(seq, stream, start);
}

/* Inside a group nothing is launched yet: the call is timed at the outermost ncclGroupEnd. */
static void defer_in_group(uint64_t seq, ncclResult_t rc, cudaStream_t stream) {
    if (rc == ncclSuccess && t_ndeferred < MAX_DEFERRED && cuda_usable()) {
        t_deferred[t_ndeferred].seq = seq;
        t_deferred[t_ndeferred].stream = stream;
        t_deferred[t_ndeferred].start = NULL;
        t_ndeferred++;
        return;
    }
    finish_call(seq, rc, stream, NULL);
}

/* ---- interposed entry points ---- */
#define REAL(name, type)                                                        \
    static type real_##name;                                                    \
    if (!real_##name) real_##name = (type)real_symbol(#name);                   \
    if (!real_##name) return ncclInternalError

#define COLLECTIVE_BODY(name, type, op, comm, bytes, peer, stream, ...)         \
    REAL(name, type);                                                           \
    if (!enabled()) return real_##name(__VA_ARGS__);                            \
    uint32_t comm_seq_ = 0;                                                     \
    uint64_t key_ = comm_next(comm, &comm_seq_);                                \
    uint64_t seq_ = publish(op, key_, comm_seq_, bytes, peer);                  \
    if (t_group_depth > 0) {                                                    \
        ncclResult_t grc_ = real_##name(__VA_ARGS__);                           \
        defer_in_group(seq_, grc_, stream);                                     \
        return grc_;                                                            \
    }                                                                           \
    cudaEvent_t start_ = begin_timing(stream);                                  \
    ncclResult_t rc_ = real_##name(__VA_ARGS__);                                \
    finish_call(seq_, rc_, stream, start_);                                     \
    return rc_

typedef ncclResult_t (*allreduce_fn)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t,
                                     ncclComm_t, cudaStream_t);
EXPORT ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                                  ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                  cudaStream_t stream) {
    COLLECTIVE_BODY(ncclAllReduce, allreduce_fn, OP_ALL_REDUCE, comm, count * type_size(datatype),
                    -1, stream, sendbuff, recvbuff, count, datatype, op, comm, stream);
}

typedef ncclResult_t (*broadcast_fn)(const void *, void *, size_t, ncclDataType_t, int,
                                     ncclComm_t, cudaStream_t);
EXPORT ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
                                  ncclDataType_t datatype, int root, ncclComm_t comm,
                                  cudaStream_t stream) {
    COLLECTIVE_BODY(ncclBroadcast, broadcast_fn, OP_BROADCAST, comm, count * type_size(datatype),
                    root, stream, sendbuff, recvbuff, count, datatype, root, comm, stream);
}

typedef ncclResult_t (*reduce_fn)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, int,
                                  ncclComm_t, cudaStream_t);
EXPORT ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count,
                               ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm,
                               cudaStream_t stream) {
    COLLECTIVE_BODY(ncclReduce, reduce_fn, OP_REDUCE, comm, count * type_size(datatype), root,
                    stream, sendbuff, recvbuff, count, datatype, op, root, comm, stream);
}

typedef ncclResult_t (*allgather_fn)(const void *, void *, size_t, ncclDataType_t, ncclComm_t,
                                     cudaStream_t);
EXPORT ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                                  ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
    COLLECTIVE_BODY(ncclAllGather, allgather_fn, OP_ALL_GATHER, comm,
                    sendcount * type_size(datatype), -1, stream, sendbuff, recvbuff, sendcount,
                    datatype, comm, stream);
}

typedef ncclResult_t (*reducescatter_fn)(const void *, void *, size_t, ncclDataType_t,
                                         ncclRedOp_t, ncclComm_t, cudaStream_t);
EXPORT ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                                      ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                      cudaStream_t stream) {
    COLLECTIVE_BODY(ncclReduceScatter, reducescatter_fn, OP_REDUCE_SCATTER, comm,
                    recvcount * type_size(datatype), -1, stream, sendbuff, recvbuff, recvcount,
                    datatype, op, comm, stream);
}

/* ncclAlltoAll exists only in recent NCCL; forwarding fails cleanly when it does not. */
typedef ncclResult_t (*alltoall_fn)(const void *, void *, size_t, ncclDataType_t, ncclComm_t,
                                    cudaStream_t);
EXPORT ncclResult_t ncclAlltoAll(const void *sendbuff, void *recvbuff, size_t count,
                                 ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
    COLLECTIVE_BODY(ncclAlltoAll, alltoall_fn, OP_ALL_TO_ALL, comm, count * type_size(datatype),
                    -1, stream, sendbuff, recvbuff, count, datatype, comm, stream);
}

typedef ncclResult_t (*send_fn)(const void *, size_t, ncclDataType_t, int, ncclComm_t,
                                cudaStream_t);
EXPORT ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype,
                             int peer, ncclComm_t comm, cudaStream_t stream) {
    COLLECTIVE_BODY(ncclSend, send_fn, OP_SEND, comm, count * type_size(datatype), peer, stream,
                    sendbuff, count, datatype, peer, comm, stream);
}

typedef ncclResult_t (*recv_fn)(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
EXPORT ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
                             ncclComm_t comm, cudaStream_t stream) {
    COLLECTIVE_BODY(ncclRecv, recv_fn, OP_RECV, comm, count * type_size(datatype), peer, stream,
                    recvbuff, count, datatype, peer, comm, stream);
}

typedef ncclResult_t (*void_fn)(void);
EXPORT ncclResult_t ncclGroupStart(void) {
    REAL(ncclGroupStart, void_fn);
    if (!enabled()) return real_ncclGroupStart();
    ncclResult_t rc = real_ncclGroupStart();
    if (rc == ncclSuccess) t_group_depth++;
    return rc;
}

EXPORT ncclResult_t ncclGroupEnd(void) {
    REAL(ncclGroupEnd, void_fn);
    if (!enabled() || t_group_depth == 0) return real_ncclGroupEnd();
    int outermost = t_group_depth == 1;
    int n = outermost ? t_ndeferred : 0;
    /* Start events go on the streams before the group's kernels are launched. */
    for (int i = 0; i < n; i++) {
        cudaEvent_t start = NULL;
        if (g_cuda.create(&start, 0) == 0 && g_cuda.record(start, t_deferred[i].stream) != 0) {
            g_cuda.destroy(start);
            start = NULL;
        }
        t_deferred[i].start = start;
    }
    ncclResult_t rc = real_ncclGroupEnd();
    t_group_depth--;
    if (!outermost) return rc;
    t_ndeferred = 0;
    for (int i = 0; i < n; i++) {
        if (rc != ncclSuccess && rc != 7 /* ncclInProgress */) {
            if (t_deferred[i].start) g_cuda.destroy(t_deferred[i].start);
            complete(t_deferred[i].seq, now_ns(), -1, FLAG_HOST_COMPLETION);
        } else if (t_deferred[i].start) {
            end_timing(t_deferred[i].seq, t_deferred[i].stream, t_deferred[i].start);
        } else {
            complete(t_deferred[i].seq, now_ns(), -1, FLAG_HOST_COMPLETION);
        }
    }
    return rc;
}

static ncclResult_t init_done(uint64_t seq, ncclResult_t rc, ncclComm_t *comm, uint64_t key) {
    if (rc == ncclSuccess && comm && *comm) remember_comm(*comm, key);
    finish_call(seq, rc, NULL, NULL);
    return rc;
}

typedef ncclResult_t (*init_rank_fn)(ncclComm_t *, int, ncclUniqueId, int);
EXPORT ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
    REAL(ncclCommInitRank, init_rank_fn);
    if (!enabled()) return real_ncclCommInitRank(comm, nranks, id, rank);
    uint64_t key = hash_bytes(&id, sizeof id);
    uint64_t seq = publish(OP_COMM_INIT, key, 0, (uint64_t)nranks, rank);
    return init_done(seq, real_ncclCommInitRank(comm, nranks, id, rank), comm, key);
}

typedef ncclResult_t (*init_config_fn)(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *);
EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id,
                                           int rank, ncclConfig_t *config) {
    REAL(ncclCommInitRankConfig, init_config_fn);
    if (!enabled()) return real_ncclCommInitRankConfig(comm, nranks, id, rank, config);
    uint64_t key = hash_bytes(&id, sizeof id);
    uint64_t seq = publish(OP_COMM_INIT, key, 0, (uint64_t)nranks, rank);
    return init_done(seq, real_ncclCommInitRankConfig(comm, nranks, id, rank, config), comm, key);
}

typedef ncclResult_t (*init_scalable_fn)(ncclComm_t *, int, int, int, ncclUniqueId *,
                                         ncclConfig_t *);
EXPORT ncclResult_t ncclCommInitRankScalable(ncclComm_t *comm, int nranks, int rank, int nids,
                                             ncclUniqueId *ids, ncclConfig_t *config) {
    REAL(ncclCommInitRankScalable, init_scalable_fn);
    if (!enabled()) return real_ncclCommInitRankScalable(comm, nranks, rank, nids, ids, config);
    uint64_t key = ids && nids > 0 ? hash_bytes(ids, sizeof *ids) : 0;
    uint64_t seq = publish(OP_COMM_INIT, key, 0, (uint64_t)nranks, rank);
    return init_done(seq, real_ncclCommInitRankScalable(comm, nranks, rank, nids, ids, config),
                     comm, key);
}

typedef ncclResult_t (*comm_fn)(ncclComm_t);
static ncclResult_t comm_end(comm_fn real, uint32_t op, ncclComm_t comm) {
    uint32_t ignored;
    uint64_t key = comm_next(comm, &ignored);
    uint64_t seq = publish(op, key, 0, 0, -1);
    ncclResult_t rc = real(comm);
    forget_comm(comm);
    finish_call(seq, rc, NULL, NULL);
    return rc;
}

EXPORT ncclResult_t ncclCommAbort(ncclComm_t comm) {
    REAL(ncclCommAbort, comm_fn);
    if (!enabled()) return real_ncclCommAbort(comm);
    return comm_end(real_ncclCommAbort, OP_COMM_ABORT, comm);
}

EXPORT ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    REAL(ncclCommDestroy, comm_fn);
    if (!enabled()) return real_ncclCommDestroy(comm);
    return comm_end(real_ncclCommDestroy, OP_COMM_DESTROY, comm);
}
