/*
 * The smallest engine loop over libengram_rack: open a node's memory, and for
 * each step prefetch both tables' rows of the step's token at the step's
 * start, then wait for layer 1's rows (block 1) and layer 14's (block 14)
 * into the engine's own buffers, and dequantize them.
 *
 *   cc -O2 -I inference-node/capi/include inference-node/capi/examples/lookup.c \
 *      -L target/release -lengram_rack -Wl,-rpath,$PWD/target/release -o lookup
 *   ./lookup rack.toml gpu-node-1 [steps]
 */
#include <stdio.h>
#include <stdlib.h>

#include "engram_rack.h"

static int check(engram_status s, const char *what) {
    if (s != ENGRAM_OK) {
        fprintf(stderr, "%s: %s: %s\n", what, engram_status_name(s), engram_last_error());
        return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s CONFIG NODE [STEPS]\n", argv[0]);
        return 2;
    }
    int steps = argc > 3 ? atoi(argv[3]) : 10;
    engram_memory *mem = NULL;
    if (check(engram_open_ex(argv[1], argv[2], ENGRAM_METRICS_OFF, &mem), "open")) return 1;

    /* The engine's buffers: one position's rows per layer, and their values. */
    static uint8_t rows[2][ENGRAM_POSITION_BYTES];
    static float values[ENGRAM_COLUMNS * ENGRAM_ROW_VALUES];
    const uint32_t layers[2] = {1, 14};

    /* The sequence's last three tokens, oldest first: none yet at its start. */
    int64_t hist[3] = {ENGRAM_NO_TOKEN, ENGRAM_NO_TOKEN, ENGRAM_NO_TOKEN};
    int rc = 0;
    for (int step = 0; step < steps && rc == 0; step++) {
        int64_t token = (step * 7919 + 11) % 99092;
        engram_segment seg = {1, {hist[0], hist[1], hist[2]}};
        engram_ticket *t = NULL;
        if (check(engram_prefetch(mem, &token, 1, &seg, 1, &t), "prefetch")) { rc = 1; break; }
        for (int l = 0; l < 2 && rc == 0; l++) {
            engram_served served;
            /* A deadline of 10 ms of the engine's own; the table's bound it too. */
            if (check(engram_wait(t, layers[l], rows[l], sizeof rows[l], 10000, &served), "wait")) {
                rc = 1;
                break;
            }
            if (check(engram_dequantize_f32(rows[l], sizeof rows[l], values,
                                            sizeof values / sizeof values[0]), "dequantize")) {
                rc = 1;
                break;
            }
            printf("step %d token %lld layer %u: from %s in %.1f us, first value %g\n", step,
                   (long long)token, served.layer, served.source, served.elapsed_ns / 1e3,
                   (double)values[0]);
        }
        engram_ticket_free(t);
        hist[0] = hist[1];
        hist[1] = hist[2];
        hist[2] = token;
    }
    engram_free(mem);
    return rc;
}
