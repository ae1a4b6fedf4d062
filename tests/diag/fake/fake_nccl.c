/* A fake libnccl for testing the shim on CPU: each call returns a code chosen by the caller. */
#include <stddef.h>
typedef struct { char internal[128]; } ncclUniqueId;
typedef struct ncclComm *ncclComm_t;
static int fake_comm;

/* AllReduce of 13 elements fails with ncclInvalidUsage (5), to check pass-through. */
int ncclAllReduce(const void *s, void *r, size_t count, int type, int op, ncclComm_t comm,
                  void *stream) {
    (void)s; (void)r; (void)type; (void)op; (void)comm; (void)stream;
    return count == 13 ? 5 : 0;
}
int ncclBroadcast(const void *s, void *r, size_t count, int type, int root, ncclComm_t comm,
                  void *stream) {
    (void)s; (void)r; (void)count; (void)type; (void)root; (void)comm; (void)stream;
    return 0;
}
int ncclSend(const void *s, size_t count, int type, int peer, ncclComm_t comm, void *stream) {
    (void)s; (void)count; (void)type; (void)peer; (void)comm; (void)stream;
    return 0;
}
int ncclRecv(void *r, size_t count, int type, int peer, ncclComm_t comm, void *stream) {
    (void)r; (void)count; (void)type; (void)peer; (void)comm; (void)stream;
    return 0;
}
int ncclGroupStart(void) { return 0; }
int ncclGroupEnd(void) { return 0; }
int ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
    (void)nranks; (void)id; (void)rank;
    *comm = (ncclComm_t)&fake_comm;
    return 0;
}
int ncclCommDestroy(ncclComm_t comm) { (void)comm; return 0; }
static int fake_child;
int ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, void *config) {
    (void)comm; (void)color; (void)key; (void)config;
    *newcomm = (ncclComm_t)&fake_child;
    return 0;
}
