/* The static scheduler's whole-graph passes in C: the same results as the Python ones in
 * cutemk/depgraph.py and schedulers/static.py (task for task, bit for bit), for plans of
 * tens of thousands of tasks whose Python passes cost tens of milliseconds.
 *
 * Input is a plan's per-task wait and notify lists as CSR arrays (ptr[n + 1], idx[...]), as the
 * plan holds them: a list may repeat an event, and an event may have no notifier or no waiter.
 * Every pass first builds the dependency graph the Python DepGraph.of builds: repeats dropped
 * (first occurrence kept), events without a notifier or without a waiter dropped, per event its
 * waiting tasks in task order. Plans with explicit cross-task predecessors (the distributed
 * schedulers' mirrored dependencies) stay on the Python path.
 *
 * Built by cutemk/native/__init__.py with the system C compiler (-ffp-contract=off: the
 * floating-point sums must round as Python's do) and called through ctypes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int32_t n, e;
    int32_t *w_ptr, *w_idx;   /* task -> live events it waits on, deduplicated */
    int32_t *nt_ptr, *nt_idx; /* task -> live events it notifies, deduplicated */
    int32_t *c_ptr, *c_idx;   /* event -> tasks waiting on it, in task order */
    int32_t *nprod;           /* event -> tasks notifying it */
} graph_t;

static void graph_free(graph_t *g) {
    free(g->w_ptr); free(g->w_idx); free(g->nt_ptr); free(g->nt_idx);
    free(g->c_ptr); free(g->c_idx); free(g->nprod);
}

/* Deduplicate each task's list into out (first occurrences, in order); mark[] is all -1 on
 * entry and on exit. Returns the entries written. */
static int64_t dedup(int32_t n, const int32_t *ptr, const int32_t *idx, int32_t *out_ptr,
                     int32_t *out_idx, int32_t *mark) {
    int64_t k = 0;
    for (int32_t t = 0; t < n; t++) {
        out_ptr[t] = (int32_t)k;
        for (int32_t j = ptr[t]; j < ptr[t + 1]; j++) {
            int32_t ev = idx[j];
            if (mark[ev] != t) { mark[ev] = t; out_idx[k++] = ev; }
        }
    }
    out_ptr[n] = (int32_t)k;
    return k;
}

static int graph_build(graph_t *g, int32_t n, int32_t e, const int32_t *wait_ptr,
                       const int32_t *wait_idx, const int32_t *ntf_ptr, const int32_t *ntf_idx) {
    memset(g, 0, sizeof(*g));
    g->n = n; g->e = e;
    int32_t *mark = malloc(sizeof(int32_t) * (size_t)(e > 0 ? e : 1));
    int32_t *nwait = calloc((size_t)(e > 0 ? e : 1), sizeof(int32_t));
    g->nprod = calloc((size_t)(e > 0 ? e : 1), sizeof(int32_t));
    g->w_ptr = malloc(sizeof(int32_t) * (size_t)(n + 1));
    g->nt_ptr = malloc(sizeof(int32_t) * (size_t)(n + 1));
    g->w_idx = malloc(sizeof(int32_t) * (size_t)(wait_ptr[n] > 0 ? wait_ptr[n] : 1));
    g->nt_idx = malloc(sizeof(int32_t) * (size_t)(ntf_ptr[n] > 0 ? ntf_ptr[n] : 1));
    g->c_ptr = malloc(sizeof(int32_t) * (size_t)(e + 1));
    if (!mark || !nwait || !g->nprod || !g->w_ptr || !g->nt_ptr || !g->w_idx || !g->nt_idx ||
        !g->c_ptr) {
        free(mark); free(nwait); graph_free(g); return -1;
    }
    for (int32_t i = 0; i < e; i++) mark[i] = -1;
    dedup(n, wait_ptr, wait_idx, g->w_ptr, g->w_idx, mark);
    for (int32_t i = 0; i < e; i++) mark[i] = -1;
    dedup(n, ntf_ptr, ntf_idx, g->nt_ptr, g->nt_idx, mark);
    free(mark);
    for (int64_t j = 0; j < g->w_ptr[n]; j++) nwait[g->w_idx[j]]++;
    for (int64_t j = 0; j < g->nt_ptr[n]; j++) g->nprod[g->nt_idx[j]]++;
    /* drop dead events from both lists, in place, order kept */
    int32_t *ptrs[2] = {g->w_ptr, g->nt_ptr};
    int32_t *idxs[2] = {g->w_idx, g->nt_idx};
    for (int which = 0; which < 2; which++) {
        int32_t *p = ptrs[which], *x = idxs[which];
        int64_t k = 0;
        for (int32_t t = 0; t < n; t++) {
            int32_t lo = p[t], hi = p[t + 1];
            p[t] = (int32_t)k;
            for (int32_t j = lo; j < hi; j++)
                if (g->nprod[x[j]] > 0 && nwait[x[j]] > 0) x[k++] = x[j];
        }
        p[n] = (int32_t)k;
    }
    for (int32_t i = 0; i < e; i++) if (nwait[i] == 0) g->nprod[i] = 0;
    /* event -> waiting tasks, in task order */
    g->c_ptr[0] = 0;
    for (int32_t i = 0; i < e; i++) g->c_ptr[i + 1] = g->c_ptr[i] + (g->nprod[i] > 0 ? nwait[i] : 0);
    g->c_idx = malloc(sizeof(int32_t) * (size_t)(g->c_ptr[e] > 0 ? g->c_ptr[e] : 1));
    if (!g->c_idx) { free(nwait); graph_free(g); return -1; }
    memset(nwait, 0, sizeof(int32_t) * (size_t)(e > 0 ? e : 1));
    for (int32_t t = 0; t < n; t++)
        for (int32_t j = g->w_ptr[t]; j < g->w_ptr[t + 1]; j++) {
            int32_t ev = g->w_idx[j];
            g->c_idx[g->c_ptr[ev] + nwait[ev]++] = t;
        }
    free(nwait);
    return 0;
}

/* Kahn's walk (DepGraph.kahn): the tasks in the order it reaches them; queue_next (task ->
 * the task queued right behind it on its SM, or -1) may be NULL. Returns the count ordered. */
static int32_t kahn(const graph_t *g, const int32_t *queue_next, int32_t *order) {
    int32_t n = g->n;
    int32_t *ev_left = malloc(sizeof(int32_t) * (size_t)(g->e > 0 ? g->e : 1));
    int32_t *pending = malloc(sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
    if (!ev_left || !pending) { free(ev_left); free(pending); return -1; }
    memcpy(ev_left, g->nprod, sizeof(int32_t) * (size_t)g->e);
    for (int32_t t = 0; t < n; t++) pending[t] = g->w_ptr[t + 1] - g->w_ptr[t];
    if (queue_next)
        for (int32_t t = 0; t < n; t++) if (queue_next[t] >= 0) pending[queue_next[t]]++;
    int32_t len = 0;
    for (int32_t t = 0; t < n; t++) if (pending[t] == 0) order[len++] = t;
    for (int32_t i = 0; i < len; i++) {
        int32_t t = order[i];
        for (int32_t j = g->nt_ptr[t]; j < g->nt_ptr[t + 1]; j++) {
            int32_t ev = g->nt_idx[j];
            if (--ev_left[ev] == 0)
                for (int32_t k = g->c_ptr[ev]; k < g->c_ptr[ev + 1]; k++) {
                    int32_t c = g->c_idx[k];
                    if (--pending[c] == 0) order[len++] = c;
                }
        }
        if (queue_next && queue_next[t] >= 0 && --pending[queue_next[t]] == 0)
            order[len++] = queue_next[t];
    }
    free(ev_left); free(pending);
    return len;
}

/* Topological order and upward rank (DepGraph.topological_order, DepGraph.upward_rank).
 * Returns the tasks ordered (n unless the graph has a cycle; rank is then not filled), or -1
 * when out of memory. */
int32_t cutemk_upward_rank(int32_t n, int32_t e, const int32_t *wait_ptr, const int32_t *wait_idx,
                           const int32_t *ntf_ptr, const int32_t *ntf_idx, const double *cost,
                           double *rank) {
    graph_t g;
    if (graph_build(&g, n, e, wait_ptr, wait_idx, ntf_ptr, ntf_idx)) return -1;
    int32_t *order = malloc(sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
    double *ev_rank = calloc((size_t)(e > 0 ? e : 1), sizeof(double));
    int32_t len = order && ev_rank ? kahn(&g, NULL, order) : -1;
    if (len == n) {
        for (int32_t i = n - 1; i >= 0; i--) {
            int32_t t = order[i];
            double r = 0.0;
            if (g.nt_ptr[t + 1] > g.nt_ptr[t]) r = ev_rank[g.nt_idx[g.nt_ptr[t]]];
            for (int32_t j = g.nt_ptr[t]; j < g.nt_ptr[t + 1]; j++)
                if (ev_rank[g.nt_idx[j]] > r) r = ev_rank[g.nt_idx[j]];
            double rt = cost[t] + r;
            rank[t] = rt;
            for (int32_t j = g.w_ptr[t]; j < g.w_ptr[t + 1]; j++)
                if (rt > ev_rank[g.w_idx[j]]) ev_rank[g.w_idx[j]] = rt;
        }
    }
    free(order); free(ev_rank); graph_free(&g);
    return len;
}

/* Kahn's walk over dependencies and queue order (the static deadlock check): the count of
 * tasks it orders (n: no cycle), or -1 when out of memory. */
int32_t cutemk_check_order(int32_t n, int32_t e, const int32_t *wait_ptr, const int32_t *wait_idx,
                           const int32_t *ntf_ptr, const int32_t *ntf_idx,
                           const int32_t *queue_next) {
    graph_t g;
    if (graph_build(&g, n, e, wait_ptr, wait_idx, ntf_ptr, ntf_idx)) return -1;
    int32_t *order = malloc(sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
    int32_t len = order ? kahn(&g, queue_next, order) : -1;
    free(order); graph_free(&g);
    return len;
}

static void heap_push(int32_t *h, int32_t *len, int32_t v) {
    int32_t i = (*len)++;
    while (i > 0) {
        int32_t p = (i - 1) / 2;
        if (h[p] <= v) break;
        h[i] = h[p]; i = p;
    }
    h[i] = v;
}

static int32_t heap_pop(int32_t *h, int32_t *len) {
    int32_t top = h[0], v = h[--(*len)], i = 0, n = *len;
    for (;;) {
        int32_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && h[c + 1] < h[c]) c++;
        if (v <= h[c]) break;
        h[i] = h[c]; i = c;
    }
    if (n > 0) h[i] = v;
    return top;
}

/* The list scheduler (StaticScheduler.build's main loop): tasks in priority order among the
 * ready ones (by_prio: priority -> task, a total order), each on the SM where it can start
 * earliest; between SMs where it can start as early, the first (idle_ties 0) or the one free
 * longest (idle_ties 1). Writes each task's SM and the order tasks were placed; returns 0, or
 * -1 when out of memory or when not every task could be placed (a cycle). */
int32_t cutemk_list_schedule(int32_t n, int32_t e, const int32_t *wait_ptr,
                             const int32_t *wait_idx, const int32_t *ntf_ptr,
                             const int32_t *ntf_idx, const double *cost, const int32_t *by_prio,
                             int32_t num_sms, double hop, int32_t idle_ties, int32_t *sm_of,
                             int32_t *placed) {
    graph_t g;
    if (graph_build(&g, n, e, wait_ptr, wait_idx, ntf_ptr, ntf_idx)) return -1;
    double *ev_best = malloc(sizeof(double) * (size_t)(e > 0 ? e : 1));
    double *ev_second = malloc(sizeof(double) * (size_t)(e > 0 ? e : 1));
    int32_t *ev_sm = malloc(sizeof(int32_t) * (size_t)(e > 0 ? e : 1));
    int32_t *ev_left = malloc(sizeof(int32_t) * (size_t)(e > 0 ? e : 1));
    int32_t *missing = malloc(sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
    int32_t *prio = malloc(sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
    int32_t *heap = malloc(sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
    double *sm_free = calloc((size_t)num_sms, sizeof(double));
    double *start = malloc(sizeof(double) * (size_t)num_sms);
    int32_t rc = -1;
    if (!ev_best || !ev_second || !ev_sm || !ev_left || !missing || !prio || !heap || !sm_free ||
        !start)
        goto done;
    for (int32_t i = 0; i < e; i++) { ev_best[i] = -1.0; ev_second[i] = -1.0; ev_sm[i] = -1; }
    memcpy(ev_left, g.nprod, sizeof(int32_t) * (size_t)e);
    for (int32_t i = 0; i < n; i++) prio[by_prio[i]] = i;
    int32_t hlen = 0, count = 0;
    for (int32_t t = 0; t < n; t++) {
        missing[t] = g.w_ptr[t + 1] - g.w_ptr[t];
        if (missing[t] == 0) heap_push(heap, &hlen, prio[t]);
    }
    while (hlen > 0) {
        int32_t t = by_prio[heap_pop(heap, &hlen)];
        int32_t sm;
        double begin;
        if (g.w_ptr[t + 1] > g.w_ptr[t]) {
            double b_best = -1.0, b_second = -1.0;
            int32_t b_sm = -1;
            for (int32_t j = g.w_ptr[t]; j < g.w_ptr[t + 1]; j++) {
                int32_t ev = g.w_idx[j];
                double f = ev_best[ev];
                int32_t fsm = ev_sm[ev];
                if (fsm == b_sm) {
                    if (f > b_best) b_best = f;
                } else if (f > b_best) {
                    if (b_best > b_second) b_second = b_best;
                    b_best = f; b_sm = fsm;
                } else if (f > b_second) {
                    b_second = f;
                }
            }
            for (int32_t j = g.w_ptr[t]; j < g.w_ptr[t + 1]; j++) {
                int32_t ev = g.w_idx[j];
                double v = ev_sm[ev] != b_sm ? ev_best[ev] : ev_second[ev];
                if (v > b_second) b_second = v;
            }
            double threshold = b_best + hop;
            for (int32_t s = 0; s < num_sms; s++)
                start[s] = sm_free[s] > threshold ? sm_free[s] : threshold;
            double own = b_second >= 0.0 ? b_second + hop : 0.0;
            if (b_best > own) own = b_best;
            if (b_sm >= 0) start[b_sm] = sm_free[b_sm] > own ? sm_free[b_sm] : own;
            sm = 0;
            for (int32_t s = 1; s < num_sms; s++)
                if (start[s] < start[sm] ||
                    (idle_ties && start[s] == start[sm] && sm_free[s] < sm_free[sm]))
                    sm = s;
            begin = start[sm];
        } else {
            sm = 0;
            for (int32_t s = 1; s < num_sms; s++) if (sm_free[s] < sm_free[sm]) sm = s;
            begin = sm_free[sm];
        }
        double ft = begin + cost[t];
        sm_free[sm] = ft;
        sm_of[t] = sm;
        placed[count++] = t;
        for (int32_t j = g.nt_ptr[t]; j < g.nt_ptr[t + 1]; j++) {
            int32_t ev = g.nt_idx[j];
            if (ev_sm[ev] == sm) {
                if (ft > ev_best[ev]) ev_best[ev] = ft;
            } else if (ft > ev_best[ev]) {
                if (ev_best[ev] > ev_second[ev]) ev_second[ev] = ev_best[ev];
                ev_best[ev] = ft; ev_sm[ev] = sm;
            } else if (ft > ev_second[ev]) {
                ev_second[ev] = ft;
            }
            if (--ev_left[ev] == 0)
                for (int32_t k = g.c_ptr[ev]; k < g.c_ptr[ev + 1]; k++) {
                    int32_t c = g.c_idx[k];
                    if (--missing[c] == 0) heap_push(heap, &hlen, prio[c]);
                }
        }
    }
    rc = count == n ? 0 : -1;
done:
    free(ev_best); free(ev_second); free(ev_sm); free(ev_left); free(missing); free(prio);
    free(heap); free(sm_free); free(start); graph_free(&g);
    return rc;
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* The tasks writing the cells of each of n_ranges boxes of cells (ranges: n_ranges x ndim x
 * [lo, hi), half-open cell indices) of a tiling's write index (grid: the cells row-major, the
 * writer's task id or -1, dims shape[ndim]): per box its writers, sorted, each once, as CSR
 * (out_ptr[n_ranges + 1], out_idx, room for cap entries: the boxes' cells are enough).
 * Returns the entries written, or -1 when cap is too small or ndim is not 1 to 8. */
int64_t cutemk_cell_sources(int32_t ndim, const int64_t *shape, const int32_t *grid,
                            int32_t n_ranges, const int64_t *ranges, int32_t *out_ptr,
                            int32_t *out_idx, int64_t cap) {
    int64_t k = 0;
    int64_t idx[8];
    if (ndim < 1 || ndim > 8) return -1;
    for (int32_t u = 0; u < n_ranges; u++) {
        const int64_t *r = ranges + (int64_t)u * ndim * 2;
        out_ptr[u] = (int32_t)k;
        int64_t start = k, empty = 0;
        for (int32_t d = 0; d < ndim; d++) {
            if (r[2 * d + 1] <= r[2 * d]) empty = 1;
            idx[d] = r[2 * d];
        }
        if (!empty) {
            for (;;) {
                int64_t flat = 0;
                for (int32_t d = 0; d < ndim; d++) flat = flat * shape[d] + idx[d];
                int32_t w = grid[flat];
                if (w >= 0) {
                    if (k >= cap) return -1;
                    out_idx[k++] = w;
                }
                int32_t d = ndim - 1;
                while (d >= 0 && ++idx[d] >= r[2 * d + 1]) { idx[d] = r[2 * d]; d--; }
                if (d < 0) break;
            }
        }
        qsort(out_idx + start, (size_t)(k - start), sizeof(int32_t), cmp_i32);
        int64_t m = start;
        for (int64_t j = start; j < k; j++)
            if (j == start || out_idx[j] != out_idx[m - 1]) out_idx[m++] = out_idx[j];
        k = m;
    }
    out_ptr[n_ranges] = (int32_t)k;
    return k;
}
