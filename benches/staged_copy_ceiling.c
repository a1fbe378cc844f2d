// What the staged path (issue 26: restricted transfers on one host) can reach on this
// host at best, next to what shm does: the same bytes (16 requests of one size a batch,
// from a 64 MiB source to a 64 MiB destination) moved
//   - by one copy on one thread;
//   - by one copy split over two threads (shm's copy pool for a batch over 1 MiB);
//   - by two copies pipelined over two threads through a ring of four slots (the staged
//     path without its syscalls and wake-ups: thread A copies source -> slot, thread B
//     copies slot -> destination), with 128 KiB and 512 KiB slots; the hand-off yields
//     the CPU while it waits, so a loaded host does not turn it into a spin against the
//     other thread.
// If the pipelined row is below half the two-thread row, no scheduling of the staged
// path's two copies reaches 0.5x of shm on this host; only fewer bytes copied would.
//
//   gcc -O2 -pthread -o /tmp/staged_copy_ceiling benches/staged_copy_ceiling.c && /tmp/staged_copy_ceiling
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define ARENA (64UL << 20)
#define SLOTS 4

static char *src, *dst, *ring;
static size_t size, slot;
static int batches;
static _Atomic long filled, drained;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static long pieces(void) { return (long)(16 * size / slot) * batches; }

static void *fill_slots(void *unused) {
    (void)unused;
    for (long k = 0; k < pieces(); k++) {
        while (k - atomic_load(&drained) >= SLOTS) sched_yield();
        memcpy(ring + (k % SLOTS) * slot, src + (k * slot) % (16 * size), slot);
        atomic_store(&filled, k + 1);
    }
    return 0;
}

static void *drain_slots(void *unused) {
    (void)unused;
    for (long k = 0; k < pieces(); k++) {
        while (atomic_load(&filled) <= k) sched_yield();
        memcpy(dst + (k * slot) % (16 * size), ring + (k % SLOTS) * slot, slot);
        atomic_store(&drained, k + 1);
    }
    return 0;
}

typedef struct { size_t lo, hi; } Range;

static void *copy_range(void *p) {
    Range *r = p;
    for (int b = 0; b < batches; b++)
        for (size_t o = r->lo; o < r->hi; o += size) memcpy(dst + o, src + o, size);
    return 0;
}

int main(void) {
    src = mmap(0, ARENA, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    dst = mmap(0, ARENA, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ring = mmap(0, SLOTS << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    memset(src, 7, ARENA);
    memset(dst, 1, ARENA);
    memset(ring, 2, SLOTS << 20);
    size_t sizes[] = {128 << 10, 1 << 20, 4 << 20};
    for (int i = 0; i < 3; i++) {
        size = sizes[i];
        batches = (int)((4UL << 30) / (16 * size));
        double bytes = 16.0 * size * batches, t0;
        pthread_t a, b;
        Range all = {0, 16 * size}, lo = {0, 8 * size}, hi = {8 * size, 16 * size};
        t0 = now();
        copy_range(&all);
        double one = bytes / (now() - t0) / 1e9;
        t0 = now();
        pthread_create(&a, 0, copy_range, &lo);
        pthread_create(&b, 0, copy_range, &hi);
        pthread_join(a, 0);
        pthread_join(b, 0);
        double two = bytes / (now() - t0) / 1e9;
        printf("16 x %4zu KiB: one copy, 1 thread %5.2f GB/s | one copy, 2 threads %5.2f |", size >> 10, one, two);
        size_t slot_sizes[] = {128 << 10, 512 << 10};
        for (int s = 0; s < 2; s++) {
            slot = slot_sizes[s];
            atomic_store(&filled, 0);
            atomic_store(&drained, 0);
            t0 = now();
            pthread_create(&a, 0, fill_slots, 0);
            pthread_create(&b, 0, drain_slots, 0);
            pthread_join(a, 0);
            pthread_join(b, 0);
            double piped = bytes / (now() - t0) / 1e9;
            printf(" two copies pipelined, %zu KiB slots %5.2f (%.2fx of 2 threads) |", slot >> 10, piped, piped / two);
        }
        printf("\n");
    }
    return 0;
}
