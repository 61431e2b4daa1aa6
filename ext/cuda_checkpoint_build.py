"""cffi build script for the CUDA checkpoint driver API binding (out-of-line, ABI mode).

``setup.py`` builds ``ffibuilder`` into ``agent/_cuda_checkpoint``: a module holding only the
type declarations below; no C compiler and no CUDA toolkit are needed to build it, and the
driver library is opened at run time with ``ffi.dlopen("libcuda.so.1")`` by
:mod:`agent.node.cuda_checkpoint`.

The declarations are written from the CUDA 13 ``cuda.h`` (section "CUDA Checkpointing",
driver API r570+).  Struct layouts are fixed-size on purpose: the driver requires the
``reserved`` fields to be zero, and cffi's ``ffi.new`` zero-fills every struct it allocates.
``CUcheckpointRestoreArgs.reserved`` is ``52 - sizeof(pointer)`` bytes in the header; on the
64-bit Linux targets the driver supports that is 44 bytes.
"""

from cffi import FFI

CDEF = """
typedef int CUresult;
typedef unsigned long long cuuint64_t;

typedef enum CUprocessState_enum {
    CU_PROCESS_STATE_RUNNING = 0,
    CU_PROCESS_STATE_LOCKED = 1,
    CU_PROCESS_STATE_CHECKPOINTED = 2,
    CU_PROCESS_STATE_FAILED = 3
} CUprocessState;

typedef struct CUuuid_st {
    char bytes[16];
} CUuuid;

typedef struct CUcheckpointLockArgs_st {
    unsigned int timeoutMs;
    unsigned int reserved0;
    cuuint64_t reserved1[7];
} CUcheckpointLockArgs;

typedef struct CUcheckpointCheckpointArgs_st {
    cuuint64_t reserved[8];
} CUcheckpointCheckpointArgs;

typedef struct CUcheckpointGpuPair_st {
    CUuuid oldUuid;
    CUuuid newUuid;
} CUcheckpointGpuPair;

typedef struct CUcheckpointRestoreArgs_st {
    CUcheckpointGpuPair *gpuPairs;
    unsigned int gpuPairsCount;
    char reserved[44];
    cuuint64_t reserved1;
} CUcheckpointRestoreArgs;

typedef struct CUcheckpointUnlockArgs_st {
    cuuint64_t reserved[8];
} CUcheckpointUnlockArgs;

CUresult cuInit(unsigned int flags);
CUresult cuDriverGetVersion(int *driverVersion);
CUresult cuGetErrorName(CUresult error, const char **pStr);
CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid);
CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state);
CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args);
CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args);
CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args);
CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args);
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source("agent._cuda_checkpoint", None)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
