/*
 * Running a kernel's parts on threads, for the fused kernels of commhooks (commhooks.cpu_kernels).
 */
#ifndef COMMHOOKS_PARALLEL_H
#define COMMHOOKS_PARALLEL_H

#include <stddef.h>
#include <stdint.h>

#define COMMHOOKS_MAX_THREADS 64

/* How many parts to cut `units` units of work into, `asked` at most: 1 to COMMHOOKS_MAX_THREADS,
 * never more than there are units. */
int commhooks_parts(int asked, int64_t units);

/* Run `work` on each of `count` parts laid out `size` bytes apart from `parts`: the first on the
 * calling thread, every other on a thread of its own, or on the calling thread where no thread
 * can be started. Returns once every part is done. */
void commhooks_run_parts(void *parts, size_t size, int count, void *(*work)(void *));

#endif
