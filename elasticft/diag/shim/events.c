/*
 * Completion of each call: a pair of CUDA events recorded around the call on its stream and
 * polled by a background thread. The events come from a pool of slots indexed by the record's
 * seq: a slot's events are created once, on its first use, and recycled by the polling thread,
 * so the call path creates and destroys nothing and shares no lock with that thread (its only
 * atomic read-modify-write is the record counter). libcudart is resolved at run time with dlopen
 * (the copy the process already loaded when there is one; ELASTICFT_DIAG_CUDART overrides the
 * path); without it, completion is the time the call returned on the host (flag
 * FLAG_HOST_COMPLETION).
 */
#include "shim.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

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

int cuda_usable(void) {
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
struct slot {
    int state;
    uint64_t seq;
    cudaEvent_t start, end;
};
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
slot_t *begin_timing(uint64_t seq, cudaStream_t stream) {
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

void finish_call(uint64_t seq, ncclResult_t rc, cudaStream_t stream, slot_t *slot) {
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


const char *cuda_library(void) { return g_cuda.library; }
