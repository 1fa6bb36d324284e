/*
 * libengram_rack's tests from C, against real donors that
 * integration-tests/tests/engines.rs starts. One check per subcommand; each
 * prints what it found and exits 0 when it holds, 1 when not:
 *
 *   engram_test rows CONFIG NODE L1.etab L14.etab POSITIONS [NEVER_SOURCE]
 *   engram_test dequant CONFIG NODE
 *   engram_test failover CONFIG NODE DONOR_PID L1.etab L14.etab
 *   engram_test deadline CONFIG NODE DONOR_PID
 *   engram_test badinput CONFIG NODE
 *   engram_test leak CONFIG NODE LOOKUPS
 *   engram_test view CONFIG NODE L1.etab L14.etab SHARED
 *   engram_test rowids CONFIG NODE
 *   engram_test tables CONFIG NODE SHARED
 */
#include <dirent.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engram_rack.h"

#define VOCAB 99092

static int failures = 0;

#define EXPECT(cond, ...)                                         \
    do {                                                          \
        if (!(cond)) {                                            \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);  \
            fprintf(stderr, __VA_ARGS__);                         \
            fprintf(stderr, "\n");                                \
            failures++;                                           \
        }                                                         \
    } while (0)

static void die(engram_status s, const char *what) {
    fprintf(stderr, "%s: %s: %s\n", what, engram_status_name(s), engram_last_error());
    exit(1);
}

static engram_memory *open_memory(const char *config, const char *node) {
    engram_memory *m = NULL;
    engram_status s = engram_open_ex(config, node, ENGRAM_METRICS_OFF, &m);
    if (s != ENGRAM_OK) die(s, "open");
    return m;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t next_u64(void) {
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* An .etab file: a safetensors header, then 4 KiB pages of 15 rows. */
typedef struct {
    FILE *f;
    uint64_t data;
} table_file;

static table_file open_table(const char *path) {
    table_file t = {fopen(path, "rb"), 0};
    if (!t.f) {
        perror(path);
        exit(1);
    }
    unsigned char n[8];
    if (fread(n, 1, 8, t.f) != 8) exit(1);
    uint64_t len = 0;
    for (int i = 7; i >= 0; i--) len = (len << 8) | n[i];
    t.data = 8 + len;
    return t;
}

static void read_row(table_file *t, uint64_t row, uint8_t *out) {
    uint64_t at = t->data + (row / 15) * 4096 + (row % 15) * ENGRAM_ROW_BYTES;
    if (fseek(t->f, (long)at, SEEK_SET) != 0 || fread(out, 1, ENGRAM_ROW_BYTES, t->f) != ENGRAM_ROW_BYTES) {
        fprintf(stderr, "cannot read row %llu\n", (unsigned long long)row);
        exit(1);
    }
}

/* Fetch `n` positions (a sequence after `ctx`) and compare both layers' rows
 * with the table files; returns the first source of layer 1. */
static void check_rows(engram_memory *m, table_file tf[2], const int64_t *ids, size_t n,
                       const int64_t ctx[3], const char *never, char *source1) {
    engram_segment seg = {n, {ctx[0], ctx[1], ctx[2]}};
    uint64_t *addr = malloc(n * 48 * sizeof *addr);
    uint8_t *rows = malloc(n * ENGRAM_POSITION_BYTES);
    uint8_t want[ENGRAM_ROW_BYTES];
    engram_status s = engram_addresses(m, ids, n, &seg, 1, addr, n * 48);
    if (s != ENGRAM_OK) die(s, "addresses");
    engram_ticket *t = NULL;
    s = engram_prefetch(m, ids, n, &seg, 1, &t);
    if (s != ENGRAM_OK) die(s, "prefetch");
    const uint32_t layers[2] = {1, 14};
    for (int l = 0; l < 2; l++) {
        engram_served sv;
        s = engram_wait(t, layers[l], rows, n * ENGRAM_POSITION_BYTES, 5000000, &sv);
        if (s != ENGRAM_OK) die(s, "wait");
        if (l == 0 && source1) strcpy(source1, sv.source);
        if (never) EXPECT(strcmp(sv.source, never) != 0 || l == 1, "layer %u served by %s", sv.layer, never);
        for (size_t p = 0; p < n; p++) {
            for (int c = 0; c < ENGRAM_COLUMNS; c++) {
                uint64_t row = addr[p * 48 + l * 24 + c];
                const uint8_t *got = rows + p * ENGRAM_POSITION_BYTES + c * ENGRAM_ROW_BYTES;
                if (row == ENGRAM_NO_ROW) {
                    memset(want, 0, sizeof want);
                } else {
                    read_row(&tf[l], row, want);
                }
                EXPECT(memcmp(got, want, ENGRAM_ROW_BYTES) == 0, "layer %u position %zu column %d (row %llu) differs",
                       layers[l], p, c, (unsigned long long)row);
            }
        }
    }
    engram_ticket_free(t);
    free(addr);
    free(rows);
}

static void random_ids(int64_t *ids, size_t n) {
    for (size_t i = 0; i < n; i++) ids[i] = (next_u64() % 20 == 0) ? -1 : (int64_t)(next_u64() % VOCAB);
}

static int cmd_rows(char **a, int n) {
    if (n < 5) return 2;
    engram_memory *m = open_memory(a[0], a[1]);
    table_file tf[2] = {open_table(a[2]), open_table(a[3])};
    long want = atol(a[4]);
    const char *never = n > 5 ? a[5] : NULL;
    long done = 0;
    int64_t ids[64];
    while (done < want) {
        size_t k = 1 + next_u64() % 63;
        random_ids(ids, k);
        int64_t ctx[3] = {ENGRAM_NO_TOKEN, ENGRAM_NO_TOKEN, ENGRAM_NO_TOKEN};
        for (int c = 3 - (int)(next_u64() % 4); c < 3; c++) ctx[c] = (int64_t)(next_u64() % VOCAB);
        check_rows(m, tf, ids, k, ctx, never, NULL);
        done += (long)k;
    }
    engram_layer_stats st[2];
    engram_stats(m, st);
    EXPECT(st[0].failed == 0 && st[1].failed == 0, "failed lookups");
    printf("rows: %ld positions checked, both layers\n", done);
    engram_free(m);
    return failures != 0;
}

/* docs/ENGRAM.md: e4m3 codes, ue8m0 scales (one per 32 values), bf16 values. */
static float e4m3(uint8_t c) {
    int e = (c >> 3) & 15, mant = c & 7;
    float v = e == 0 ? ldexpf(mant / 8.0f, -6) : ldexpf(1 + mant / 8.0f, e - 7);
    return (c & 0x80) ? -v : v;
}

static int cmd_dequant(char **a, int n) {
    if (n < 2) return 2;
    engram_memory *m = open_memory(a[0], a[1]);
    int64_t ids[100];
    random_ids(ids, 100);
    engram_ticket *t = NULL;
    engram_status s = engram_prefetch(m, ids, 100, NULL, 0, &t);
    if (s != ENGRAM_OK) die(s, "prefetch");
    static uint8_t rows[100 * ENGRAM_POSITION_BYTES];
    static float f[100 * ENGRAM_COLUMNS * ENGRAM_ROW_VALUES];
    static uint16_t bf[100 * ENGRAM_COLUMNS * ENGRAM_ROW_VALUES];
    s = engram_wait(t, 14, rows, sizeof rows, ENGRAM_NO_DEADLINE, NULL);
    if (s != ENGRAM_OK) die(s, "wait");
    size_t values = sizeof f / sizeof f[0];
    if ((s = engram_dequantize_f32(rows, sizeof rows, f, values)) != ENGRAM_OK) die(s, "f32");
    if ((s = engram_dequantize_bf16(rows, sizeof rows, bf, values)) != ENGRAM_OK) die(s, "bf16");
    size_t nrows = sizeof rows / ENGRAM_ROW_BYTES;
    for (size_t r = 0; r < nrows; r++) {
        const uint8_t *row = rows + r * ENGRAM_ROW_BYTES;
        for (int i = 0; i < ENGRAM_ROW_VALUES; i++) {
            float want = e4m3(row[i]) * ldexpf(1.0f, (int)row[256 + i / 32] - 127);
            float got = f[r * ENGRAM_ROW_VALUES + i];
            uint32_t bits;
            memcpy(&bits, &got, 4);
            EXPECT(got == want, "row %zu value %d: %g, want %g", r, i, (double)got, (double)want);
            EXPECT(bf[r * ENGRAM_ROW_VALUES + i] == (uint16_t)(bits >> 16), "bf16 row %zu value %d", r, i);
        }
    }
    printf("dequant: %zu rows equal the reference, bf16 their bits\n", nrows);
    engram_ticket_free(t);
    engram_free(m);
    return failures != 0;
}

static int cmd_failover(char **a, int n) {
    if (n < 5) return 2;
    engram_memory *m = open_memory(a[0], a[1]);
    pid_t donor = (pid_t)atol(a[2]);
    table_file tf[2] = {open_table(a[3]), open_table(a[4])};
    double start = now_s();
    int killed = 0, after = 0, from_ssd = 0, from_donor = 0;
    char source[64];
    int64_t ids[1];
    int64_t ctx[3];
    while (now_s() - start < 3.0) {
        if (!killed && now_s() - start > 1.0) {
            kill(donor, SIGKILL);
            killed = 1;
        }
        random_ids(ids, 1);
        for (int c = 0; c < 3; c++) ctx[c] = (int64_t)(next_u64() % VOCAB);
        check_rows(m, tf, ids, 1, ctx, NULL, source);
        if (strcmp(source, "ssd") == 0) from_ssd++;
        if (strcmp(source, "d") == 0) from_donor++;
        if (killed) after++;
        usleep(2000);
    }
    engram_layer_stats st[2];
    engram_stats(m, st);
    EXPECT(st[0].failed == 0 && st[1].failed == 0, "failed lookups: %llu, %llu",
           (unsigned long long)st[0].failed, (unsigned long long)st[1].failed);
    EXPECT(from_donor > 0 && from_ssd > 0, "sources: donor %d, ssd %d", from_donor, from_ssd);
    EXPECT(after > 20, "only %d lookups after the kill", after);
    printf("failover: %llu lookups, 0 failed, %d from the donor, %d from the SSD copy, %d after kill -9\n",
           (unsigned long long)(st[0].prefetches + st[1].prefetches), from_donor, from_ssd, after);
    engram_free(m);
    return failures != 0;
}

/* Whether every thread of `pid` is stopped. */
static int all_stopped(pid_t pid) {
    char dir[64];
    snprintf(dir, sizeof dir, "/proc/%d/task", (int)pid);
    DIR *d = opendir(dir);
    if (!d) return 0;
    int seen = 0, stopped = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.') continue;
        char path[384], buf[512] = {0};
        snprintf(path, sizeof path, "%s/%s/stat", dir, e->d_name);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        size_t got = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        char *close = got ? strrchr(buf, ')') : NULL;
        seen++;
        if (close && (close[2] == 'T' || close[2] == 't')) stopped++;
    }
    closedir(d);
    return seen > 0 && seen == stopped;
}

/* SIGSTOP, then wait until every thread is stopped (the signal is
 * asynchronous: a thread on another core finishes its slice first). */
static void hang(pid_t pid) {
    kill(pid, SIGSTOP);
    for (int i = 0; i < 10000; i++) {
        if (all_stopped(pid)) return;
        usleep(1000);
    }
    fprintf(stderr, "the donor did not stop\n");
    exit(1);
}

static int cmd_deadline(char **a, int n) {
    if (n < 3) return 2;
    engram_memory *m = open_memory(a[0], a[1]);
    pid_t donor = (pid_t)atol(a[2]);
    hang(donor);
    int64_t id = 42;
    engram_ticket *t = NULL;
    engram_status s = engram_prefetch(m, &id, 1, NULL, 0, &t);
    if (s != ENGRAM_OK) die(s, "prefetch");
    static uint8_t rows[ENGRAM_POSITION_BYTES];
    double began = now_s();
    s = engram_wait(t, 1, rows, sizeof rows, 200000, NULL);
    double took = now_s() - began;
    EXPECT(s == ENGRAM_TIMEOUT, "wait gave %s, want ENGRAM_TIMEOUT", engram_status_name(s));
    EXPECT(strstr(engram_last_error(), "still valid") != NULL, "message: %s", engram_last_error());
    EXPECT(took >= 0.2 && took < 0.4, "the 200 ms deadline took %.3f s", took);
    EXPECT(engram_ready(t, 1) == 0, "ready before the table's hard timeout");
    /* The table's own hard timeout ends it: policy `fail`. */
    s = engram_wait(t, 1, rows, sizeof rows, 5000000, NULL);
    EXPECT(s == ENGRAM_NO_SOURCE, "then %s, want ENGRAM_NO_SOURCE", engram_status_name(s));
    EXPECT(strstr(engram_last_error(), "table 1") != NULL, "message: %s", engram_last_error());
    kill(donor, SIGCONT);
    printf("deadline: timed out after %.3f s (asked 0.200), then %s\n", took, engram_status_name(s));
    engram_ticket_free(t);
    engram_free(m);
    return failures != 0;
}

#define EXPECT_STATUS(call, want, text)                                                       \
    do {                                                                                      \
        engram_status got_ = (call);                                                          \
        EXPECT(got_ == (want), "%s gave %s, want %s (%s)", #call, engram_status_name(got_),    \
               engram_status_name(want), engram_last_error());                                \
        EXPECT(strstr(engram_last_error(), (text)) != NULL, "%s: message %s lacks \"%s\"",    \
               #call, engram_last_error(), (text));                                           \
    } while (0)

static int cmd_badinput(char **a, int n) {
    if (n < 2) return 2;
    engram_memory *m = NULL;
    EXPECT_STATUS(engram_open(NULL, a[1], &m), ENGRAM_BAD_INPUT, "config is NULL");
    EXPECT_STATUS(engram_open(a[0], a[1], NULL), ENGRAM_BAD_INPUT, "out is NULL");
    EXPECT_STATUS(engram_open("/nonexistent/rack.toml", a[1], &m), ENGRAM_CONFIG, "/nonexistent/rack.toml");
    EXPECT_STATUS(engram_open(a[0], "ghost", &m), ENGRAM_CONFIG, "node \"ghost\" is not in");
    EXPECT_STATUS(engram_open_ex(a[0], a[1], 0x80, &m), ENGRAM_BAD_INPUT, "unknown flags");
    m = open_memory(a[0], a[1]);
    int64_t ids[2] = {1, 2};
    engram_ticket *t = NULL;
    EXPECT_STATUS(engram_prefetch(m, NULL, 2, NULL, 0, &t), ENGRAM_BAD_INPUT, "ids is NULL");
    EXPECT_STATUS(engram_prefetch(m, ids, 0, NULL, 0, &t), ENGRAM_BAD_INPUT, "empty");
    /* A length past any buffer is refused before anything reads it. */
    EXPECT_STATUS(engram_prefetch(m, ids, SIZE_MAX, NULL, 0, &t), ENGRAM_BAD_INPUT, "past any buffer");
    EXPECT(engram_ready(NULL, 1) == -1, "engram_ready(NULL)");
    EXPECT(engram_ticket_positions(NULL) == 0, "engram_ticket_positions(NULL)");
    int64_t neg[2] = {1, -5};
    EXPECT_STATUS(engram_prefetch(m, neg, 2, NULL, 0, &t), ENGRAM_BAD_INPUT, "position 1: token id -5 is negative");
    int64_t big[2] = {1, VOCAB};
    EXPECT_STATUS(engram_prefetch(m, big, 2, NULL, 0, &t), ENGRAM_BAD_INPUT, "out of range");
    engram_segment segs[2] = {{1, {ENGRAM_NO_TOKEN, ENGRAM_NO_TOKEN, ENGRAM_NO_TOKEN}}, {5, {0, 0, 0}}};
    EXPECT_STATUS(engram_prefetch(m, ids, 2, segs, 2, &t), ENGRAM_BAD_INPUT, "cover 6 positions");
    segs[1].len = 1;
    segs[1].context[1] = ENGRAM_NO_TOKEN;
    EXPECT_STATUS(engram_prefetch(m, ids, 2, segs, 2, &t), ENGRAM_BAD_INPUT, "segment 1: context slot 1");
    engram_status s = engram_prefetch(m, ids, 2, NULL, 0, &t);
    if (s != ENGRAM_OK) die(s, "prefetch");
    static uint8_t rows[2 * ENGRAM_POSITION_BYTES];
    EXPECT_STATUS(engram_wait(t, 1, rows, sizeof rows - 1, -1, NULL), ENGRAM_BAD_INPUT, "has 12671 bytes");
    EXPECT_STATUS(engram_wait(t, 1, NULL, sizeof rows, -1, NULL), ENGRAM_BAD_INPUT, "out is NULL");
    EXPECT_STATUS(engram_wait(t, 2, rows, sizeof rows, -1, NULL), ENGRAM_BAD_INPUT, "layer 2 has no Engram table");
    EXPECT_STATUS(engram_wait(t, 1, rows, sizeof rows, -7, NULL), ENGRAM_BAD_INPUT, "negative");
    EXPECT_STATUS(engram_wait(NULL, 1, rows, sizeof rows, -1, NULL), ENGRAM_BAD_INPUT, "ticket is NULL");
    EXPECT(engram_ready(t, 3) == -1, "ready on layer 3");
    float f[ENGRAM_ROW_VALUES];
    EXPECT_STATUS(engram_dequantize_f32(rows, 263, f, 256), ENGRAM_BAD_INPUT, "not a whole number");
    EXPECT_STATUS(engram_dequantize_f32(rows, 264, f, 255), ENGRAM_BAD_INPUT, "need 256");
    char small[8];
    size_t needed = 0;
    EXPECT_STATUS(engram_metrics(m, small, sizeof small, &needed), ENGRAM_BAD_INPUT, "the buffer has 8");
    EXPECT(needed > 8, "metrics size %zu", needed);
    /* The text may grow between two calls (lookups in flight): a caller
       asks again with the size it is told, a few times at most. */
    engram_status ms = ENGRAM_BAD_INPUT;
    for (int tries = 0; tries < 5 && ms == ENGRAM_BAD_INPUT; tries++) {
        char *text = malloc(needed);
        EXPECT(text != NULL, "malloc");
        ms = engram_metrics(m, text, needed, &needed);
        free(text);
    }
    EXPECT(ms == ENGRAM_OK, "metrics: %s", engram_last_error());
    /* Still usable after all that. */
    EXPECT(engram_wait(t, 1, rows, sizeof rows, 5000000, NULL) == ENGRAM_OK, "wait: %s", engram_last_error());
    EXPECT(engram_close(m, 1000) == ENGRAM_OK, "close");
    EXPECT(engram_close(m, 1000) == ENGRAM_OK, "close twice");
    EXPECT_STATUS(engram_prefetch(m, ids, 2, NULL, 0, &t), ENGRAM_CLOSED, "closed");
    uint32_t tables[2];
    EXPECT_STATUS(engram_tables(m, tables), ENGRAM_CLOSED, "closed");
    /* The ticket outlives its memory. */
    EXPECT(engram_wait(t, 14, rows, sizeof rows, 5000000, NULL) == ENGRAM_OK, "wait after close: %s", engram_last_error());
    engram_ticket_free(t);
    engram_free(m);
    engram_free(NULL);
    engram_ticket_free(NULL);
    printf("badinput: every bad call refused with its code and message\n");
    return failures != 0;
}

static long rss_kib(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long kib = -1;
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, "VmRSS:", 6) == 0) kib = atol(line + 6);
    if (f) fclose(f);
    return kib;
}

static int cmd_leak(char **a, int n) {
    if (n < 3) return 2;
    engram_memory *m = open_memory(a[0], a[1]);
    long lookups = atol(a[2]);
    long warm = lookups / 5 < 20000 ? lookups / 5 : 20000;
    long before = -1, done = 0;
    static uint8_t rows[ENGRAM_POSITION_BYTES];
    while (done < lookups) {
        if (before < 0 && done >= warm) before = rss_kib();
        int64_t id = done % VOCAB;
        engram_ticket *t = NULL;
        engram_status s = engram_prefetch(m, &id, 1, NULL, 0, &t);
        if (s != ENGRAM_OK) die(s, "prefetch");
        if ((s = engram_wait(t, 1, rows, sizeof rows, 5000000, NULL)) != ENGRAM_OK) die(s, "wait 1");
        if ((s = engram_wait(t, 14, rows, sizeof rows, 5000000, NULL)) != ENGRAM_OK) die(s, "wait 14");
        engram_ticket_free(t);
        done += 2;
    }
    long after = rss_kib();
    EXPECT(after - before < 4096, "RSS grew %ld KiB over %ld lookups", after - before, lookups);
    printf("leak: %ld lookups, RSS %ld KiB -> %ld KiB\n", lookups, before, after);
    engram_free(m);
    return failures != 0;
}

/* Each layer's table view: shared as SHARED (0 or 1) says, packed when
 * shared, every row checked against the table file, the layout as the
 * header says it, and a view that outlives its memory. */
static int cmd_view(char **a, int n) {
    if (n != 5) return 2;
    engram_memory *m = open_memory(a[0], a[1]);
    table_file tf[2] = {open_table(a[2]), open_table(a[3])};
    int shared = atoi(a[4]);
    const uint32_t layers[2] = {1, 14};
    engram_view *views[2] = {NULL, NULL};
    for (int l = 0; l < 2; l++) {
        engram_status s = engram_table_view(m, layers[l], 5000, &views[l]);
        if (s != ENGRAM_OK) die(s, "table_view");
    }
    engram_view *none = NULL;
    EXPECT(engram_table_view(m, 2, 0, &none) == ENGRAM_BAD_INPUT && none == NULL, "layer 2 refused");
    /* The memory outlives the handle that gave it. */
    engram_close(m, 1000);
    engram_free(m);
    uint8_t want[ENGRAM_ROW_BYTES];
    for (int l = 0; l < 2; l++) {
        engram_table_info info;
        engram_status s = engram_view_info(views[l], &info);
        if (s != ENGRAM_OK) die(s, "table_view_info");
        EXPECT(info.layer == layers[l], "layer %u", info.layer);
        EXPECT(info.shared == shared, "shared %u, expected %d", info.shared, shared);
        EXPECT(!shared || (info.packed && info.generation > 0), "a donor's memory is packed, with a generation");
        uint64_t expect_len = info.packed ? info.rows * ENGRAM_ROW_BYTES : 0;
        EXPECT(!info.packed || info.len == expect_len, "len %zu", info.len);
        for (uint64_t r = 0; r < info.rows; r++) {
            uint64_t at = info.packed ? r * ENGRAM_ROW_BYTES : (r / 15) * 4096 + (r % 15) * ENGRAM_ROW_BYTES;
            read_row(&tf[l], r, want);
            if (at + ENGRAM_ROW_BYTES > info.len || memcmp(info.data + at, want, ENGRAM_ROW_BYTES) != 0) {
                EXPECT(0, "layer %u row %llu differs from the file", layers[l], (unsigned long long)r);
                break;
            }
        }
        printf("layer %u: table %u, %llu rows, %zu bytes, shared %u, packed %u, generation %llu\n",
               info.layer, info.table, (unsigned long long)info.rows, info.len, info.shared, info.packed,
               (unsigned long long)info.generation);
        engram_view_free(views[l]);
    }
    engram_view_free(NULL);
    return failures ? 1 : 0;
}

/* A prefetch by row ids gives what the token prefetch gives: all 24
 * columns of both layers, and one layer's head slice; bad ids refused. */
static int cmd_rowids(char **a, int n) {
    if (n != 2) return 2;
    engram_memory *m = open_memory(a[0], a[1]);
    enum { P = 6 };
    int64_t ids[P];
    for (int p = 0; p < P; p++) ids[p] = (int64_t)((p + 1) * 7919 % VOCAB);
    ids[2] = -1; /* DEAD */
    engram_segment seg = {P, {ENGRAM_NO_TOKEN, ENGRAM_NO_TOKEN, 7}};
    uint64_t addr[P * 48];
    engram_status s = engram_addresses(m, ids, P, &seg, 1, addr, P * 48);
    if (s != ENGRAM_OK) die(s, "addresses");
    engram_ticket *by_token = NULL, *by_rows = NULL, *slice = NULL;
    if ((s = engram_prefetch(m, ids, P, &seg, 1, &by_token)) != ENGRAM_OK) die(s, "prefetch");
    if ((s = engram_prefetch_rows(m, addr, P * 48, 0, 0, 24, &by_rows)) != ENGRAM_OK) die(s, "prefetch_rows");
    /* Layer 14's columns 8..16 alone. */
    uint64_t part[P * 8];
    for (int p = 0; p < P; p++)
        for (int c = 0; c < 8; c++) part[p * 8 + c] = addr[p * 48 + 24 + 8 + c];
    if ((s = engram_prefetch_rows(m, part, P * 8, 14, 8, 16, &slice)) != ENGRAM_OK) die(s, "prefetch_rows slice");
    static uint8_t want[P * ENGRAM_POSITION_BYTES], got[P * ENGRAM_POSITION_BYTES];
    static uint8_t some[P * 8 * ENGRAM_ROW_BYTES];
    const uint32_t layers[2] = {1, 14};
    engram_served sv;
    for (int l = 0; l < 2; l++) {
        if ((s = engram_wait(by_token, layers[l], want, sizeof want, 5000000, &sv)) != ENGRAM_OK) die(s, "wait");
        if ((s = engram_wait(by_rows, layers[l], got, sizeof got, 5000000, &sv)) != ENGRAM_OK) die(s, "wait rows");
        EXPECT(memcmp(want, got, sizeof got) == 0, "layer %u: rows by id differ from rows by token", layers[l]);
    }
    if ((s = engram_wait(slice, 14, some, sizeof some, 5000000, &sv)) != ENGRAM_OK) die(s, "wait slice");
    for (int p = 0; p < P; p++)
        EXPECT(memcmp(some + p * 8 * ENGRAM_ROW_BYTES, want + p * ENGRAM_POSITION_BYTES + 8 * ENGRAM_ROW_BYTES,
                      8 * ENGRAM_ROW_BYTES) == 0,
               "position %d: the head slice differs", p);
    EXPECT(engram_wait(slice, 1, some, sizeof some, 0, &sv) == ENGRAM_BAD_INPUT, "layer 1 of a layer-14 ticket");
    /* Refused: a row past the table, a partial DEAD, an empty column range. */
    engram_ticket *none = NULL;
    uint64_t bad[48];
    memcpy(bad, addr, sizeof bad);
    bad[5] = 1ull << 40;
    EXPECT(engram_prefetch_rows(m, bad, 48, 0, 0, 24, &none) == ENGRAM_BAD_INPUT, "a row past the table");
    EXPECT(strstr(engram_last_error(), "past table") != NULL, "%s", engram_last_error());
    memcpy(bad, addr, sizeof bad);
    bad[30] = ENGRAM_NO_ROW;
    EXPECT(engram_prefetch_rows(m, bad, 48, 0, 0, 24, &none) == ENGRAM_BAD_INPUT, "a partial DEAD");
    EXPECT(engram_prefetch_rows(m, addr, 48, 0, 3, 3, &none) == ENGRAM_BAD_INPUT, "no columns");
    EXPECT(engram_prefetch_rows(m, NULL, 48, 0, 0, 24, &none) == ENGRAM_BAD_INPUT, "NULL rows");
    EXPECT(none == NULL, "no ticket made by a refused call");
    engram_ticket_free(by_token);
    engram_ticket_free(by_rows);
    engram_ticket_free(slice);
    engram_free(m);
    printf("rows by id: both layers and a head slice identical to rows by token\n");
    return failures ? 1 : 0;
}

static uint64_t fnv64(const uint8_t *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

/* A node's tables for any model family: each routed table described, rows
 * by id at its own row size (printed as an FNV-1a hash the caller checks
 * against the generator), a host-local donor's table mapped (SHARED 1: the
 * view's rows are the lookup's), values dequantized, bad calls refused. */
static int cmd_tables(char **a, int n) {
    if (n != 3) return 2;
    int shared = atoi(a[2]);
    engram_node_tables *t = NULL;
    engram_status s = engram_node_tables_open(a[0], a[1], ENGRAM_METRICS_OFF, &t);
    if (s != ENGRAM_OK) die(s, "node_tables_open");
    size_t count = 0;
    if ((s = engram_node_tables_count(t, &count)) != ENGRAM_OK) die(s, "count");
    for (size_t i = 0; i < count; i++) {
        engram_table_desc d;
        if ((s = engram_node_tables_info(t, i, &d)) != ENGRAM_OK) die(s, "info");
        uint64_t ids[4] = {0, 7, d.rows - 1, 7};
        uint8_t *rows = malloc(100 * (size_t)d.row_bytes);
        s = engram_node_tables_lookup(t, d.table, ids, 4, rows, 4 * (size_t)d.row_bytes, 5000000, NULL);
        if (s != ENGRAM_OK) die(s, "lookup");
        EXPECT(memcmp(rows + d.row_bytes, rows + 3 * (size_t)d.row_bytes, d.row_bytes) == 0, "a repeated id");
        printf("table %u: layer %u, %llu rows of %u bytes, %s, scale %g, rows-fnv %016llx\n", d.table, d.layer,
               (unsigned long long)d.rows, d.row_bytes, d.encoding, d.has_tensor_scale ? d.tensor_scale : 0.0,
               (unsigned long long)fnv64(rows, 4 * (size_t)d.row_bytes));
        uint16_t *values = malloc(d.values * sizeof(uint16_t));
        s = engram_dequantize_encoded_bf16(d.encoding, d.tensor_scale, rows, d.row_bytes, values, d.values);
        EXPECT(s == ENGRAM_OK, "dequantize: %s", engram_last_error());
        s = engram_dequantize_encoded_bf16(d.encoding, d.tensor_scale, rows, d.row_bytes - 1, values, d.values);
        EXPECT(s == ENGRAM_BAD_INPUT, "a part row refused");
        free(values);
        /* Bad calls: the table's row size, its rows, a table not routed. */
        EXPECT(engram_node_tables_lookup(t, d.table, ids, 4, rows, 4 * (size_t)d.row_bytes - 1, -1, NULL) ==
                   ENGRAM_BAD_INPUT, "a short output refused");
        uint64_t past = d.rows;
        EXPECT(engram_node_tables_lookup(t, d.table, &past, 1, rows, d.row_bytes, -1, NULL) == ENGRAM_BAD_INPUT,
               "a row past the table refused");
        EXPECT(engram_node_tables_lookup(t, 999, ids, 1, rows, d.row_bytes, -1, NULL) == ENGRAM_BAD_INPUT,
               "an unrouted table refused");
        engram_view *v = NULL;
        s = engram_node_tables_view(t, d.table, shared ? 5000 : 0, &v);
        if (shared) {
            if (s != ENGRAM_OK) die(s, "view");
            engram_table_info info;
            if ((s = engram_view_info(v, &info)) != ENGRAM_OK) die(s, "view_info");
            uint64_t first[100];
            for (int r = 0; r < 100; r++) first[r] = (uint64_t)r;
            s = engram_node_tables_lookup(t, d.table, first, 100, rows, 100 * (size_t)d.row_bytes, -1, NULL);
            if (s != ENGRAM_OK) die(s, "lookup 100");
            EXPECT(info.shared == 1 && info.packed == 1 && info.row_bytes == d.row_bytes, "a donor's packed rows");
            EXPECT(info.len >= 100 * (size_t)d.row_bytes && memcmp(info.data, rows, 100 * (size_t)d.row_bytes) == 0,
                   "the view's rows are the lookup's");
            printf("table %u: view shared %u, packed %u, row_bytes %llu\n", d.table, info.shared, info.packed,
                   (unsigned long long)info.row_bytes);
            engram_view_free(v);
        } else {
            EXPECT(s == ENGRAM_NO_SOURCE && v == NULL, "no view without a host-local donor: %s", engram_status_name(s));
        }
        free(rows);
    }
    engram_table_desc d;
    EXPECT(engram_node_tables_info(t, count, &d) == ENGRAM_BAD_INPUT, "an index past the tables refused");
    engram_node_tables_close(t, 1000);
    EXPECT(engram_node_tables_count(t, &count) == ENGRAM_CLOSED, "closed");
    engram_node_tables_free(t);
    engram_node_tables_free(NULL);
    return failures ? 1 : 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s rows|dequant|failover|deadline|badinput|leak|view|rowids|tables ARGS...\n", argv[0]);
        return 2;
    }
    char **a = argv + 2;
    int n = argc - 2;
    int rc = 2;
    if (strcmp(argv[1], "rows") == 0) rc = cmd_rows(a, n);
    else if (strcmp(argv[1], "dequant") == 0) rc = cmd_dequant(a, n);
    else if (strcmp(argv[1], "failover") == 0) rc = cmd_failover(a, n);
    else if (strcmp(argv[1], "deadline") == 0) rc = cmd_deadline(a, n);
    else if (strcmp(argv[1], "badinput") == 0) rc = cmd_badinput(a, n);
    else if (strcmp(argv[1], "leak") == 0) rc = cmd_leak(a, n);
    else if (strcmp(argv[1], "view") == 0) rc = cmd_view(a, n);
    else if (strcmp(argv[1], "rowids") == 0) rc = cmd_rowids(a, n);
    else if (strcmp(argv[1], "tables") == 0) rc = cmd_tables(a, n);
    if (rc == 2) fprintf(stderr, "bad arguments for %s\n", argv[1]);
    return rc;
}
