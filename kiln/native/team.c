/* kiln's own thread team for its kernels' parallel loops (kiln_parallel).
 *
 * Why not OpenMP's: kiln sets OMP_WAIT_POLICY=PASSIVE (docs/cpu-executor.md, "Threads"), so
 * every parallel region wakes a sleeping thread and, with a static schedule, waits for it. On a
 * loaded machine the woken thread may not get a core for a whole time slice, and a model of
 * 50 layers of tens of microseconds each then took 4 ms one run and 0.9 ms the next. Here:
 *
 * - the caller works too, and items are claimed one chunk at a time from a shared counter, so
 *   a worker that is not running takes nothing: the caller does its share and waits only for
 *   chunks a worker has actually started (never slower than one thread by more than a chunk);
 * - a worker spins for SPIN_NS after its last chunk before it sleeps on a futex, so the
 *   layers of one run, microseconds apart, find it awake (onnxruntime's pool spins likewise),
 *   and a process that stops running kiln's kernels has no spinning thread after 0.1 ms;
 *   kiln_team_rest sends them to sleep at once (before threaded torch work in a program).
 *
 * One job at a time: a second caller (another thread, or a kernel inside an item) runs its
 * loop alone. After a fork the child has no workers; its callers do every chunk themselves
 * until the team is started again. */
#include "kernels.h"
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_WORKERS 63
#define SPIN_NS 100000L
#define CHUNKS_PER_THREAD 4

static struct {
    _Atomic unsigned int gen;  /* the futex word: the current job's number */
    _Atomic long claim;        /* (job number << 32) | the next chunk */
    _Atomic long done;         /* items finished */
    _Atomic(kiln_range_fn) fn;
    _Atomic(void *) ctx;
    _Atomic long n, chunk, chunks;
    _Atomic int sleepers;
    _Atomic unsigned int rest;  /* bumped by kiln_team_rest: spinning workers sleep now */
    int workers;               /* started (the lock holder reads and writes it) */
} T;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static long now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* The next chunk of job g, or -1 where the job has none left (or is over). */
static long claim(unsigned int g, long chunks)
{
    long v = atomic_load(&T.claim);
    for (;;) {
        if ((unsigned int)(v >> 32) != g || (v & 0xffffffffL) >= chunks)
            return -1;
        if (atomic_compare_exchange_weak(&T.claim, &v, v + 1))
            return v & 0xffffffffL;
    }
}

/* Run the chunks of job g that can be had; returns the items run. */
static long work(unsigned int g)
{
    kiln_range_fn fn = atomic_load(&T.fn);
    void *ctx = atomic_load(&T.ctx);
    long n = atomic_load(&T.n), chunk = atomic_load(&T.chunk), chunks = atomic_load(&T.chunks);
    long c, items = 0;
    while ((c = claim(g, chunks)) >= 0) {  /* (fields read past the job's end: no claim) */
        long i0 = c * chunk, i1 = i0 + chunk < n ? i0 + chunk : n;
        fn(ctx, i0, i1);
        items += i1 - i0;
    }
    return items;
}

static void *worker(void *arg)
{
    (void)arg;
    unsigned int seen = atomic_load(&T.gen);
    for (;;) {
        long t0 = now_ns(), spins = 0;
        unsigned int g, rest = atomic_load(&T.rest);
        while ((g = atomic_load(&T.gen)) == seen) {
            _mm_pause();
            if ((++spins & 63) == 0
                && (now_ns() - t0 > SPIN_NS || atomic_load(&T.rest) != rest)) {
                atomic_fetch_add(&T.sleepers, 1);
                if (atomic_load(&T.gen) == seen)
                    syscall(SYS_futex, &T.gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                atomic_fetch_sub(&T.sleepers, 1);
                t0 = now_ns();
                rest = atomic_load(&T.rest);
            }
        }
        seen = g;
        long items = work(g);
        if (items)
            atomic_fetch_add(&T.done, items);
    }
    return NULL;
}

static void forget_workers(void)
{
    T.workers = 0;  /* the child of a fork: its threads are gone */
    atomic_store(&T.sleepers, 0);
    pthread_mutex_init(&lock, NULL);
}

static void start_workers(int want)
{
    static int registered;
    if (!registered) {
        pthread_atfork(NULL, NULL, forget_workers);
        registered = 1;
    }
    if (want > MAX_WORKERS)
        want = MAX_WORKERS;
    while (T.workers < want) {
        pthread_t t;
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&t, &a, worker, NULL);
        pthread_attr_destroy(&a);
        if (failed)
            break;
        T.workers++;
    }
}

/* Spinning workers go to sleep at once (a caller about to run other threaded work: a native
 * program's torch record on torch's OpenMP threads, which a spinning worker would hold a core
 * from). The next kiln_parallel wakes them. */
void kiln_team_rest(void)
{
    atomic_fetch_add(&T.rest, 1);
}

/* fn(ctx, i0, i1) over [0, n) in chunks, on up to nthreads threads (the caller one of them). */
void kiln_parallel(long n, kiln_range_fn fn, void *ctx, int nthreads)
{
    if (n <= 0)
        return;
    if (nthreads > n)
        nthreads = (int)n;
    if (nthreads <= 1 || pthread_mutex_trylock(&lock) != 0) {
        fn(ctx, 0, n);
        return;
    }
    start_workers(nthreads - 1);
    long chunks = (long)(T.workers + 1) * CHUNKS_PER_THREAD;
    if (chunks > n)
        chunks = n;
    long chunk = (n + chunks - 1) / chunks;
    chunks = (n + chunk - 1) / chunk;
    unsigned int g = atomic_load(&T.gen) + 1;
    /* no chunk of the last job can be claimed from here on, not even by a worker that read
     * the new fields below (its claim names the last job) */
    atomic_store(&T.claim, ((long)g << 32) | 0xffffffffL);
    atomic_store(&T.fn, fn);
    atomic_store(&T.ctx, ctx);
    atomic_store(&T.n, n);
    atomic_store(&T.chunk, chunk);
    atomic_store(&T.chunks, chunks);
    atomic_store(&T.done, 0);
    atomic_store(&T.claim, (long)g << 32);
    atomic_store(&T.gen, g);
    if (atomic_load(&T.sleepers) > 0)
        syscall(SYS_futex, &T.gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    long mine = work(g);
    long spins = 0;
    while (atomic_load(&T.done) + mine < n) {  /* chunks a worker has started */
        _mm_pause();
        if ((++spins & 1023) == 0)
            sched_yield();  /* (a worker descheduled mid-chunk may want this core) */
    }
    pthread_mutex_unlock(&lock);
}
