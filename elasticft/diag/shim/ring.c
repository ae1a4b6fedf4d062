/*
 * This rank's ring of records in shared memory (layout in elasticft/diag/ring.py): opening and
 * backing it at the first NCCL call, and publishing and completing records. Per call a record
 * holds seq, op, bytes, communicator key, per-communicator seq and enqueue time. When
 * ELASTICFT_DIAG_SHIM is not "1", or the ring cannot be opened and backed by memory, the shim
 * stays disabled and every entry point is a plain call of the real function.
 *
 * Environment: ELASTICFT_DIAG_SHIM=1 enables it; ELASTICFT_DIAG_NCCL_RING names the ring file
 * (the agent's anonymous file, /proc/<agent pid>/fd/<n>, opened as it is); without it,
 * ELASTICFT_DIAG_RING_DIR holds the rings and RANK names this one (rank-<RANK>.nccl.ring),
 * created if missing.
 */
#include "shim.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
volatile int g_enabled;
volatile int g_init_done;
char g_init_error[256];
ring_header_t *g_header;
ring_record_t *g_records;
uint32_t g_capacity;
uint64_t g_seq;

static void disable_in_child(void) { g_enabled = 0; }

#define INIT_FAIL(...) do { snprintf(g_init_error, sizeof g_init_error, __VA_ARGS__); } while (0)

static void shim_init(void) {
    const char *on = getenv("ELASTICFT_DIAG_SHIM");
    const char *file = getenv("ELASTICFT_DIAG_NCCL_RING");
    const char *dir = getenv("ELASTICFT_DIAG_RING_DIR");
    const char *rank = getenv("RANK");
    if (!on || strcmp(on, "1") != 0) { INIT_FAIL("disabled (ELASTICFT_DIAG_SHIM is not 1)"); return; }
    char path[4096];
    int flags = O_RDWR | O_CLOEXEC;
    if (file && *file) {
        if (snprintf(path, sizeof path, "%s", file) >= (int)sizeof path) {
            INIT_FAIL("ring path too long");
            return;
        }
    } else {
        if (!dir || !*dir) {
            INIT_FAIL("no ring (ELASTICFT_DIAG_NCCL_RING and ELASTICFT_DIAG_RING_DIR are not set)");
            return;
        }
        if (snprintf(path, sizeof path, "%s/rank-%s.nccl.ring", dir, rank && *rank ? rank : "0") >=
            (int)sizeof path) {
            INIT_FAIL("ring path too long");
            return;
        }
        flags |= O_CREAT;
    }
    int fd = open(path, flags, 0600);
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

static void init_once(void) {
    shim_init();
    __atomic_store_n(&g_init_done, 1, __ATOMIC_RELEASE);
}

/* The slow path of enabled() (shim.h): the first call opens the ring. */
int enable_once(void) {
    pthread_once(&g_once, init_once);
    return g_enabled;
}

void complete(uint64_t seq, uint64_t t, double gpu_ms, uint32_t extra_flags) {
    ring_record_t *r = slot_of(seq);
    if (__atomic_load_n(&r->seq, __ATOMIC_ACQUIRE) != seq) return; /* overwritten after a wrap */
    if (gpu_ms >= 0) r->value = gpu_ms;
    if (extra_flags) __atomic_or_fetch(&r->flags, extra_flags, __ATOMIC_RELAXED);
    __atomic_store_n(&r->complete_ns, t ? t : 1, __ATOMIC_RELEASE);
}

uint64_t publish(uint32_t op, uint64_t key, uint32_t comm_seq, uint64_t bytes, int peer) {
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
