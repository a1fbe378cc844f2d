// One copy between two processes by the kernel (issue 26, k26t): what the staged path's
// one-copy mode can reach at best on this host, next to a plain memcpy. A parent and a
// forked child each touch their own 64 MiB; the parent moves 128 KiB / 1 MiB / 4 MiB
// pieces, walking the 64 MiB (so the bytes come from memory, as a batch's do), four
// passes each, by
//   - memcpy inside the parent (the shm path's copy);
//   - process_vm_writev into the child (a staged read: region -> peer's buffer);
//   - process_vm_readv from the child (a staged write: peer's buffer -> region).
// Three repeats a size; GB/s. If the kernel's copy is well above half of memcpy, one copy
// by the server can reach the 0.5x of shm where two copies could not
// (benches/staged_copy_ceiling.c).
//
//   gcc -O2 -o /tmp/process_vm_copy_probe benches/process_vm_copy_probe.c && /tmp/process_vm_copy_probe
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define TOTAL (64UL << 20)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
    size_t sizes[] = {128UL << 10, 1UL << 20, 4UL << 20};
    char *a = aligned_alloc(4096, TOTAL), *b = aligned_alloc(4096, TOTAL);
    if (!a || !b) return 1;
    memset(a, 1, TOTAL);
    memset(b, 2, TOTAL);
    int ready[2];
    if (pipe(ready) != 0) return 1;
    pid_t child = fork();
    if (child == 0) {
        // The child's copy of `b` (same address) is its own once written.
        memset(b, 3, TOTAL);
        if (write(ready[1], "x", 1) != 1) return 1;
        pause();
        return 0;
    }
    char x;
    if (read(ready[0], &x, 1) != 1) return 1;
    for (int s = 0; s < 3; s++) {
        size_t n = sizes[s];
        int pieces = (int)(TOTAL / n);
        for (int rep = 0; rep < 3; rep++) {
            double t0 = now();
            for (int k = 0; k < pieces * 4; k++) {
                size_t o = (k % pieces) * n;
                memcpy(b + o, a + o, n);
            }
            double t1 = now();
            for (int k = 0; k < pieces * 4; k++) {
                size_t o = (k % pieces) * n;
                struct iovec l = {a + o, n}, r = {b + o, n};
                if (process_vm_writev(child, &l, 1, &r, 1, 0) != (ssize_t)n) { perror("process_vm_writev"); goto out; }
            }
            double t2 = now();
            for (int k = 0; k < pieces * 4; k++) {
                size_t o = (k % pieces) * n;
                struct iovec l = {a + o, n}, r = {b + o, n};
                if (process_vm_readv(child, &l, 1, &r, 1, 0) != (ssize_t)n) { perror("process_vm_readv"); goto out; }
            }
            double t3 = now();
            double gb = (double)TOTAL * 4 / 1e9;
            printf("%5zu KiB: memcpy %5.2f GB/s | process_vm_writev %5.2f (%.2fx) | process_vm_readv %5.2f (%.2fx)\n",
                   n >> 10, gb / (t1 - t0), gb / (t2 - t1), (t1 - t0) / (t2 - t1), gb / (t3 - t2), (t1 - t0) / (t3 - t2));
        }
    }
out:
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    return 0;
}
