# cython: boundscheck=False, wraparound=False, cdivision=True
"""rewarm's restore hot path: parallel pread of snapshot chunks into one caller-owned buffer.

``read_chunks`` runs ``threads`` POSIX threads with the GIL released.  Each thread takes the
next chunk from a shared atomic counter, reads it with ``pread`` straight into its place in the
destination buffer (O_DIRECT descriptor first; on EINVAL, e.g. a filesystem without direct I/O,
it falls back to the buffered descriptor for that chunk and counts it), then, when asked,
hashes the bytes it just read with XXH3-64 (xxhash.h, header-only) while they are still in
cache, and compares with the manifest's value.  Nothing is copied twice: the tensors handed to
callers are views into the same buffer.

``read_chunks(..., populate_ahead=True)`` adds one thread that faults the destination in
(MADV_POPULATE_WRITE) ahead of the readers, for a buffer never touched before (a fresh
process's copy path).

``hash_ranges`` hashes ranges of memory that is already mapped, faulting each piece in with a
madvise just before hashing it: the fresh-process restore maps the data file, locks it with
``lock_memory(onfault=True)`` (mlock2 MLOCK_ONFAULT) and verifies it this way, so the kernel
reads a cold file straight into the pages the tensors then use.

``read_into`` is the staged device restore's read (agent/snapshot/staged.py): one call reads
one range of a file into one staging slot on the calling thread (no thread is started), with
the GIL released, O_DIRECT first and buffered where that is refused, feeding each piece to a
streaming :class:`Xxh3` as it lands; its caller's own threads run many such calls at once.

Other helpers: ``xxh3_64(buffer)`` (the writer's and stager's hash), ``resident_fraction(path)``
(mincore: the share of a file's pages in the page cache, so the benchmark can say whether
dropping the cache took effect), ``populate(buffer)`` (fault a buffer in, GIL released).
"""

from libc.stdint cimport uint64_t, int64_t, uint8_t, uintptr_t
from libc.stdlib cimport malloc, free, calloc
from libc.errno cimport errno, EINTR, EINVAL
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE, PyBUF_WRITABLE
from posix.unistd cimport pread, close, sysconf
from posix.fcntl cimport open as c_open, O_RDONLY, O_NONBLOCK, O_CLOEXEC
from posix.mman cimport mmap, munmap, PROT_READ, MAP_SHARED, MAP_FAILED
from posix.stat cimport struct_stat, fstat, S_ISREG
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC

import os

cdef extern from "<sys/mman.h>" nogil:
    int mincore(void *addr, size_t length, unsigned char *vec)
    int madvise(void *addr, size_t length, int advice)
    int mlock(const void *addr, size_t length)
    int mlock2(const void *addr, size_t length, unsigned int flags)
    int MLOCK_ONFAULT
    int munlock(const void *addr, size_t length)

cdef extern from *:
    """
    #include <sys/mman.h>
    #ifndef MADV_POPULATE_READ
    #define MADV_POPULATE_READ 22      /* Linux 5.14 */
    #endif
    #ifndef MADV_POPULATE_WRITE
    #define MADV_POPULATE_WRITE 23
    #endif
    """
    int MADV_POPULATE_READ
    int MADV_POPULATE_WRITE

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
    void XXH3_copyState(XXH3_state_t *dst_state, const XXH3_state_t *src_state)
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
    static inline long long rw_load(long long *counter) {
        return __atomic_load_n(counter, __ATOMIC_RELAXED);
    }
    """
    long long rw_next(long long *counter) nogil
    long long rw_load(long long *counter) nogil


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
    int64_t populated      # bytes the populate-ahead thread faulted in (MADV_POPULATE_WRITE)
    int populate_err       # errno of its first failed madvise (it then stops), 0 if none
    int advice             # what the populate-ahead thread asks: MADV_POPULATE_WRITE or _READ
    int fault              # hash_ranges: madvise each piece with this before hashing it (0: none)
    int fault_err          # errno of a failed per-piece madvise, 0 if none


# Populate-ahead step: one madvise(MADV_POPULATE_WRITE) call faults in this many bytes, then
# the thread looks again at which chunk the readers have reached.
DEF POPULATE_STEP = 2 << 20


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


cdef int populate_range(uint8_t *start, int64_t length, int advice, int64_t *done) noexcept nogil:
    """madvise(advice) over [start, start + length) rounded out to pages, POPULATE_STEP at a time.
    Returns 0 or errno (EINVAL: the kernel predates MADV_POPULATE_*)."""
    cdef size_t page = <size_t>sysconf(_SC_PAGESIZE)
    cdef uintptr_t lo = (<uintptr_t>start) & ~(<uintptr_t>page - 1)
    cdef uintptr_t hi = (<uintptr_t>start + <uintptr_t>length + page - 1) & ~(<uintptr_t>page - 1)
    cdef uintptr_t step
    while lo < hi:
        step = POPULATE_STEP if hi - lo > POPULATE_STEP else hi - lo
        if madvise(<void *>lo, step, advice) != 0:
            if errno == EINTR:
                continue
            return errno
        lo += step
        done[0] += <int64_t>step
    return 0


cdef void *populator(void *arg) noexcept nogil:
    """Fault in the destination of the chunks the readers have not reached yet, in job order.

    MADV_POPULATE_WRITE allocates (and zeroes) the pages without changing what is already
    there, so racing a reader that has started on the same chunk is harmless: whichever comes
    first faults the page in.  Chunks the readers already took are skipped (they fault their
    own pages), so the thread's work is never behind them."""
    cdef Shared *sh = <Shared *>arg
    cdef long long i = 0, taken
    cdef Job *job
    cdef int rc
    while i < sh.njobs:
        taken = rw_load(&sh.next)
        if taken > i:
            i = taken
            if i >= sh.njobs:
                break
        job = &sh.jobs[i]
        rc = populate_range(sh.base + job.buf_offset, job.length, sh.advice, &sh.populated)
        if rc != 0:
            sh.populate_err = rc
            break
        i += 1
    return NULL


def populate(object buffer, bint write=True, long long offset=0, long long length=-1):
    """Fault in ``buffer[offset:offset + length]`` (all of it by default) with the GIL released:
    madvise(MADV_POPULATE_WRITE) (allocate and zero anonymous pages; page-cache pages made
    writable, copy-on-write broken for private maps) or, with ``write=False``,
    MADV_POPULATE_READ (map page-cache pages, read them from disk if needed, no copy).
    Returns the bytes covered.  Raises OSError (EINVAL: kernel older than 5.14) or ValueError."""
    cdef Py_buffer view
    cdef int rc
    cdef int64_t done = 0
    PyObject_GetBuffer(buffer, &view, PyBUF_SIMPLE)
    try:
        if length < 0:
            length = view.len - offset
        if offset < 0 or offset + length > view.len:
            raise ValueError(f"range [{offset}, {offset + length}) outside buffer of {view.len} bytes")
        with nogil:
            rc = populate_range(<uint8_t *>view.buf + offset, length,
                                MADV_POPULATE_WRITE if write else MADV_POPULATE_READ, &done)
        if rc != 0:
            raise OSError(rc, f"madvise(MADV_POPULATE_{'WRITE' if write else 'READ'}): {os.strerror(rc)}")
        return done
    finally:
        PyBuffer_Release(&view)


def read_chunks(object buffer, list jobs, int threads=2, bint verify=True,
                long long piece_bytes=1 << 20, bint populate_ahead=False):
    """Read chunks in parallel into ``buffer`` (writable, page-aligned for O_DIRECT).

    jobs: list of tuples ``(fd_direct, fd_buffered, file_offset, length, buf_offset,
    expected_xxh3)``; fd_direct is -1 where no O_DIRECT descriptor could be opened.
    Returns a list of tuples ``(err, short_read, used_direct, actual_xxh3)``, one per job, in
    order (actual is 0 when not verifying).  ``piece_bytes``: each pread's size (a multiple of
    4096 for O_DIRECT); each piece is hashed right after it lands, while still in cache.
    ``populate_ahead``: one more thread faults in the destination pages of the chunks not yet
    taken (see ``populator``), so a buffer that was never touched does not make each read wait
    for its own page faults.  Raises ValueError when a job falls outside the buffer; read
    errors are reported per job, not raised, so the caller can name the chunk.
    ``last_populated()`` afterwards gives (bytes populated ahead, errno of a failed madvise).
    """
    cdef Py_buffer view
    cdef Shared sh
    cdef long long n = len(jobs)
    cdef long long i
    cdef int t, nthreads
    cdef pthread_t *tids
    cdef pthread_t ptid
    cdef int started = 0, pstarted = 0
    global _last_populated, _last_populate_err
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
        sh.populated = 0
        sh.populate_err = 0
        sh.advice = MADV_POPULATE_WRITE
        nthreads = threads if threads < n else (<int>n if n > 0 else 1)
        with nogil:
            if populate_ahead and n > 0:
                pstarted = pthread_create(&ptid, NULL, populator, &sh) == 0
            for t in range(nthreads):
                if pthread_create(&tids[t], NULL, worker, &sh) != 0:
                    break
                started += 1
            if started == 0:
                worker(&sh)  # no thread could start: do the work on this one
            for t in range(started):
                pthread_join(tids[t], NULL)
            if pstarted:
                pthread_join(ptid, NULL)
        _last_populated, _last_populate_err = sh.populated, sh.populate_err
        return [(sh.jobs[i].err, sh.jobs[i].short_read, sh.jobs[i].used_direct,
                 sh.jobs[i].actual) for i in range(n)]
    finally:
        free(sh.jobs)
        free(tids)
        PyBuffer_Release(&view)


cdef void *hasher(void *arg) noexcept nogil:
    """Hash jobs in place (``base + buf_offset``, ``length`` bytes): no read, the bytes are
    already mapped.  With ``sh.fault`` set, each piece is first faulted in with that madvise
    (MADV_POPULATE_WRITE on a private file map: the kernel copies the page-cache page into a
    private anonymous page, reading it from disk first if needed) and hashed right after,
    while it is in cache; the hash then covers the private copy, the bytes the caller keeps."""
    cdef Shared *sh = <Shared *>arg
    cdef long long i
    cdef Job *job
    cdef XXH3_state_t *state = XXH3_createState()
    cdef int64_t done, step, ignored
    cdef int rc
    if state == NULL:
        return NULL
    while True:
        i = rw_next(&sh.next)
        if i >= sh.njobs:
            break
        job = &sh.jobs[i]
        XXH3_64bits_reset(state)
        done = 0
        while done < job.length:
            step = sh.piece if job.length - done > sh.piece else job.length - done
            if sh.fault:
                rc = populate_range(sh.base + job.buf_offset + done, step, sh.fault, &ignored)
                if rc != 0:
                    job.err = rc
                    sh.fault_err = rc
                    break
            if sh.verify:
                rw_update(state, sh.base + job.buf_offset + done, <size_t>step)
            done += step
        job.actual = XXH3_64bits_digest(state) if sh.verify else 0
    XXH3_freeState(state)
    return NULL


_ADVICE = {"none": 0, "read": MADV_POPULATE_READ, "write": MADV_POPULATE_WRITE, "willneed": 3}


def hash_ranges(object buffer, list ranges, int threads=2, str ahead="none", str fault="none",
                long long piece_bytes=256 << 10, bint verify=True):
    """XXH3-64 of each ``(offset, length)`` range of ``buffer``, ``threads`` POSIX threads with
    the GIL released; returns ``(hashes, errnos)``, lists in range order (errno 0: hashed).

    ``fault``: "write" faults each piece in with MADV_POPULATE_WRITE just before hashing it (on
    a private file map this makes the private copy the hash then covers), "read" with
    MADV_POPULATE_READ, "none" lets the hash's loads fault.  ``ahead``: a further thread asks
    the kernel for the ranges not yet taken: "willneed" (MADV_WILLNEED: start the disk reads,
    do not wait), "read"/"write" (populate them), "none".  Raises ValueError when a range falls
    outside the buffer.  A page that cannot be read with ``fault="none"`` raises SIGBUS (a file
    truncated under its map): callers check sizes first or fault with madvise, which reports
    EFAULT per range instead.  ``verify=False``: fault the pieces in only (hashes are 0)."""
    cdef Py_buffer view
    cdef Shared sh
    cdef long long n = len(ranges)
    cdef long long i
    cdef int t, nthreads, started = 0, pstarted = 0
    cdef pthread_t *tids
    cdef pthread_t ptid
    if threads < 1:
        raise ValueError(f"threads={threads} must be at least 1")
    if ahead not in _ADVICE or fault not in _ADVICE or fault == "willneed":
        raise ValueError(f"ahead={ahead!r} / fault={fault!r}: choose from {sorted(_ADVICE)}")
    if piece_bytes < 4096 or piece_bytes % 4096:
        raise ValueError(f"piece_bytes={piece_bytes} must be a positive multiple of 4096")
    PyObject_GetBuffer(buffer, &view, PyBUF_SIMPLE)
    sh.jobs = <Job *>calloc(n if n > 0 else 1, sizeof(Job))
    tids = <pthread_t *>calloc(threads, sizeof(pthread_t))
    if sh.jobs == NULL or tids == NULL:
        free(sh.jobs); free(tids); PyBuffer_Release(&view)
        raise MemoryError(f"job table for {n} ranges")
    try:
        for i in range(n):
            off, length = ranges[i]
            if off < 0 or length < 0 or off + length > view.len:
                raise ValueError(f"range {i}: [{off}, {off + length}) outside buffer of {view.len} bytes")
            sh.jobs[i].buf_offset = off
            sh.jobs[i].length = length
        sh.njobs, sh.next, sh.base, sh.piece = n, 0, <uint8_t *>view.buf, piece_bytes
        sh.populated, sh.populate_err, sh.advice = 0, 0, _ADVICE[ahead]
        sh.fault, sh.fault_err, sh.verify = _ADVICE[fault], 0, verify
        nthreads = threads if threads < n else (<int>n if n > 0 else 1)
        with nogil:
            if sh.advice and n > 0:
                pstarted = pthread_create(&ptid, NULL, populator, &sh) == 0
            for t in range(nthreads):
                if pthread_create(&tids[t], NULL, hasher, &sh) != 0:
                    break
                started += 1
            if started == 0:
                hasher(&sh)
            for t in range(started):
                pthread_join(tids[t], NULL)
            if pstarted:
                pthread_join(ptid, NULL)
        return [sh.jobs[i].actual for i in range(n)], [sh.jobs[i].err for i in range(n)]
    finally:
        free(sh.jobs)
        free(tids)
        PyBuffer_Release(&view)


def lock_memory(object buffer, bint lock=True, bint onfault=False):
    """mlock(2) (or munlock) all of ``buffer``: its pages stay resident, so the pages of a file
    map cannot be evicted and then read again from disk after they were verified.
    ``onfault``: mlock2(MLOCK_ONFAULT), which locks each page when it is first faulted in
    instead of faulting them all now; on a writable private file map plain mlock would break
    copy-on-write and copy every page, while with ``onfault`` read faults (MADV_POPULATE_READ)
    lock the page-cache pages themselves.  Raises OSError (ENOMEM or EAGAIN over
    RLIMIT_MEMLOCK without CAP_IPC_LOCK, EINVAL where MLOCK_ONFAULT is unknown)."""
    cdef Py_buffer view
    cdef int rc
    PyObject_GetBuffer(buffer, &view, PyBUF_SIMPLE)
    try:
        with nogil:
            if not lock:
                rc = munlock(view.buf, <size_t>view.len)
            elif onfault:
                rc = mlock2(view.buf, <size_t>view.len, MLOCK_ONFAULT)
            else:
                rc = mlock(view.buf, <size_t>view.len)
        if rc != 0:
            err = errno
            raise OSError(err, f"{'mlock' if lock else 'munlock'} of {view.len} bytes: {os.strerror(err)}")
    finally:
        PyBuffer_Release(&view)


_last_populated = 0
_last_populate_err = 0


def last_populated():
    """(bytes the last read_chunks call populated ahead, errno of its failed madvise or 0)."""
    return _last_populated, _last_populate_err


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


# --- the staged device restore's read: one range into one slot, on the caller's thread ------

cdef inline int64_t now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef int read_timed(int fd, uint8_t *dst, int64_t length, int64_t offset, int64_t piece,
                    XXH3_state_t *state, int *short_read, int64_t *read_ns,
                    int64_t *hash_ns) noexcept nogil:
    """``read_full`` with the time spent in pread and in hashing added to ``read_ns`` and
    ``hash_ns``: pread ``length`` bytes in pieces of ``piece``, each piece fed to ``state``
    (when not NULL) right after it lands.  Returns 0 or errno; EOF sets short_read."""
    cdef int64_t done = 0, step, part, t0, t1
    cdef ssize_t got
    while done < length:
        step = piece if length - done > piece else length - done
        part = 0
        t0 = now_ns()
        while part < step:
            got = pread(fd, dst + done + part, <size_t>(step - part), offset + done + part)
            if got < 0:
                if errno == EINTR:
                    continue
                read_ns[0] += now_ns() - t0
                return errno
            if got == 0:
                short_read[0] = 1
                read_ns[0] += now_ns() - t0
                return 0
            part += got
        t1 = now_ns()
        read_ns[0] += t1 - t0
        if state != NULL:
            rw_update(state, dst + done, <size_t>step)
            hash_ns[0] += now_ns() - t1
        done += step
    return 0


cdef class Xxh3:
    """A streaming XXH3-64 state (xxhash.h ``XXH3_state_t``) fed by :func:`read_into`, so one
    chunk's hash can run across several slot fills: ``reset()``, ``update(buffer)`` (GIL
    released), ``digest()``.  The digest of all the bytes fed since the last reset equals
    ``xxh3_64`` of them laid end to end.  Not thread-safe: one per thread."""

    cdef XXH3_state_t *state
    cdef XXH3_state_t *saved      # read_into's copy, to undo a refused O_DIRECT attempt

    def __cinit__(self):
        self.state = XXH3_createState()
        self.saved = XXH3_createState()
        if self.state == NULL or self.saved == NULL:
            raise MemoryError("XXH3 state")
        XXH3_64bits_reset(self.state)

    def __dealloc__(self):
        if self.state != NULL:
            XXH3_freeState(self.state)
        if self.saved != NULL:
            XXH3_freeState(self.saved)

    def reset(self):
        XXH3_64bits_reset(self.state)

    def update(self, object data):
        cdef Py_buffer view
        PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
        try:
            with nogil:
                rw_update(self.state, view.buf, <size_t>view.len)
        finally:
            PyBuffer_Release(&view)

    def digest(self):
        return XXH3_64bits_digest(self.state)


def read_into(object buffer, long long buf_offset, long long length, int fd_direct,
              int fd_buffered, long long file_offset, long long piece_bytes=256 << 10,
              long long direct_piece_bytes=8 << 20, Xxh3 hasher=None):
    """pread ``length`` bytes at ``file_offset`` into ``buffer[buf_offset:buf_offset + length]``
    on the calling thread, the GIL released; with ``hasher``, feed each piece to it as it lands.

    ``fd_direct`` (O_DIRECT, or -1) is tried first, in pieces of ``direct_piece_bytes``; when
    the kernel refuses it (EINVAL: a filesystem without direct I/O, or a destination, offset or
    length not aligned to the device's logical block) the range is read again through
    ``fd_buffered`` in pieces of ``piece_bytes`` (small enough to be hashed while still in L2),
    the hasher put back to where it was before the attempt.  Returns ``(err, short_read,
    used_direct, read_ns, hash_ns)``: errno of a failed read (0: none), 1 when the file ended
    first, 1 when O_DIRECT served the range, and the nanoseconds spent in pread and in hashing.
    Raises ValueError for a range outside the buffer or a piece size that is not a positive
    multiple of 4096; read errors are returned, not raised, so the caller can name the chunk."""
    cdef Py_buffer view
    cdef int rc = EINVAL, short_read = 0, used_direct = 0
    cdef int64_t read_ns = 0, hash_ns = 0
    cdef XXH3_state_t *state = NULL
    cdef XXH3_state_t *saved = NULL
    cdef uint8_t *dst
    for name, value in (("piece_bytes", piece_bytes), ("direct_piece_bytes", direct_piece_bytes)):
        if value < 4096 or value % 4096:
            raise ValueError(f"{name}={value} must be a positive multiple of 4096")
    if length < 0 or file_offset < 0:
        raise ValueError(f"length={length}, file_offset={file_offset} must be >= 0")
    PyObject_GetBuffer(buffer, &view, PyBUF_SIMPLE | PyBUF_WRITABLE)
    try:
        if buf_offset < 0 or buf_offset + length > view.len:
            raise ValueError(f"range [{buf_offset}, {buf_offset + length}) outside buffer of "
                             f"{view.len} bytes")
        dst = <uint8_t *>view.buf + buf_offset
        if hasher is not None:
            state, saved = hasher.state, hasher.saved
        with nogil:
            if fd_direct >= 0:
                if state != NULL:
                    XXH3_copyState(saved, state)
                rc = read_timed(fd_direct, dst, length, file_offset, direct_piece_bytes, state,
                                &short_read, &read_ns, &hash_ns)
                if rc == 0:
                    used_direct = 1
            if rc == EINVAL:     # no direct I/O for this range: buffered, hashing it anew
                short_read = 0
                if state != NULL and fd_direct >= 0:
                    XXH3_copyState(state, saved)
                rc = read_timed(fd_buffered, dst, length, file_offset, piece_bytes, state,
                                &short_read, &read_ns, &hash_ns)
        return rc, short_read, used_direct, read_ns, hash_ns
    finally:
        PyBuffer_Release(&view)
