# cython: boundscheck=False, wraparound=False, cdivision=True
"""rewarm's restore hot path: parallel pread of snapshot chunks into one caller-owned buffer.

``read_chunks`` runs ``threads`` POSIX threads with the GIL released.  Each thread takes the
next chunk from a shared atomic counter, reads it with ``pread`` straight into its place in the
destination buffer (O_DIRECT descriptor first; on EINVAL, e.g. a filesystem without direct I/O,
it falls back to the buffered descriptor for that chunk and counts it), then, when asked,
hashes the bytes it just read with XXH3-64 (xxhash.h, header-only) while they are still in
cache, and compares with the manifest's value.  Nothing is copied twice: the tensors handed to
callers are views into the same buffer.

Other helpers: ``xxh3_64(buffer)`` (the writer's and stager's hash), ``resident_fraction(path)``
(mincore: the share of a file's pages in the page cache, so the benchmark can say whether
dropping the cache took effect).
"""

from libc.stdint cimport uint64_t, int64_t, uint8_t
from libc.stdlib cimport malloc, free, calloc
from libc.errno cimport errno, EINTR, EINVAL
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE, PyBUF_WRITABLE
from posix.unistd cimport pread, close, sysconf
from posix.fcntl cimport open as c_open, O_RDONLY, O_NONBLOCK, O_CLOEXEC
from posix.mman cimport mmap, munmap, PROT_READ, MAP_SHARED, MAP_FAILED
from posix.stat cimport struct_stat, fstat, S_ISREG

import os

cdef extern from "<sys/mman.h>" nogil:
    int mincore(void *addr, size_t length, unsigned char *vec)

cdef extern from "<unistd.h>" nogil:
    int _SC_PAGESIZE

cdef extern from "xxh3_dispatch.h" nogil:
    # xxhash.h, included by xxh3_dispatch.h with its run-time kernel choice
    ctypedef unsigned long long XXH64_hash_t
    ctypedef struct XXH3_state_t:
        pass
    XXH64_hash_t XXH3_64bits(const void *data, size_t length)
    XXH3_state_t *XXH3_createState()
    int XXH3_freeState(XXH3_state_t *state)
    int XXH3_64bits_reset(XXH3_state_t *state)
    int XXH3_64bits_update(XXH3_state_t *state, const void *data, size_t length)
    XXH64_hash_t XXH3_64bits_digest(const XXH3_state_t *state)
    int rw_update(XXH3_state_t *state, const void *data, size_t length)
    const char *rw_update_name
    void rw_pick_update()
    int rw_force_update(const char *name)

cdef extern from "<pthread.h>" nogil:
    ctypedef unsigned long pthread_t
    int pthread_create(pthread_t *thread, const void *attr,
                       void *(*start)(void *) noexcept nogil, void *arg)
    int pthread_join(pthread_t thread, void **retval)

cdef extern from *:
    """
    static inline long long rw_next(long long *counter) {
        return __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED);
    }
    """
    long long rw_next(long long *counter) nogil


# One chunk's job; the outputs are filled by the thread that read it.
cdef struct Job:
    int fd_direct          # O_DIRECT descriptor, or -1
    int fd_buffered        # buffered descriptor of the same file
    int64_t file_offset    # bytes into the file
    int64_t length         # bytes to read
    int64_t buf_offset     # bytes into the destination buffer
    uint64_t expected      # XXH3-64 from the manifest
    uint64_t actual        # XXH3-64 of what landed (when verifying)
    int err                # errno of a failed read, 0 if none
    int short_read         # 1 if the file ended before length bytes
    int used_direct        # 1 if read through the O_DIRECT descriptor


cdef struct Shared:
    Job *jobs
    long long njobs
    long long next
    uint8_t *base
    int verify
    int64_t piece          # read (and hash) unit, bytes; the hash runs while the piece is in cache


cdef int read_full(int fd, uint8_t *dst, int64_t length, int64_t offset, int64_t piece,
                   XXH3_state_t *state, int *short_read) noexcept nogil:
    """pread ``length`` bytes in pieces, feeding each piece to ``state`` (when not NULL) right
    after it lands, while it is still in the CPU cache.  Returns 0 or errno; EOF sets short_read."""
    cdef int64_t done = 0, step, part
    cdef ssize_t got
    while done < length:
        step = piece if length - done > piece else length - done
        part = 0
        while part < step:
            got = pread(fd, dst + done + part, <size_t>(step - part), offset + done + part)
            if got < 0:
                if errno == EINTR:
                    continue
                return errno
            if got == 0:
                short_read[0] = 1
                return 0
            part += got
        if state != NULL:
            rw_update(state, dst + done, <size_t>step)
        done += step
    return 0


cdef void *worker(void *arg) noexcept nogil:
    cdef Shared *sh = <Shared *>arg
    cdef long long i
    cdef Job *job
    cdef int rc
    cdef XXH3_state_t *state = NULL
    if sh.verify:
        state = XXH3_createState()
        if state == NULL:
            return NULL  # the jobs this thread would have taken go to the others
    while True:
        i = rw_next(&sh.next)
        if i >= sh.njobs:
            break
        job = &sh.jobs[i]
        rc = EINVAL
        if state != NULL:
            XXH3_64bits_reset(state)
        if job.fd_direct >= 0:
            rc = read_full(job.fd_direct, sh.base + job.buf_offset, job.length,
                           job.file_offset, sh.piece, state, &job.short_read)
            if rc == 0:
                job.used_direct = 1
        if rc == EINVAL:  # no direct I/O here: read it buffered, hashing from the start again
            job.short_read = 0
            if state != NULL:
                XXH3_64bits_reset(state)
            rc = read_full(job.fd_buffered, sh.base + job.buf_offset, job.length,
                           job.file_offset, sh.piece, state, &job.short_read)
        job.err = rc
        if rc == 0 and not job.short_read and state != NULL:
            job.actual = XXH3_64bits_digest(state)
    if state != NULL:
        XXH3_freeState(state)
    return NULL


def read_chunks(object buffer, list jobs, int threads=2, bint verify=True,
                long long piece_bytes=1 << 20):
    """Read chunks in parallel into ``buffer`` (writable, page-aligned for O_DIRECT).

    jobs: list of tuples ``(fd_direct, fd_buffered, file_offset, length, buf_offset,
    expected_xxh3)``; fd_direct is -1 where no O_DIRECT descriptor could be opened.
    Returns a list of tuples ``(err, short_read, used_direct, actual_xxh3)``, one per job, in
    order (actual is 0 when not verifying).  ``piece_bytes``: each pread's size (a multiple of
    4096 for O_DIRECT); each piece is hashed right after it lands, while still in cache.  Raises ValueError when a job falls outside the
    buffer; read errors are reported per job, not raised, so the caller can name the chunk.
    """
    cdef Py_buffer view
    cdef Shared sh
    cdef long long n = len(jobs)
    cdef long long i
    cdef int t, nthreads
    cdef pthread_t *tids
    cdef int started = 0
    if threads < 1:
        raise ValueError(f"threads={threads} must be at least 1")
    if piece_bytes < 4096 or piece_bytes % 4096:
        raise ValueError(f"piece_bytes={piece_bytes} must be a positive multiple of 4096")
    PyObject_GetBuffer(buffer, &view, PyBUF_SIMPLE | PyBUF_WRITABLE)
    sh.jobs = <Job *>calloc(n if n > 0 else 1, sizeof(Job))
    tids = <pthread_t *>calloc(threads, sizeof(pthread_t))
    if sh.jobs == NULL or tids == NULL:
        free(sh.jobs); free(tids); PyBuffer_Release(&view)
        raise MemoryError(f"job table for {n} chunks")
    try:
        for i in range(n):
            fd_d, fd_b, foff, length, boff, expected = jobs[i]
            if boff < 0 or length < 0 or boff + length > view.len:
                raise ValueError(f"job {i}: buffer range [{boff}, {boff + length}) outside "
                                 f"buffer of {view.len} bytes")
            sh.jobs[i].fd_direct = fd_d
            sh.jobs[i].fd_buffered = fd_b
            sh.jobs[i].file_offset = foff
            sh.jobs[i].length = length
            sh.jobs[i].buf_offset = boff
            sh.jobs[i].expected = expected
        sh.njobs = n
        sh.next = 0
        sh.base = <uint8_t *>view.buf
        sh.verify = verify
        sh.piece = piece_bytes
        nthreads = threads if threads < n else (<int>n if n > 0 else 1)
        with nogil:
            for t in range(nthreads):
                if pthread_create(&tids[t], NULL, worker, &sh) != 0:
                    break
                started += 1
            if started == 0:
                worker(&sh)  # no thread could start: do the work on this one
            for t in range(started):
                pthread_join(tids[t], NULL)
        return [(sh.jobs[i].err, sh.jobs[i].short_read, sh.jobs[i].used_direct,
                 sh.jobs[i].actual) for i in range(n)]
    finally:
        free(sh.jobs)
        free(tids)
        PyBuffer_Release(&view)


rw_pick_update()


def hash_kernel(str force=None):
    """The XXH3 vector kernel in use ("avx512", "avx2" or "default"); ``force`` selects one
    (tests compare them).  Raises ValueError if ``force`` is not available here."""
    if force is not None and rw_force_update(force.encode()) != 0:
        raise ValueError(f"XXH3 kernel {force!r} not available on this CPU or build")
    return rw_update_name.decode()


def xxh3_64(object data):
    """XXH3-64 of a bytes-like object (any contiguous buffer), computed with the GIL released."""
    cdef Py_buffer view
    cdef uint64_t h
    cdef XXH3_state_t *state = XXH3_createState()
    if state == NULL:
        raise MemoryError("XXH3 state")
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        with nogil:
            XXH3_64bits_reset(state)
            rw_update(state, view.buf, <size_t>view.len)
            h = XXH3_64bits_digest(state)
        return h
    finally:
        PyBuffer_Release(&view)
        XXH3_freeState(state)


def resident_fraction(object path):
    """Share (0.0..1.0) of a file's pages that are in the page cache, from mincore(2).

    ``path``: a file name (opened with O_NONBLOCK, so a FIFO cannot block the caller) or an
    open descriptor (int; not closed).  Returns 0.0 for an empty file.  Raises OSError naming
    the path when it cannot be opened or mapped, or is not a regular file.
    """
    cdef bytes p
    cdef int fd
    cdef bint own = not isinstance(path, int)
    cdef struct_stat st
    cdef void *addr
    cdef unsigned char *vec
    cdef size_t page = <size_t>sysconf(_SC_PAGESIZE)
    cdef size_t npages, k, resident = 0
    if own:
        p = os.fsencode(path)
        fd = c_open(p, O_RDONLY | O_NONBLOCK | O_CLOEXEC)
        if fd < 0:
            err = errno
            raise OSError(err, f"cannot open {path}: {os.strerror(err)}")
    else:
        fd = path
    try:
        if fstat(fd, &st) != 0:
            raise OSError(errno, f"cannot stat {path}")
        if not S_ISREG(st.st_mode):
            raise OSError(EINVAL, f"{path} is not a regular file")
        if st.st_size == 0:
            return 0.0
        npages = (<size_t>st.st_size + page - 1) // page
        addr = mmap(NULL, <size_t>st.st_size, PROT_READ, MAP_SHARED, fd, 0)
        if addr == MAP_FAILED:
            raise OSError(errno, f"cannot mmap {path}")
        vec = <unsigned char *>malloc(npages)
        try:
            if vec == NULL:
                raise MemoryError(f"mincore vector of {npages} pages for {path}")
            if mincore(addr, <size_t>st.st_size, vec) != 0:
                raise OSError(errno, f"mincore failed on {path}")
            for k in range(npages):
                resident += vec[k] & 1
            return resident / <double>npages
        finally:
            free(vec)
            munmap(addr, <size_t>st.st_size)
    finally:
        if own:
            close(fd)
