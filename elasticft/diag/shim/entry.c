/*
 * The interposed NCCL entry points: each forwards the call to the real NCCL and always returns
 * NCCL's own result; a recorder failure never reaches NCCL. Around the call it publishes a record
 * into the ring and starts the call's timing. Calls between ncclGroupStart and ncclGroupEnd are
 * launched at the outermost ncclGroupEnd, so their timing starts there.
 */
#include "shim.h"


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

/* The real NCCL's function of this name, of the type the wrapper itself is declared with: the
 * signature is written once, in the wrapper, and the pointer cannot disagree with it. */
#define REAL(name)                                                              \
    static real_t real_slot_##name = {#name, NULL, 0};                          \
    __typeof__(&name) real_##name = (__typeof__(&name))resolve(&real_slot_##name); \
    if (UNLIKELY(!real_##name)) return ncclInternalError

#define COLLECTIVE_BODY(name, op, comm, bytes, peer, stream, ...)               \
    REAL(name);                                                                 \
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

EXPORT ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                                  ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                  cudaStream_t stream) {
    COLLECTIVE_BODY(ncclAllReduce, OP_ALL_REDUCE, comm, count * type_size(datatype),
                    -1, stream, sendbuff, recvbuff, count, datatype, op, comm, stream);
}

EXPORT ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
                                  ncclDataType_t datatype, int root, ncclComm_t comm,
                                  cudaStream_t stream) {
    COLLECTIVE_BODY(ncclBroadcast, OP_BROADCAST, comm, count * type_size(datatype),
                    root, stream, sendbuff, recvbuff, count, datatype, root, comm, stream);
}

EXPORT ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count,
                               ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm,
                               cudaStream_t stream) {
    COLLECTIVE_BODY(ncclReduce, OP_REDUCE, comm, count * type_size(datatype), root,
                    stream, sendbuff, recvbuff, count, datatype, op, root, comm, stream);
}

EXPORT ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                                  ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
    COLLECTIVE_BODY(ncclAllGather, OP_ALL_GATHER, comm,
                    sendcount * type_size(datatype), -1, stream, sendbuff, recvbuff, sendcount,
                    datatype, comm, stream);
}

EXPORT ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                                      ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                      cudaStream_t stream) {
    COLLECTIVE_BODY(ncclReduceScatter, OP_REDUCE_SCATTER, comm,
                    recvcount * type_size(datatype), -1, stream, sendbuff, recvbuff, recvcount,
                    datatype, op, comm, stream);
}

/* ncclAlltoAll exists only in recent NCCL (2.28 and later). */
EXPORT ncclResult_t ncclAlltoAll(const void *sendbuff, void *recvbuff, size_t count,
                                 ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
    COLLECTIVE_BODY(ncclAlltoAll, OP_ALL_TO_ALL, comm, count * type_size(datatype),
                    -1, stream, sendbuff, recvbuff, count, datatype, comm, stream);
}

EXPORT ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype,
                             int peer, ncclComm_t comm, cudaStream_t stream) {
    COLLECTIVE_BODY(ncclSend, OP_SEND, comm, count * type_size(datatype), peer, stream,
                    sendbuff, count, datatype, peer, comm, stream);
}

EXPORT ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
                             ncclComm_t comm, cudaStream_t stream) {
    COLLECTIVE_BODY(ncclRecv, OP_RECV, comm, count * type_size(datatype), peer, stream,
                    recvbuff, count, datatype, peer, comm, stream);
}

EXPORT ncclResult_t ncclGroupStart(void) {
    REAL(ncclGroupStart);
    if (!enabled()) return real_ncclGroupStart();
    ncclResult_t rc = real_ncclGroupStart();
    if (rc == ncclSuccess) t_group_depth++;
    return rc;
}

EXPORT ncclResult_t ncclGroupEnd(void) {
    REAL(ncclGroupEnd);
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

EXPORT ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
    REAL(ncclCommInitRank);
    if (!enabled()) return real_ncclCommInitRank(comm, nranks, id, rank);
    uint64_t key = hash_bytes(&id, sizeof id, FNV_OFFSET);
    uint64_t seq = publish(OP_COMM_INIT, key, 0, (uint64_t)nranks, rank);
    return init_done(seq, real_ncclCommInitRank(comm, nranks, id, rank), comm, key);
}

EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id,
                                           int rank, ncclConfig_t *config) {
    REAL(ncclCommInitRankConfig);
    if (!enabled()) return real_ncclCommInitRankConfig(comm, nranks, id, rank, config);
    uint64_t key = hash_bytes(&id, sizeof id, FNV_OFFSET);
    uint64_t seq = publish(OP_COMM_INIT, key, 0, (uint64_t)nranks, rank);
    return init_done(seq, real_ncclCommInitRankConfig(comm, nranks, id, rank, config), comm, key);
}

EXPORT ncclResult_t ncclCommInitRankScalable(ncclComm_t *comm, int nranks, int rank, int nids,
                                             ncclUniqueId *ids, ncclConfig_t *config) {
    REAL(ncclCommInitRankScalable);
    if (!enabled()) return real_ncclCommInitRankScalable(comm, nranks, rank, nids, ids, config);
    uint64_t key = ids && nids > 0 ? hash_bytes(ids, sizeof *ids, FNV_OFFSET) : 0;
    uint64_t seq = publish(OP_COMM_INIT, key, 0, (uint64_t)nranks, rank);
    return init_done(seq, real_ncclCommInitRankScalable(comm, nranks, rank, nids, ids, config),
                     comm, key);
}

/* torch creates sub-groups by splitting: members of one colour share (parent key, colour). */
EXPORT ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                                  ncclConfig_t *config) {
    REAL(ncclCommSplit);
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
    REAL(ncclCommAbort);
    if (!enabled()) return real_ncclCommAbort(comm);
    return comm_end(real_ncclCommAbort, OP_COMM_ABORT, comm);
}

EXPORT ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    REAL(ncclCommDestroy);
    if (!enabled()) return real_ncclCommDestroy(comm);
    return comm_end(real_ncclCommDestroy, OP_COMM_DESTROY, comm);
}

