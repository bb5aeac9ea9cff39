/*
 * Running a kernel's parts on threads (see _parallel.h). Threads are started per call: the
 * callers ask for one per 2^18 elements at least, whose work outlasts a thread's start.
 */
#include "_parallel.h"

#include <pthread.h>

int commhooks_parts(int asked, int64_t units)
{
    int64_t parts = asked < COMMHOOKS_MAX_THREADS ? asked : COMMHOOKS_MAX_THREADS;
    if (parts > units)
        parts = units;
    return parts < 1 ? 1 : (int)parts;
}

void commhooks_run_parts(void *parts, size_t size, int count, void *(*work)(void *))
{
    char *first = parts;
    pthread_t ids[COMMHOOKS_MAX_THREADS];
    int started[COMMHOOKS_MAX_THREADS] = {0};
    for (int t = 1; t < count; t++)
        started[t] = pthread_create(&ids[t], NULL, work, first + t * size) == 0;
    work(first);
    for (int t = 1; t < count; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            work(first + t * size); /* no thread to be had: do its share here */
    }
}
