/*
 * elasticft NCCL shim: times every NCCL call of a worker, for the agent's hang and slow-rank
 * detectors. Loaded with LD_PRELOAD; it defines the NCCL entry points, forwards each call to the
 * real NCCL and always returns NCCL's own result.
 *
 * Finding the real NCCL (docs/nccl-shim.md): dlsym(RTLD_NEXT) first, which finds a libnccl in
 * the global scope; then every object the process has loaded, in load order (dl_iterate_phdr,
 * dlopen(path, RTLD_NOLOAD), dlsym on that handle), skipping the shim's own image. The second
 * search finds the libnccl that torch loads as a DT_NEEDED of libtorch_cuda.so in a local
 * (RTLD_LOCAL) scope, an NCCL linked statically into another library that exports it, and an
 * NCCL loaded after the shim started. Each symbol is resolved once; a symbol that no loaded
 * object defines is searched again at the next call (NCCL may be loaded later).
 *
 * Per call it publishes a record (seq, op, bytes, communicator key, per-communicator seq,
 * enqueue time) into this rank's ring in shared memory (layout in elasticft/diag/ring.py).
 * Completion comes from a pair of CUDA events recorded around the call on its stream and polled
 * by a background thread. The events come from a pool of slots indexed by the record's seq: a
 * slot's events are created once, on its first use, and recycled by the polling thread, so the
 * call path creates and destroys nothing and shares no lock with that thread (its only atomic
 * read-modify-write is the record counter). libcudart is resolved at run time with dlopen (the
 * copy the process already loaded when there is one); without it, completion is the time the
 * call returned on the host (flag FLAG_HOST_COMPLETION).
 *
 * Rules: a recorder failure never reaches NCCL. When ELASTICFT_DIAG_SHIM is not "1", or the ring
 * cannot be opened and backed by memory, every entry point is a plain call of the real function.
 * elasticft_shim_probe() reports what the shim found, for the worker's self-check
 * (elasticft/diag/shimcheck.py).
 *
 * Environment: ELASTICFT_DIAG_SHIM=1 enables it; ELASTICFT_DIAG_RING_DIR holds the rings;
 * RANK names the ring (rank-<RANK>.nccl.ring); ELASTICFT_DIAG_CUDART overrides the libcudart path.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <link.h>
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

/* ---- state ---- */
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static volatile int g_enabled;           /* 1 only after a successful init */
static char g_init_error[256];           /* why init left the shim disabled */
static ring_header_t *g_header;
static ring_record_t *g_records;
static uint32_t g_capacity;
static uint64_t g_seq;                   /* the call path's one atomic read-modify-write */

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ======================================================================================== */
/* Finding the real NCCL                                                                    */
/* ======================================================================================== */

static void *g_self_base;                /* load address of this shim */
static pthread_mutex_t g_resolve_lock = PTHREAD_MUTEX_INITIALIZER;
static void *g_hint;                     /* handle of the object that defined the last symbol */

static void *self_base(void) {
    if (!g_self_base) {
        Dl_info info;
        if (dladdr((void *)&self_base, &info)) g_self_base = info.dli_fbase;
    }
    return g_self_base;
}

static int in_self(void *addr) {
    Dl_info info;
    return dladdr(addr, &info) && info.dli_fbase == self_base();
}

typedef struct { char **paths; size_t n, cap; } object_list_t;

static int collect_object(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    object_list_t *list = data;
    /* The main program's own definitions would have bound before the shim's; the shim skips
     * itself. Everything else is a candidate, in load order. */
    if (!info->dlpi_name || !info->dlpi_name[0]) return 0;
    /* g_self_base, not self_base(): dladdr takes the loader's lock, and dl_iterate_phdr holds
     * another one while it calls back (the opposite order of dlopen's: a deadlock). */
    if ((void *)info->dlpi_addr == g_self_base) return 0;
    if (list->n == list->cap) {
        size_t cap = list->cap ? list->cap * 2 : 64;
        char **grown = realloc(list->paths, cap * sizeof *grown);
        if (!grown) return 1;
        list->paths = grown;
        list->cap = cap;
    }
    char *copy = strdup(info->dlpi_name);
    if (copy) list->paths[list->n++] = copy;
    return 0;
}

/* Looks the symbol up in every loaded object; dlopen runs outside dl_iterate_phdr's callback,
 * which holds the loader's lock. Called with g_resolve_lock held. */
static void *search_loaded(const char *name) {
    if (g_hint) {
        void *fn = dlsym(g_hint, name);
        if (fn && !in_self(fn)) return fn;
    }
    object_list_t list = {0};
    self_base();
    dl_iterate_phdr(collect_object, &list);
    void *found = NULL;
    for (size_t i = 0; i < list.n; i++) {
        if (!found) {
            void *handle = dlopen(list.paths[i], RTLD_LAZY | RTLD_NOLOAD);
            if (handle) {
                void *fn = dlsym(handle, name);
                if (fn && !in_self(fn)) {
                    found = fn;
                    if (g_hint) dlclose(g_hint);
                    g_hint = handle; /* kept open: NCCL is in use from now on */
                    handle = NULL;
                }
                if (handle) dlclose(handle);
            }
        }
        free(list.paths[i]);
    }
    free(list.paths);
    return found;
}

static void *find_real(const char *name) {
    void *fn = dlsym(RTLD_NEXT, name);
    if (fn && !in_self(fn)) return fn;
    pthread_mutex_lock(&g_resolve_lock);
    fn = search_loaded(name);
    pthread_mutex_unlock(&g_resolve_lock);
    return fn;
}

/* One resolved entry point. */
typedef struct { const char *name; void *fn; int warned; } real_t;

static void *resolve(real_t *real) {
    void *fn = __atomic_load_n(&real->fn, __ATOMIC_ACQUIRE);
    if (LIKELY(fn != NULL)) return fn;
    fn = find_real(real->name);
    if (fn) {
        __atomic_store_n(&real->fn, fn, __ATOMIC_RELEASE);
    } else if (!__atomic_exchange_n(&real->warned, 1, __ATOMIC_RELAXED)) {
        /* Nothing in the process defines it: without the shim the caller could not have bound
         * to it either (the loader's "undefined symbol"). */
        fprintf(stderr, "elasticft NCCL shim: %s is defined by no loaded library; "
                        "returning ncclInternalError\n", real->name);
    }
    return fn;
}

/* ======================================================================================== */
/* The ring                                                                                 */
/* ======================================================================================== */

static void disable_in_child(void) { g_enabled = 0; }

#define INIT_FAIL(...) do { snprintf(g_init_error, sizeof g_init_error, __VA_ARGS__); } while (0)

static void shim_init(void) {
    const char *on = getenv("ELASTICFT_DIAG_SHIM");
    const char *dir = getenv("ELASTICFT_DIAG_RING_DIR");
    const char *rank = getenv("RANK");
    if (!on || strcmp(on, "1") != 0) { INIT_FAIL("disabled (ELASTICFT_DIAG_SHIM is not 1)"); return; }
    if (!dir || !*dir) { INIT_FAIL("ELASTICFT_DIAG_RING_DIR is not set"); return; }
    char path[4096];
    if (snprintf(path, sizeof path, "%s/rank-%s.nccl.ring", dir, rank && *rank ? rank : "0") >=
        (int)sizeof path) {
        INIT_FAIL("ring path too long");
        return;
    }
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) { INIT_FAIL("ring %.200s: %s", path, strerror(errno)); return; }
    struct stat st;
    size_t size = 0;
    if (fstat(fd, &st) == 0) size = (size_t)st.st_size;
    if (size < HEADER_SIZE + sizeof(ring_record_t)) {
        size = HEADER_SIZE + (size_t)DEFAULT_CAPACITY * sizeof(ring_record_t);
        if (ftruncate(fd, (off_t)size) != 0) {
            INIT_FAIL("ring %.200s: %s", path, strerror(errno));
            close(fd);
            return;
        }
    }
    /* Back every page now: a store into an unbacked page of a full tmpfs raises SIGBUS, which
     * would kill the training process. */
    int rc = posix_fallocate(fd, 0, (off_t)size);
    if (rc != 0 && rc != EOPNOTSUPP && rc != EINVAL) {
        INIT_FAIL("ring %.200s: %s", path, strerror(rc));
        close(fd);
        return;
    }
    void *map = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (map == MAP_FAILED) { INIT_FAIL("ring %.200s: mmap: %s", path, strerror(errno)); return; }
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

static volatile int g_init_done;

static void init_once(void) {
    shim_init();
    __atomic_store_n(&g_init_done, 1, __ATOMIC_RELEASE);
}

static inline int enabled(void) {
    if (LIKELY(g_enabled)) return 1;
    if (LIKELY(__atomic_load_n(&g_init_done, __ATOMIC_ACQUIRE))) return 0; /* disabled */
    pthread_once(&g_once, init_once);
    return g_enabled;
}

static ring_record_t *slot_of(uint64_t seq) { return &g_records[(seq - 1) % g_capacity]; }

static void complete(uint64_t seq, uint64_t t, double gpu_ms, uint32_t extra_flags) {
    ring_record_t *r = slot_of(seq);
    if (__atomic_load_n(&r->seq, __ATOMIC_ACQUIRE) != seq) return; /* overwritten after a wrap */
    if (gpu_ms >= 0) r->value = gpu_ms;
    if (extra_flags) __atomic_or_fetch(&r->flags, extra_flags, __ATOMIC_RELAXED);
    __atomic_store_n(&r->complete_ns, t ? t : 1, __ATOMIC_RELEASE);
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
    /* Head only grows; with one calling thread the first exchange succeeds, uncontended. */
    uint64_t head = __atomic_load_n(&g_header->head, __ATOMIC_RELAXED);
    while (head < seq && !__atomic_compare_exchange_n(&g_header->head, &head, seq, 1,
                                                      __ATOMIC_RELEASE, __ATOMIC_RELAXED)) {
    }
    return seq;
}

/* ======================================================================================== */
/* CUDA runtime and the event pool                                                          */
/* ======================================================================================== */

typedef int (*event_create_fn)(cudaEvent_t *, unsigned int);
typedef int (*event_record_fn)(cudaEvent_t, cudaStream_t);
typedef int (*event_query_fn)(cudaEvent_t);
typedef int (*event_destroy_fn)(cudaEvent_t);
typedef int (*event_elapsed_fn)(float *, cudaEvent_t, cudaEvent_t);
typedef int (*stream_capturing_fn)(cudaStream_t, int *);
static struct {
    int state; /* 0 unresolved, 1 usable, -1 not available */
    char library[128];
    event_create_fn create;
    event_record_fn record;
    event_query_fn query;
    event_destroy_fn destroy;
    event_elapsed_fn elapsed;
    stream_capturing_fn capturing;
} g_cuda;
static pthread_mutex_t g_cuda_lock = PTHREAD_MUTEX_INITIALIZER;

static void resolve_cuda(void) {
    pthread_mutex_lock(&g_cuda_lock);
    if (g_cuda.state != 0) { pthread_mutex_unlock(&g_cuda_lock); return; }
    void *lib = NULL;
    const char *chosen = NULL;
    const char *override = getenv("ELASTICFT_DIAG_CUDART");
    static const char *names[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0",
                                  "libcudart.so"};
    if (override && *override) {
        /* An explicit choice is final: no search behind the user's back. */
        lib = dlopen(override, RTLD_NOW | RTLD_LOCAL);
        chosen = override;
    } else {
        /* Prefer the runtime the process already uses, then load one. */
        for (size_t i = 0; !lib && i < sizeof names / sizeof *names; i++)
            if ((lib = dlopen(names[i], RTLD_NOW | RTLD_NOLOAD))) chosen = names[i];
        for (size_t i = 0; !lib && i < sizeof names / sizeof *names; i++)
            if ((lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL))) chosen = names[i];
    }
    if (lib) {
        g_cuda.create = (event_create_fn)dlsym(lib, "cudaEventCreateWithFlags");
        g_cuda.record = (event_record_fn)dlsym(lib, "cudaEventRecord");
        g_cuda.query = (event_query_fn)dlsym(lib, "cudaEventQuery");
        g_cuda.destroy = (event_destroy_fn)dlsym(lib, "cudaEventDestroy");
        g_cuda.elapsed = (event_elapsed_fn)dlsym(lib, "cudaEventElapsedTime");
        g_cuda.capturing = (stream_capturing_fn)dlsym(lib, "cudaStreamIsCapturing");
        snprintf(g_cuda.library, sizeof g_cuda.library, "%s", chosen);
    }
    int usable = lib && g_cuda.create && g_cuda.record && g_cuda.query && g_cuda.destroy &&
                 g_cuda.elapsed;
    __atomic_store_n(&g_cuda.state, usable ? 1 : -1, __ATOMIC_RELEASE);
    if (usable && g_header) __atomic_or_fetch(&g_header->flags, 1ull, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&g_cuda_lock);
}

static inline int cuda_usable(void) {
    int state = __atomic_load_n(&g_cuda.state, __ATOMIC_ACQUIRE);
    if (UNLIKELY(state == 0)) {
        resolve_cuda();
        state = __atomic_load_n(&g_cuda.state, __ATOMIC_ACQUIRE);
    }
    return state == 1;
}

/* The event pool: slot (seq % POOL) times record seq. FREE slots belong to the call path (only
 * the call that drew that seq touches one), ARMED slots to the polling thread, which frees them
 * once the end event has completed. A slot still ARMED from POOL calls ago leaves the new call
 * untimed rather than waiting. */
#define POOL 4096u
enum { SLOT_FREE = 0, SLOT_ARMED = 1 };
typedef struct {
    int state;
    uint64_t seq;
    cudaEvent_t start, end;
} slot_t;
static slot_t g_slots[POOL];
static int g_poller_started; /* 0 not yet, 1 running, -1 could not start */
static pthread_mutex_t g_poller_lock = PTHREAD_MUTEX_INITIALIZER;

static void *poller(void *arg);

static void start_poller(void) {
    pthread_mutex_lock(&g_poller_lock);
    if (!g_poller_started) {
        pthread_t tid;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int ok = pthread_create(&tid, &attr, poller, NULL) == 0;
        pthread_attr_destroy(&attr);
        __atomic_store_n(&g_poller_started, ok ? 1 : -1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&g_poller_lock);
}

static inline int poller_running(void) {
    int started = __atomic_load_n(&g_poller_started, __ATOMIC_ACQUIRE);
    if (UNLIKELY(started == 0)) {
        start_poller();
        started = __atomic_load_n(&g_poller_started, __ATOMIC_ACQUIRE);
    }
    return started == 1;
}

/* The slot for seq if it is free, with its two events created (once per slot, on the calling
 * thread, whose current device is the stream's). */
static slot_t *take_slot(uint64_t seq) {
    if (!cuda_usable() || !poller_running()) return NULL;
    slot_t *s = &g_slots[seq % POOL];
    if (__atomic_load_n(&s->state, __ATOMIC_ACQUIRE) != SLOT_FREE) return NULL;
    if (UNLIKELY(!s->start || !s->end)) {
        if ((!s->start && g_cuda.create(&s->start, 0 /* timed */) != 0) ||
            (!s->end && g_cuda.create(&s->end, 0) != 0)) {
            /* No device or no context: host completion from now on, without a try per call. */
            if (s->start) g_cuda.destroy(s->start);
            s->start = s->end = NULL;
            __atomic_store_n(&g_cuda.state, -1, __ATOMIC_RELEASE);
            if (g_header) __atomic_and_fetch(&g_header->flags, ~1ull, __ATOMIC_RELAXED);
            return NULL;
        }
    }
    return s;
}

/* Records ev on stream; events of another device are replaced by ones of the current device. */
static int record_event(cudaEvent_t *ev, cudaStream_t stream) {
    if (LIKELY(g_cuda.record(*ev, stream) == 0)) return 1;
    cudaEvent_t fresh = NULL;
    if (g_cuda.create(&fresh, 0) != 0) return 0;
    if (g_cuda.record(fresh, stream) != 0) { g_cuda.destroy(fresh); return 0; }
    g_cuda.destroy(*ev);
    *ev = fresh;
    return 1;
}

static int capturing(cudaStream_t stream) {
    if (!g_cuda.capturing) return 0;
    int status = 0;
    return g_cuda.capturing(stream, &status) != 0 || status != 0;
}

/* Starts timing a call; NULL: the call is not timed. */
static slot_t *begin_timing(uint64_t seq, cudaStream_t stream) {
    slot_t *s = take_slot(seq);
    if (!s || capturing(stream) || !record_event(&s->start, stream)) return NULL;
    return s;
}

/* Hands the slot to the polling thread once the end event is on the stream. */
static int arm(slot_t *s, uint64_t seq, cudaStream_t stream) {
    if (!record_event(&s->end, stream)) return 0;
    s->seq = seq;
    __atomic_or_fetch(&slot_of(seq)->flags, FLAG_TIMED, __ATOMIC_RELAXED);
    __atomic_store_n(&s->state, SLOT_ARMED, __ATOMIC_RELEASE);
    return 1;
}

static void finish_call(uint64_t seq, ncclResult_t rc, cudaStream_t stream, slot_t *slot) {
    if (rc != ncclSuccess && rc != ncclInProgress) {
        ring_record_t *r = slot_of(seq);
        if (__atomic_load_n(&r->seq, __ATOMIC_ACQUIRE) == seq)
            __atomic_or_fetch(&r->flags, ((uint32_t)rc & 0xffu) << 8, __ATOMIC_RELAXED);
    }
    /* ncclInProgress: a non-blocking communicator has taken the call; its work is queued. */
    int launched = rc == ncclSuccess || rc == ncclInProgress;
    if (launched && slot && arm(slot, seq, stream)) return;
    complete(seq, now_ns(), -1, FLAG_HOST_COMPLETION);
}

/* The polling thread: completes armed slots whose end event has passed, oldest first. */
static void *poller(void *arg) {
    (void)arg;
    uint64_t low = 0; /* every seq <= low is settled */
    for (;;) {
        uint64_t head = __atomic_load_n(&g_seq, __ATOMIC_ACQUIRE);
        if (head > low + POOL) low = head - POOL;
        int outstanding = 0, settled_so_far = 1;
        for (uint64_t seq = low + 1; seq <= head; seq++) {
            slot_t *s = &g_slots[seq % POOL];
            int settled = 0;
            /* An armed slot of an older seq (left behind by the window's cap) is served too. */
            if (__atomic_load_n(&s->state, __ATOMIC_ACQUIRE) == SLOT_ARMED && s->seq <= seq) {
                int rc = g_cuda.query(s->end);
                if (rc == 600 /* cudaErrorNotReady */) {
                    outstanding++;
                } else {
                    float ms = -1.0f;
                    if (rc != 0 || g_cuda.elapsed(&ms, s->start, s->end) != 0) ms = -1.0f;
                    complete(s->seq, now_ns(), ms, rc != 0 ? FLAG_HOST_COMPLETION : 0);
                    settled = s->seq == seq;
                    __atomic_store_n(&s->state, SLOT_FREE, __ATOMIC_RELEASE);
                }
            }
            if (!settled) {
                /* Untimed, in the call still, or completed above: settled once the record is
                 * complete or overwritten. A call still running on the host (a communicator
                 * being created) holds the window open without making the thread poll faster. */
                ring_record_t *r = slot_of(seq);
                settled = __atomic_load_n(&r->seq, __ATOMIC_ACQUIRE) != seq ||
                          __atomic_load_n(&r->complete_ns, __ATOMIC_ACQUIRE) != 0;
            }
            if (settled && settled_so_far) low = seq;
            else settled_so_far = 0;
        }
        uint64_t t = now_ns();
        if (g_header) __atomic_store_n(&g_header->heartbeat_ns, t, __ATOMIC_RELAXED);
        usleep(outstanding ? 200 : 2000);
    }
    return NULL;
}

/* ======================================================================================== */
/* Communicators: pointer -> key shared by all members, and a per-communicator counter.      */
/* Lock-free to read (open addressing); inserts and removals take a mutex.                   */
/* ======================================================================================== */

#define COMMS 1024u
#define TOMBSTONE ((ncclComm_t)(uintptr_t)1)
typedef struct { ncclComm_t comm; uint64_t key; uint32_t seq; } comm_entry_t;
static comm_entry_t g_comms[COMMS];
static pthread_mutex_t g_comm_lock = PTHREAD_MUTEX_INITIALIZER;

static uint32_t comm_hash(ncclComm_t comm) {
    uint64_t x = (uint64_t)(uintptr_t)comm;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return (uint32_t)x;
}

static uint64_t hash_bytes(const void *data, size_t n, uint64_t h) {
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++) { h ^= p[i]; h *= 1099511628211ull; }
    return h ? h : 1;
}
#define FNV_OFFSET 1469598103934665603ull

static comm_entry_t *find_comm(ncclComm_t comm) {
    uint32_t i = comm_hash(comm);
    for (uint32_t n = 0; n < COMMS; n++, i++) {
        comm_entry_t *e = &g_comms[i % COMMS];
        ncclComm_t c = __atomic_load_n(&e->comm, __ATOMIC_ACQUIRE);
        if (c == comm) return e;
        if (c == NULL) return NULL;
    }
    return NULL;
}

static void remember_comm(ncclComm_t comm, uint64_t key) {
    if (!comm || comm == TOMBSTONE) return;
    pthread_mutex_lock(&g_comm_lock);
    comm_entry_t *e = find_comm(comm);
    if (!e) {
        uint32_t i = comm_hash(comm);
        for (uint32_t n = 0; n < COMMS; n++, i++) {
            comm_entry_t *c = &g_comms[i % COMMS];
            ncclComm_t v = __atomic_load_n(&c->comm, __ATOMIC_RELAXED);
            if (v == NULL || v == TOMBSTONE) { e = c; break; }
        }
    }
    if (e) {
        e->key = key;
        __atomic_store_n(&e->seq, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&e->comm, comm, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&g_comm_lock);
}

static void forget_comm(ncclComm_t comm) {
    pthread_mutex_lock(&g_comm_lock);
    comm_entry_t *e = find_comm(comm);
    if (e) __atomic_store_n(&e->comm, TOMBSTONE, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&g_comm_lock);
}

/* The communicator's key and the call's number within it. NCCL forbids using one communicator
 * from two threads at once, so the counter needs no read-modify-write. Unknown communicators
 * (created before the shim saw them) are keyed by their address, meaningful on this rank only. */
static uint64_t comm_next(ncclComm_t comm, uint32_t *comm_seq) {
    comm_entry_t *e = comm ? find_comm(comm) : NULL;
    if (!e) { *comm_seq = 0; return (uint64_t)(uintptr_t)comm; }
    uint32_t seq = __atomic_load_n(&e->seq, __ATOMIC_RELAXED) + 1;
    __atomic_store_n(&e->seq, seq, __ATOMIC_RELAXED);
    *comm_seq = seq;
    return e->key;
}

static uint64_t comm_key(ncclComm_t comm) {
    comm_entry_t *e = comm ? find_comm(comm) : NULL;
    return e ? e->key : (uint64_t)(uintptr_t)comm;
}

/* ======================================================================================== */
/* Groups: calls between ncclGroupStart and ncclGroupEnd launch at the outermost GroupEnd.   */
/* ======================================================================================== */

#define MAX_DEFERRED 256
static __thread int t_group_depth;
static __thread int t_ndeferred;
static __thread struct { uint64_t seq; cudaStream_t stream; slot_t *slot; } t_deferred[MAX_DEFERRED];

static void defer_in_group(uint64_t seq, ncclResult_t rc, cudaStream_t stream) {
    if ((rc == ncclSuccess || rc == ncclInProgress) && t_ndeferred < MAX_DEFERRED &&
        cuda_usable()) {
        t_deferred[t_ndeferred].seq = seq;
        t_deferred[t_ndeferred].stream = stream;
        t_deferred[t_ndeferred].slot = NULL;
        t_ndeferred++;
        return;
    }
    finish_call(seq, rc, stream, NULL);
}

static size_t type_size(ncclDataType_t t) {
    static const unsigned char sizes[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1};
    return (t >= 0 && (size_t)t < sizeof sizes) ? sizes[t] : 1;
}

/* ======================================================================================== */
/* Interposed entry points                                                                  */
/* ======================================================================================== */

#define REAL(name, type)                                                        \
    static real_t real_slot_##name = {#name, NULL, 0};                          \
    type real_##name = (type)resolve(&real_slot_##name);                        \
    if (UNLIKELY(!real_##name)) return ncclInternalError

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
    slot_t *slot_ = begin_timing(seq_, stream);                                 \
    ncclResult_t rc_ = real_##name(__VA_ARGS__);                                \
    finish_call(seq_, rc_, stream, slot_);                                      \
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

/* ncclAlltoAll exists only in recent NCCL (2.28 and later). */
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
    for (int i = 0; i < n; i++)
        t_deferred[i].slot = begin_timing(t_deferred[i].seq, t_deferred[i].stream);
    ncclResult_t rc = real_ncclGroupEnd();
    t_group_depth--;
    if (!outermost) return rc;
    t_ndeferred = 0;
    for (int i = 0; i < n; i++)
        finish_call(t_deferred[i].seq, rc, t_deferred[i].stream, t_deferred[i].slot);
    return rc;
}

static ncclResult_t init_done(uint64_t seq, ncclResult_t rc, ncclComm_t *comm, uint64_t key) {
    if ((rc == ncclSuccess || rc == ncclInProgress) && comm && *comm) remember_comm(*comm, key);
    finish_call(seq, rc, NULL, NULL);
    return rc;
}

typedef ncclResult_t (*init_rank_fn)(ncclComm_t *, int, ncclUniqueId, int);
EXPORT ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
    REAL(ncclCommInitRank, init_rank_fn);
    if (!enabled()) return real_ncclCommInitRank(comm, nranks, id, rank);
    uint64_t key = hash_bytes(&id, sizeof id, FNV_OFFSET);
    uint64_t seq = publish(OP_COMM_INIT, key, 0, (uint64_t)nranks, rank);
    return init_done(seq, real_ncclCommInitRank(comm, nranks, id, rank), comm, key);
}

typedef ncclResult_t (*init_config_fn)(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *);
EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id,
                                           int rank, ncclConfig_t *config) {
    REAL(ncclCommInitRankConfig, init_config_fn);
    if (!enabled()) return real_ncclCommInitRankConfig(comm, nranks, id, rank, config);
    uint64_t key = hash_bytes(&id, sizeof id, FNV_OFFSET);
    uint64_t seq = publish(OP_COMM_INIT, key, 0, (uint64_t)nranks, rank);
    return init_done(seq, real_ncclCommInitRankConfig(comm, nranks, id, rank, config), comm, key);
}

typedef ncclResult_t (*init_scalable_fn)(ncclComm_t *, int, int, int, ncclUniqueId *,
                                         ncclConfig_t *);
EXPORT ncclResult_t ncclCommInitRankScalable(ncclComm_t *comm, int nranks, int rank, int nids,
                                             ncclUniqueId *ids, ncclConfig_t *config) {
    REAL(ncclCommInitRankScalable, init_scalable_fn);
    if (!enabled()) return real_ncclCommInitRankScalable(comm, nranks, rank, nids, ids, config);
    uint64_t key = ids && nids > 0 ? hash_bytes(ids, sizeof *ids, FNV_OFFSET) : 0;
    uint64_t seq = publish(OP_COMM_INIT, key, 0, (uint64_t)nranks, rank);
    return init_done(seq, real_ncclCommInitRankScalable(comm, nranks, rank, nids, ids, config),
                     comm, key);
}

/* torch creates sub-groups by splitting: members of one colour share (parent key, colour). */
typedef ncclResult_t (*split_fn)(ncclComm_t, int, int, ncclComm_t *, ncclConfig_t *);
EXPORT ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                                  ncclConfig_t *config) {
    REAL(ncclCommSplit, split_fn);
    if (!enabled()) return real_ncclCommSplit(comm, color, key, newcomm, config);
    uint64_t parent = comm_key(comm);
    uint64_t child = hash_bytes(&color, sizeof color, hash_bytes(&parent, sizeof parent,
                                                                 FNV_OFFSET));
    uint64_t seq = publish(OP_COMM_INIT, child, 0, 0, key);
    return init_done(seq, real_ncclCommSplit(comm, color, key, newcomm, config), newcomm, child);
}

typedef ncclResult_t (*comm_fn)(ncclComm_t);
static ncclResult_t comm_end(comm_fn real, uint32_t op, ncclComm_t comm) {
    uint64_t seq = publish(op, comm_key(comm), 0, 0, -1);
    ncclResult_t rc = real(comm);
    if (rc == ncclSuccess && comm) forget_comm(comm);
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
    APPEND_STR(timed ? g_cuda.library : "");
    APPEND("}");
    if (n) out[w < n ? w : n - 1] = 0;
    return version;
}
