/*
 * The NCCL shim's private header: what its parts share. The NCCL and CUDA types the shim needs
 * (ABI-compatible with nccl.h), the ring's layout (keep in step with elasticft/diag/ring.py), the
 * state each part owns and the functions each part offers the others. Everything here is hidden
 * (-fvisibility=hidden); only the EXPORT-marked NCCL entry points, elasticft_shim_probe and
 * elasticft_shim_records leave the library.
 *
 * The parts: resolve.c (finding the real NCCL), ring.c (this rank's ring of records in shared
 * memory), events.c (the CUDA event pool and the completion polling thread), comms.c
 * (communicator keys), entry.c (the interposed NCCL entry points), probe.c (the self-check).
 */
#ifndef ELASTICFT_NCCL_SHIM_H
#define ELASTICFT_NCCL_SHIM_H

#define _GNU_SOURCE
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#define EXPORT __attribute__((visibility("default")))
#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)

/* ---- NCCL types, as far as the shim needs them (ABI-compatible with nccl.h) ---- */
typedef int ncclResult_t;
typedef struct ncclComm *ncclComm_t;
typedef int ncclDataType_t;
typedef int ncclRedOp_t;
typedef struct { char internal[128]; } ncclUniqueId;
typedef struct ncclConfig ncclConfig_t;
typedef void *cudaStream_t;
typedef void *cudaEvent_t;
enum { ncclSuccess = 0, ncclInternalError = 3, ncclInProgress = 7 };

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


static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- resolve.c: finding the real NCCL ---- */
/* One resolved entry point. */
typedef struct { const char *name; void *fn; int warned; } real_t;
void *find_real(const char *name);
void *resolve(real_t *real);

/* ---- ring.c: this rank's ring ---- */
extern volatile int g_enabled;           /* 1 only after a successful init */
extern volatile int g_init_done;
extern char g_init_error[256];           /* why init left the shim disabled */
extern ring_header_t *g_header;
extern ring_record_t *g_records;
extern uint32_t g_capacity;
extern uint64_t g_seq;                   /* the call path's one atomic read-modify-write */
int enable_once(void);
uint64_t publish(uint32_t op, uint64_t key, uint32_t comm_seq, uint64_t bytes, int peer);
void complete(uint64_t seq, uint64_t t, double gpu_ms, uint32_t extra_flags);

static inline int enabled(void) {
    if (LIKELY(g_enabled)) return 1;
    if (LIKELY(__atomic_load_n(&g_init_done, __ATOMIC_ACQUIRE))) return 0; /* disabled */
    return enable_once();
}

static inline ring_record_t *slot_of(uint64_t seq) { return &g_records[(seq - 1) % g_capacity]; }

/* ---- events.c: CUDA events and the polling thread ---- */
typedef struct slot slot_t;              /* an event pool slot; NULL: the call is not timed */
int cuda_usable(void);
const char *cuda_library(void);
slot_t *begin_timing(uint64_t seq, cudaStream_t stream);
void finish_call(uint64_t seq, ncclResult_t rc, cudaStream_t stream, slot_t *slot);

/* ---- comms.c: communicator keys ---- */
#define FNV_OFFSET 1469598103934665603ull
uint64_t hash_bytes(const void *data, size_t n, uint64_t h);
void remember_comm(ncclComm_t comm, uint64_t key);
void forget_comm(ncclComm_t comm);
uint64_t comm_next(ncclComm_t comm, uint32_t *comm_seq);
uint64_t comm_key(ncclComm_t comm);

#endif
