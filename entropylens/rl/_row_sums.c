/* One pass over each row of logits for entropylens.rl.stats._forward (CPU): the row's max, then in a
 * single streaming loop u_j = max(z_j/T - m, FLOOR), e_j = exp(u_j) and the sums
 *     S = sum e_j,  D = sum e_j u_j,  R = sum e_j^2 u_j,  Q = sum e_j^2
 * (with `split`: over j != a, the sampled token's e_a returned apart, as the Python pass does).
 * The eager pass spends ~13 passes over memory on S and D and ~10 more on R and Q; here the whole row
 * is read twice and the four sums cost a few multiply-adds per element beside the exp.
 *
 * The same ops as the eager pass where they decide bits the caller compares: u_j = (z_j / T) - m with
 * m = max_j (z_j / T) (division, as torch's div_), u_a taken before the floor. exp is a Cephes-style
 * float32 polynomial (<= 2 ulp on [-87, 0], the only range it sees), so the loop vectorises without
 * -ffast-math. Each block of BLOCK elements sums in float32 lanes, blocks add in float64.
 * Rows run on `threads` POSIX threads (contiguous row ranges; each row's arithmetic is the same
 * whatever the thread count, so results do not depend on it). A row with a NaN or an infinite max
 * gets NaN everywhere, as the eager pass gives.
 *
 * Built at first use by entropylens/native.py (_FLAGS there: -O3 -fopenmp-simd -fno-trapping-math, and
 * -march=native where the compiler has it).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define FLOOR (-87.0f)
#define BLOCK 512

static inline float exp_floored(float x) { /* x in [-87, 0] */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round(x / ln 2) */
    float r = fmaf(n, -0.693359375f, x);                                /* x - n ln2, in two parts */
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    float y = fmaf(p, r * r, r) + 1.0f;
    union { int32_t i; float f; } s;
    s.i = ((int32_t)n + 127) << 23; /* 2^n, n >= -126: a normal float */
    return y * s.f;
}

typedef struct {
    const void *z;
    int bf16;
    int64_t v, stride; /* elements */
    const int64_t *tok; /* NULL: no sampled token */
    float t;
    int want_dot, split, want_sens;
    float *m, *ua, *s, *d, *ea, *r, *q; /* [n] outputs (ea, r, q used as asked) */
    int64_t row0, row1;
} job_t;

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t i; float f; } c;
    c.i = (uint32_t)h << 16;
    return c.f;
}

/* x[0:len] as float32: the row itself, or bf16 widened into buf. */
static inline const float *load(const job_t *jb, const void *row, int64_t off, int64_t len, float *buf) {
    if (!jb->bf16) return (const float *)row + off;
    const uint16_t *h = (const uint16_t *)row + off;
#pragma omp simd
    for (int64_t j = 0; j < len; j++) buf[j] = bf16_to_f32(h[j]);
    return buf;
}

/* The block's sums; the flags are constants at each call site, so every variant compiles apart. */
static inline void block_sums(const float *x, int len, float t, int scale, float m, int ja,
                              int want_dot, int want_sens, double acc[4]) {
    float s = 0.f, d = 0.f, r = 0.f, q = 0.f;
#pragma omp simd reduction(+ : s, d, r, q)
    for (int j = 0; j < len; j++) {
        float u = scale ? x[j] / t : x[j];
        u = u - m;
        u = u > FLOOR ? u : FLOOR; /* -inf -> FLOOR too */
        float e = exp_floored(u);
        e = (j == ja) ? 0.f : e; /* split: the sampled token's term apart (ja < 0: none here) */
        s += e;
        if (want_dot || want_sens) d += e * u;
        if (want_sens) {
            float ee = e * e;
            r += ee * u;
            q += ee;
        }
    }
    acc[0] += s, acc[1] += d, acc[2] += r, acc[3] += q;
}

static void run_rows(const job_t *jb) {
    const int64_t v = jb->v;
    const int scale = jb->t != 1.0f;
    const size_t esz = jb->bf16 ? 2 : 4;
    float buf[BLOCK];
    for (int64_t i = jb->row0; i < jb->row1; i++) {
        const void *row = (const char *)jb->z + (size_t)i * (size_t)jb->stride * esz;
        float mx = -INFINITY;
        int bad = 0;
        for (int64_t off = 0; off < v; off += BLOCK) {
            int64_t len = v - off < BLOCK ? v - off : BLOCK;
            const float *x = load(jb, row, off, len, buf);
#pragma omp simd reduction(max : mx) reduction(| : bad)
            for (int64_t j = 0; j < len; j++) {
                mx = x[j] > mx ? x[j] : mx;
                bad |= x[j] != x[j];
            }
        }
        float m = scale ? mx / jb->t : mx; /* = max_j (z_j / T): division is monotonic */
        if (bad || isinf(mx)) {
            float nan = NAN;
            jb->m[i] = nan, jb->s[i] = nan, jb->d[i] = nan;
            if (jb->tok) jb->ua[i] = nan;
            if (jb->split) jb->ea[i] = nan;
            if (jb->want_sens) jb->r[i] = nan, jb->q[i] = nan;
            continue;
        }
        int64_t a = jb->tok ? jb->tok[i] : -1;
        double acc[4] = {0, 0, 0, 0};
        for (int64_t off = 0; off < v; off += BLOCK) {
            int64_t len = v - off < BLOCK ? v - off : BLOCK;
            const float *x = load(jb, row, off, len, buf);
            int ja = (jb->split && a >= off && a < off + len) ? (int)(a - off) : -1;
            if (jb->want_sens)
                block_sums(x, (int)len, jb->t, scale, m, ja, 1, 1, acc);
            else if (jb->want_dot)
                block_sums(x, (int)len, jb->t, scale, m, ja, 1, 0, acc);
            else
                block_sums(x, (int)len, jb->t, scale, m, ja, 0, 0, acc);
        }
        jb->m[i] = m, jb->s[i] = (float)acc[0];
        if (jb->want_dot || jb->want_sens) jb->d[i] = (float)acc[1];
        if (jb->want_sens) jb->r[i] = (float)acc[2], jb->q[i] = (float)acc[3];
        if (a >= 0) {
            float za = jb->bf16 ? bf16_to_f32(((const uint16_t *)row)[a]) : ((const float *)row)[a];
            float ua = (scale ? za / jb->t : za) - m; /* before the floor */
            jb->ua[i] = ua;
            if (jb->split) jb->ea[i] = exp_floored(ua > FLOOR ? ua : FLOOR);
        }
    }
}

static void *thread_main(void *arg) {
    run_rows((const job_t *)arg);
    return NULL;
}

#define MAX_THREADS 256

/* Returns 0, or -1 when a thread could not start (its rows then run on the calling thread). */
int el_row_sums(const void *z, int bf16, int64_t n, int64_t v, int64_t stride, const int64_t *tok, float t,
                int want_dot, int split, int want_sens, float *m, float *ua, float *s, float *d, float *ea,
                float *r, float *q, int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > n) threads = (int)(n > 0 ? n : 1);
    job_t jobs[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS];
    int64_t per = n / threads, extra = n % threads, row = 0;
    for (int k = 0; k < threads; k++) {
        job_t jb = {z, bf16, v, stride, tok, t, want_dot, split, want_sens, m, ua, s, d, ea, r, q, 0, 0};
        jb.row0 = row;
        row += per + (k < extra ? 1 : 0);
        jb.row1 = row;
        jobs[k] = jb;
    }
    int rc = 0;
    for (int k = 1; k < threads; k++) {
        started[k] = pthread_create(&ids[k], NULL, thread_main, &jobs[k]) == 0;
        if (!started[k]) rc = -1;
    }
    run_rows(&jobs[0]);
    for (int k = 1; k < threads; k++) {
        if (started[k])
            pthread_join(ids[k], NULL);
        else
            run_rows(&jobs[k]);
    }
    return rc;
}
