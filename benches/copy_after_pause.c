// Why a copy right after a short pause is slow on this host, and what helps: one 16 MiB
// copy with streaming (non-temporal) stores, as the store's batch copies make, timed
//   - back to back, after a 20 ms sleep, and after a 20 ms busy spin (a halted vCPU or a
//     lowered clock would slow the copy after the sleep only; caches and page tables that
//     other tenants evicted slow both);
//   - with 4 KiB pages or transparent huge pages on the source, the destination, or both;
//   - on one thread, with a helper spawned per copy, and with a kept helper woken by a
//     condition variable (both claim 1 MiB units from one counter, as batch_copy.rs does).
// The VM exposes no hardware counters to perf (cycles, dTLB and cache events are "not
// supported"), so the causes are told apart by these variations instead.
//
//   gcc -O2 -pthread -o /tmp/copy_after_pause benches/copy_after_pause.c && /tmp/copy_after_pause
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define SZ (16u << 20)
#define UNIT (1u << 20)
#define HUGE (2u << 20)
#define SAMPLES 41

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

enum pause { BACK_TO_BACK, SLEEP, SPIN };

static void pause_for(enum pause p) {
    if (p == SLEEP) {
        struct timespec t = {0, 20 * 1000 * 1000};
        nanosleep(&t, 0);
    } else if (p == SPIN) {
        double end = now() + 0.02;
        while (now() < end) {
        }
    }
}

// 2 MiB-aligned private memory, advised huge (before its first touch) when asked.
static char *region(int huge) {
    char *p = mmap(0, SZ + HUGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        perror("mmap");
        exit(1);
    }
    p = (char *)(((uintptr_t)p + HUGE - 1) & ~(uintptr_t)(HUGE - 1));
    if (huge)
        madvise(p, SZ, MADV_HUGEPAGE);
    memset(p, 1, SZ);
    return p;
}

__attribute__((target("avx2"))) static void stream_copy(char *d, const char *s, size_t n) {
    for (size_t i = 0; i < n; i += 64) {
        __m256i a = _mm256_loadu_si256((const void *)(s + i)), b = _mm256_loadu_si256((const void *)(s + i + 32));
        _mm256_stream_si256((void *)(d + i), a);
        _mm256_stream_si256((void *)(d + i + 32), b);
    }
    _mm_sfence();
}

static char *src, *dst;
static atomic_uint next_unit, units_done, helper_units;

static void drain(int helper) {
    unsigned mine = 0;
    for (;;) {
        unsigned i = atomic_fetch_add(&next_unit, 1);
        if (i >= SZ / UNIT)
            break;
        stream_copy(dst + (size_t)i * UNIT, src + (size_t)i * UNIT, UNIT);
        mine++;
    }
    if (helper)
        atomic_fetch_add(&helper_units, mine);
    atomic_fetch_add(&units_done, mine);
}

static void *spawned(void *a) {
    (void)a;
    drain(1);
    return 0;
}

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static unsigned generation;

static void *kept(void *a) {
    (void)a;
    unsigned seen = 0;
    for (;;) {
        pthread_mutex_lock(&mu);
        while (generation == seen)
            pthread_cond_wait(&cv, &mu);
        seen = generation;
        pthread_mutex_unlock(&mu);
        drain(1);
    }
    return 0;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

enum helpers { ONE_THREAD, SPAWNED, KEPT };

// Median GB/s of SAMPLES copies, and the share of units helpers copied.
static double run(enum pause p, enum helpers h, double *helper_share) {
    double t[SAMPLES];
    atomic_store(&helper_units, 0);
    for (int r = 0; r < SAMPLES; r++) {
        pause_for(p);
        double a = now();
        atomic_store(&next_unit, 0);
        atomic_store(&units_done, 0);
        pthread_t th;
        if (h == SPAWNED)
            pthread_create(&th, 0, spawned, 0);
        if (h == KEPT) {
            pthread_mutex_lock(&mu);
            generation++;
            pthread_cond_signal(&cv);
            pthread_mutex_unlock(&mu);
        }
        drain(0);
        while (atomic_load(&units_done) < SZ / UNIT) {
        }
        t[r] = now() - a;
        if (h == SPAWNED)
            pthread_join(th, 0);
    }
    qsort(t, SAMPLES, sizeof t[0], by_value);
    *helper_share = (double)atomic_load(&helper_units) / (SAMPLES * (SZ / UNIT));
    return SZ / t[SAMPLES / 2] / 1e9;
}

int main(void) {
    pthread_t k;
    pthread_create(&k, 0, kept, 0);
    const char *pauses[] = {"back to back", "after 20 ms sleep", "after 20 ms spin"};
    const char *pages[] = {"4K src, 4K dst", "huge src, 4K dst", "4K src, huge dst", "huge src, huge dst"};
    const char *helpers[] = {"one thread", "helper spawned per copy", "kept helper (condvar)"};
    double share;
    printf("16 MiB streaming copy, median of %d, GB/s\n", SAMPLES);
    for (int pg = 0; pg < 4; pg++) {
        src = region(pg & 1);
        dst = region(pg >> 1);
        printf("%-20s", pages[pg]);
        for (int p = 0; p < 3; p++)
            printf("  %s %5.2f", pauses[p], run(p, ONE_THREAD, &share));
        printf("\n");
    }
    for (int pg = 0; pg < 4; pg += 3) {
        src = region(pg & 1);
        dst = region(pg >> 1);
        for (int h = 1; h < 3; h++) {
            printf("%-20s %-24s", pages[pg], helpers[h]);
            for (int p = 0; p < 2; p++) {
                double g = run(p, h, &share);
                printf("  %s %5.2f (helper copied %2.0f%%)", pauses[p], g, share * 100);
            }
            printf("\n");
        }
    }
    return 0;
}
