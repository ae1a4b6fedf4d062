/*
 * Communicators: pointer -> key shared by all members (a hash of the unique id, or of the parent
 * key and colour for a split), and a per-communicator call counter. Lock-free to read (open
 * addressing); inserts and removals take a mutex.
 */
#include "shim.h"



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

uint64_t hash_bytes(const void *data, size_t n, uint64_t h) {
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++) { h ^= p[i]; h *= 1099511628211ull; }
    return h ? h : 1;
}

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

void remember_comm(ncclComm_t comm, uint64_t key) {
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

void forget_comm(ncclComm_t comm) {
    pthread_mutex_lock(&g_comm_lock);
    comm_entry_t *e = find_comm(comm);
    if (e) __atomic_store_n(&e->comm, TOMBSTONE, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&g_comm_lock);
}

/* The communicator's key and the call's number within it. NCCL forbids using one communicator
 * from two threads at once, so the counter needs no read-modify-write. Unknown communicators
 * (created before the shim saw them) are keyed by their address, meaningful on this rank only. */
uint64_t comm_next(ncclComm_t comm, uint32_t *comm_seq) {
    comm_entry_t *e = comm ? find_comm(comm) : NULL;
    if (!e) { *comm_seq = 0; return (uint64_t)(uintptr_t)comm; }
    uint32_t seq = __atomic_load_n(&e->seq, __ATOMIC_RELAXED) + 1;
    __atomic_store_n(&e->seq, seq, __ATOMIC_RELAXED);
    *comm_seq = seq;
    return e->key;
}

uint64_t comm_key(ncclComm_t comm) {
    comm_entry_t *e = comm ? find_comm(comm) : NULL;
    return e ? e->key : (uint64_t)(uintptr_t)comm;
}

