/*
 * engram-bench engines, the C side: N steps through libengram_rack, each a
 * prefetch of one token (after its three predecessors) and the waits for
 * both layers' rows, timed from the prefetch to the second wait's return.
 * Prints {"p50_us":..,"p99_us":..,"mean_us":..,"steps":N} on stdout.
 *
 *   lookup_bench CONFIG NODE STEPS WARMUP
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "engram_rack.h"

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s CONFIG NODE STEPS WARMUP\n", argv[0]);
        return 2;
    }
    long steps = atol(argv[3]), warmup = atol(argv[4]);
    engram_memory *m = NULL;
    engram_status s = engram_open_ex(argv[1], argv[2], ENGRAM_METRICS_OFF, &m);
    if (s != ENGRAM_OK) {
        fprintf(stderr, "open: %s\n", engram_last_error());
        return 1;
    }
    static uint8_t rows[2][ENGRAM_POSITION_BYTES];
    double *lat = malloc(sizeof(double) * (size_t)steps);
    int64_t hist[3] = {ENGRAM_NO_TOKEN, ENGRAM_NO_TOKEN, ENGRAM_NO_TOKEN};
    for (long i = 0; i < warmup + steps; i++) {
        int64_t token = (i * 7919 + 17) % 99092;
        engram_segment seg = {1, {hist[0], hist[1], hist[2]}};
        engram_ticket *t = NULL;
        double t0 = now_us();
        s = engram_prefetch(m, &token, 1, &seg, 1, &t);
        if (s == ENGRAM_OK) s = engram_wait(t, 1, rows[0], sizeof rows[0], ENGRAM_NO_DEADLINE, NULL);
        if (s == ENGRAM_OK) s = engram_wait(t, 14, rows[1], sizeof rows[1], ENGRAM_NO_DEADLINE, NULL);
        double t1 = now_us();
        engram_ticket_free(t);
        if (s != ENGRAM_OK) {
            fprintf(stderr, "step %ld: %s\n", i, engram_last_error());
            return 1;
        }
        if (i >= warmup) lat[i - warmup] = t1 - t0;
        hist[0] = hist[1];
        hist[1] = hist[2];
        hist[2] = token;
    }
    double sum = 0;
    for (long i = 0; i < steps; i++) sum += lat[i];
    qsort(lat, (size_t)steps, sizeof(double), cmp);
    printf("{\"p50_us\":%.3f,\"p99_us\":%.3f,\"mean_us\":%.3f,\"steps\":%ld}\n", lat[steps / 2],
           lat[(long)(steps * 0.99)], sum / steps, steps);
    free(lat);
    engram_free(m);
    return 0;
}
