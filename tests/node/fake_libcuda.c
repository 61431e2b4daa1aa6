/* A fake libcuda for the tests of agent/node/cuda_checkpoint.py and agent/node/suspend.py.
 *
 * It exports cuInit, cuDriverGetVersion, cuGetErrorName and (unless built with -DOLD_DRIVER,
 * which stands for a driver older than r570) the six cuCheckpointProcess* calls.  One process
 * state is kept and moved as the real driver documents: RUNNING -lock-> LOCKED -checkpoint->
 * CHECKPOINTED -restore-> LOCKED -unlock-> RUNNING.  A call in the wrong state returns
 * CUDA_ERROR_ILLEGAL_STATE (401).  fake_set_result(call_index, result) programs the next
 * result of one call; fake_* getters expose what the binding passed in.
 */
#include <string.h>

typedef int CUresult;
typedef unsigned long long cuuint64_t;
typedef struct { char bytes[16]; } CUuuid;
typedef struct { unsigned int timeoutMs; unsigned int reserved0; cuuint64_t reserved1[7]; } LockArgs;
typedef struct { cuuint64_t reserved[8]; } PlainArgs;
typedef struct { CUuuid oldUuid; CUuuid newUuid; } GpuPair;
typedef struct { GpuPair *gpuPairs; unsigned int gpuPairsCount; char reserved[44];
                 cuuint64_t reserved1; } RestoreArgs;

enum { RUNNING = 0, LOCKED = 1, CHECKPOINTED = 2, FAILED = 3 };
enum { C_STATE, C_TID, C_LOCK, C_CHECKPOINT, C_RESTORE, C_UNLOCK, C_COUNT };

static int state = RUNNING;
static int next_result[C_COUNT];
static int calls[C_COUNT];
static unsigned int last_timeout_ms;
static int nonzero_reserved;
static unsigned int last_pairs;
static char last_new_uuid[16];
static int version = 13000;

void fake_reset(void) {
    state = RUNNING; memset(next_result, 0, sizeof next_result); memset(calls, 0, sizeof calls);
    last_timeout_ms = 0; nonzero_reserved = 0; last_pairs = 0; version = 13000;
}
void fake_set_result(int call, int result) { next_result[call] = result; }
void fake_set_state(int s) { state = s; }
void fake_set_version(int v) { version = v; }
int fake_calls(int call) { return calls[call]; }
unsigned int fake_last_timeout_ms(void) { return last_timeout_ms; }
int fake_nonzero_reserved(void) { return nonzero_reserved; }
unsigned int fake_last_pairs(void) { return last_pairs; }
const char *fake_last_new_uuid(void) { return last_new_uuid; }

static int take(int call) {
    int r = next_result[call];
    next_result[call] = 0;
    calls[call]++;
    return r;
}
static void check_zero(const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) if (b[i]) { nonzero_reserved++; return; }
}

CUresult cuInit(unsigned int flags) { (void)flags; return 0; }
CUresult cuDriverGetVersion(int *v) { *v = version; return 0; }
CUresult cuGetErrorName(CUresult e, const char **s) { (void)e; *s = "FAKE"; return 0; }

#ifndef OLD_DRIVER
CUresult cuCheckpointProcessGetState(int pid, int *out) {
    (void)pid; int r = take(C_STATE); if (r) return r; *out = state; return 0;
}
CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid) {
    int r = take(C_TID); if (r) return r; *tid = pid + 1; return 0;
}
CUresult cuCheckpointProcessLock(int pid, LockArgs *a) {
    (void)pid; int r = take(C_LOCK); if (r) return r;
    last_timeout_ms = a->timeoutMs;
    check_zero(&a->reserved0, sizeof a->reserved0); check_zero(a->reserved1, sizeof a->reserved1);
    if (state != RUNNING) return 401;
    state = LOCKED; return 0;
}
CUresult cuCheckpointProcessCheckpoint(int pid, PlainArgs *a) {
    (void)pid; int r = take(C_CHECKPOINT); if (r) return r;
    check_zero(a, sizeof *a);
    if (state != LOCKED) return 401;
    state = CHECKPOINTED; return 0;
}
CUresult cuCheckpointProcessRestore(int pid, RestoreArgs *a) {
    (void)pid; int r = take(C_RESTORE); if (r) return r;
    check_zero(a->reserved, sizeof a->reserved); check_zero(&a->reserved1, sizeof a->reserved1);
    last_pairs = a->gpuPairsCount;
    if (a->gpuPairsCount) memcpy(last_new_uuid, a->gpuPairs[0].newUuid.bytes, 16);
    if (state != CHECKPOINTED) return 401;
    state = LOCKED; return 0;
}
CUresult cuCheckpointProcessUnlock(int pid, PlainArgs *a) {
    (void)pid; int r = take(C_UNLOCK); if (r) return r;
    check_zero(a, sizeof *a);
    if (state != LOCKED) return 401;
    state = RUNNING; return 0;
}
#endif
