/* A fake CUDA runtime: an event completes FAKE_GPU_MS milliseconds after it was recorded. */
#include <stdlib.h>
#include <time.h>
typedef struct { double recorded_ms; } event_t;
static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}
static double delay_ms(void) {
    const char *v = getenv("FAKE_GPU_MS");
    return v ? atof(v) : 20.0;
}
int cudaEventCreateWithFlags(void **ev, unsigned flags) {
    (void)flags;
    *ev = calloc(1, sizeof(event_t));
    return *ev ? 0 : 2;
}
int cudaEventRecord(void *ev, void *stream) {
    (void)stream;
    ((event_t *)ev)->recorded_ms = now_ms();
    return 0;
}
int cudaEventQuery(void *ev) { return now_ms() - ((event_t *)ev)->recorded_ms >= delay_ms() ? 0 : 600; }
int cudaEventElapsedTime(float *ms, void *start, void *end) {
    /* The end event is "reached" delay_ms after it was recorded; the start one right away. */
    *ms = (float)(((event_t *)end)->recorded_ms + delay_ms() - ((event_t *)start)->recorded_ms);
    return 0;
}
int cudaEventDestroy(void *ev) { free(ev); return 0; }
int cudaStreamIsCapturing(void *stream, int *status) { (void)stream; *status = 0; return 0; }
