/* Calls NCCL like a training loop would; prints every return code on one line. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
typedef struct { char internal[128]; } ncclUniqueId;
typedef struct ncclComm *ncclComm_t;
int ncclAllReduce(const void *, void *, size_t, int, int, ncclComm_t, void *);
int ncclBroadcast(const void *, void *, size_t, int, int, ncclComm_t, void *);
int ncclSend(const void *, size_t, int, int, ncclComm_t, void *);
int ncclRecv(void *, size_t, int, int, ncclComm_t, void *);
int ncclGroupStart(void);
int ncclGroupEnd(void);
int ncclCommInitRank(ncclComm_t *, int, ncclUniqueId, int);
int ncclCommDestroy(ncclComm_t);
int ncclCommSplit(ncclComm_t, int, int, ncclComm_t *, void *);

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 3;
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    memcpy(id.internal, "elasticft-test-id", 17);
    ncclComm_t comm = NULL;
    void *stream = (void *)0x1234;
    printf("init=%d", ncclCommInitRank(&comm, 4, id, 3));
    /* FAKE_CALL_GAP_US paces the calls like a training loop (the shim's thread polls every
     * 200 us while events are outstanding). */
    const char *gap = getenv("FAKE_CALL_GAP_US");
    for (int i = 0; i < n; i++) {  /* float32 (type 7) */
        printf(" allreduce=%d", ncclAllReduce(NULL, NULL, 1000 + i, 7, 0, comm, stream));
        if (gap) usleep(atoi(gap));
    }
    printf(" bad=%d", ncclAllReduce(NULL, NULL, 13, 7, 0, comm, stream));
    printf(" bcast=%d", ncclBroadcast(NULL, NULL, 256, 9 /* bf16 */, 2, comm, stream));
    printf(" gstart=%d", ncclGroupStart());
    printf(" send=%d", ncclSend(NULL, 10, 4 /* int64 */, 1, comm, stream));
    printf(" recv=%d", ncclRecv(NULL, 10, 4, 1, comm, stream));
    printf(" gend=%d", ncclGroupEnd());
    usleep(300 * 1000); /* let the shim's poller see the completions */
    if (getenv("FAKE_SPLIT")) {  /* a sub-group: colour 5, then two calls on it */
        ncclComm_t child = NULL;
        printf(" split=%d", ncclCommSplit(comm, 5, 0, &child, NULL));
        for (int i = 0; i < 2; i++)
            printf(" child_allreduce=%d", ncclAllReduce(NULL, NULL, 8, 7, 0, child, stream));
        usleep(100 * 1000);
        printf(" child_destroy=%d", ncclCommDestroy(child));
    }
    printf(" destroy=%d\n", ncclCommDestroy(comm));
    return 0;
}
