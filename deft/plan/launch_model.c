/* The coarsening rule and its launch model (deft.plan.coarsen.coarsen_factor, lpt_makespan,
 * lpt_factor, resident_wave, modelled_makespan); included by flatten_plan.c (one extension
 * module), after its types. */

/* a + b and a * b for a, b >= 0, saturating at INT64_MAX (as deft.plan.coarsen's model does):
 * a tile size near 2**63 must not overflow the model's loads. */
static i64 sat_add(i64 a, i64 b) {
    i64 r;
    return __builtin_add_overflow(a, b, &r) ? INT64_MAX : r;
}

static i64 sat_mul(i64 a, i64 b) {
    i64 r;
    return __builtin_mul_overflow(a, b, &r) ? INT64_MAX : r;
}

/* Binary min-heap of (load, count) groups of launch slots, by load. */
static void heap_push(i64 *load, i64 *count, i64 *n, i64 v, i64 c) {
    i64 i = (*n)++;
    while (i > 0 && load[(i - 1) / 2] > v) {
        load[i] = load[(i - 1) / 2];
        count[i] = count[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    load[i] = v;
    count[i] = c;
}

static void heap_pop(i64 *load, i64 *count, i64 *n) {
    i64 v = load[--(*n)], c = count[*n], i = 0;
    for (;;) {
        i64 k = 2 * i + 1;
        if (k >= *n) break;
        if (k + 1 < *n && load[k + 1] < load[k]) k++;
        if (load[k] >= v) break;
        load[i] = load[k];
        count[i] = count[k];
        i = k;
    }
    load[i] = v;
    count[i] = c;
}

/* Run flags (run_flag[i]) of the masked-tile model (deft.plan.coarsen.run_masks). */
enum { RUN_MASKED = 1, RUN_CUT = 2 };

/* Makespan of the launch for coarsening factor u, modelled as longest-first list scheduling
 * onto `slots` identical slots (programs start in that order: deft.plan.packing sorts the work
 * items by length and the kernel's KV heads vary fastest). A run of r plan tiles with c
 * query-row chunks gives r / u tiles of u plan tiles and one of r % u, each c * heads
 * programs of (plan tiles * block_kv + program_cost) tokens. The tile holding a RUN_MASKED
 * run's last plan tile costs masked_cost more and starts after the unmasked ones of its
 * length; a RUN_CUT run gives tiles of its other r - 1 plan tiles and that one alone.
 * `count` has 2 (u + 1) entries: unmasked tiles by length, then masked ones. */
static i64 lpt_makespan(const i64 *run_len, const i64 *run_chunks, const i64 *run_flag,
                        i64 nruns, i64 u, i64 heads, i64 block_kv, i64 slots, i64 program_cost,
                        i64 masked_cost, i64 *count, i64 *load, i64 *group) {
    i64 n = 0, span = 0, *masked = count + u + 1;
    memset(count, 0, (size_t)(2 * (u + 1)) * sizeof(i64));
    for (i64 i = 0; i < nruns; i++) {
        i64 r = run_len[i], c = run_chunks[i] * heads, f = run_flag ? run_flag[i] : 0;
        if (f & RUN_CUT) {
            count[u] += (r - 1) / u * c;
            count[(r - 1) % u] += c;
            masked[1] += c;
        } else if (f & RUN_MASKED) {
            i64 full = (r - 1) / u;
            count[u] += full * c;
            masked[r - full * u] += c;
        } else {
            count[u] += r / u * c;
            count[r % u] += c;
        }
    }
    heap_push(load, group, &n, 0, slots);
    for (i64 len = u; len >= 1; len--) {
        for (int mm = 0; mm < 2; mm++) {
            i64 left = mm ? masked[len] : count[len];
            i64 cost = sat_add(sat_add(sat_mul(len, block_kv), program_cost), mm ? masked_cost : 0);
            while (left > 0) {
                i64 v = load[0], m = group[0], k = m < left ? m : left;
                heap_pop(load, group, &n);
                heap_push(load, group, &n, sat_add(v, cost), k);
                if (m > k) heap_push(load, group, &n, v, m - k);
                left -= k;
            }
        }
    }
    for (i64 i = 0; i < n; i++)
        if (load[i] > span) span = load[i];
    return span;
}

/* Programs of the launch at coarsening factor u: each run's tiles times its chunks and heads. */
static i64 launch_programs(const i64 *run_len, const i64 *run_chunks, i64 nruns, i64 u,
                           i64 heads) {
    i64 programs = 0;
    for (i64 r = 0; r < nruns; r++) programs += ceil_div(run_len[r], u) * run_chunks[r] * heads;
    return programs;
}

/* Whether kept tile i starts a new run of tiles of one group (deft.plan.coarsen.group_runs). */
static int new_run(const i64 *kqs, const i64 *kqe, i64 i) {
    return i == 0 || kqs[i] != kqs[i - 1] || kqe[i] != kqe[i - 1];
}

/* The runs of kept tiles that serve one group (deft.plan.coarsen.plan_runs): their lengths,
 * row chunks and masked-tile flags (run_masks; none without masked_cost) in ws. Returns
 * their number. */
static i64 model_runs(const i64 *kqs, const i64 *kqe, const i64 *masked, i64 nk, i64 g,
                      i64 block_m, i64 masked_apart, i64 masked_cost, i64 *x, const Ws *w) {
    i64 *run_len = x + w->mask_from, *run_chunks = x + w->slot0, *run_flag = x + w->run_flag;
    i64 nruns = 0;
    for (i64 i = 0; i < nk; i++) {
        if (new_run(kqs, kqe, i)) {
            run_len[nruns] = 0;
            run_chunks[nruns++] = ceil_div((kqe[i] - kqs[i]) * g, block_m);
        }
        run_len[nruns - 1]++;
        if (i + 1 == nk || new_run(kqs, kqe, i + 1)) {
            i64 r = run_len[nruns - 1];
            run_flag[nruns - 1] = masked_cost > 0 && masked[i]
                ? RUN_MASKED | (masked_apart && r > 1 && !masked[i - 1] ? RUN_CUT : 0) : 0;
        }
    }
    return nruns;
}

/* The factor of the shortest modelled makespan (the smallest on ties) among factor + i *
 * factor / s for i = 0..s, s = min(factor, 16), up to max_factor: every factor up to twice
 * the rule's when it is at most 16, else 17 of them. Longer tiles pay when fewer programs
 * leave less of a last wave; with one wave or more than 8 at the rule's factor, none is
 * tried. The model runs on resident_slots where 0 < resident_slots < slots, else on slots,
 * and with masked_cost > 0 charges masked tiles (`masked` per kept tile, cut off with
 * masked_apart). Then, with 0 < resident_slots < slots (deft.plan.coarsen.resident_wave): the
 * smallest factor up to 4x the rule's that fits one wave of resident_slots programs, if the
 * model on those slots finishes it sooner. */
static i64 lpt_factor(const i64 *kqs, const i64 *kqe, const i64 *masked, i64 nk, i64 factor,
                      i64 g, i64 block_m, i64 heads, i64 block_kv, i64 max_factor, i64 slots,
                      i64 program_cost, i64 resident_slots, i64 masked_apart, i64 masked_cost,
                      i64 *x, const Ws *w) {
    i64 *run_len = x + w->mask_from, *run_chunks = x + w->slot0, *run_flag = x + w->run_flag;
    i64 nruns, best = factor, best_span = -1, steps = factor < 16 ? factor : 16;
    i64 programs, limit, lo, hi, model_slots;
    i64 *count = x + w->bucket, *load = x + w->heap_load, *group = x + w->heap_count;
    int fewer = resident_slots > 0 && resident_slots < slots;
    if (slots <= 0) return factor;
    model_slots = fewer ? resident_slots : slots;
    nruns = model_runs(kqs, kqe, masked, nk, g, block_m, masked_apart, masked_cost, x, w);
    /* In one wave the rule's factor is best (longer tiles only lengthen the longest program);
     * past 8 waves a last wave costs little. */
    programs = launch_programs(run_len, run_chunks, nruns, factor, heads);
    if (programs > model_slots && programs <= 8 * model_slots) {
        for (i64 i = 0; i <= steps; i++) {
            i64 u = factor + i * factor / steps, span;
            if (u > max_factor) break;
            span = lpt_makespan(run_len, run_chunks, run_flag, nruns, u, heads, block_kv,
                                model_slots, program_cost, masked_cost, count, load, group);
            if (best_span < 0 || span < best_span) {
                best_span = span;
                best = u;
            }
        }
    }
    if (!fewer) return best;
    limit = 4 * factor < max_factor ? 4 * factor : max_factor;
    if (limit <= best ||
        launch_programs(run_len, run_chunks, nruns, best, heads) <= resident_slots ||
        launch_programs(run_len, run_chunks, nruns, limit, heads) > resident_slots)
        return best;
    lo = best;
    hi = limit;
    while (hi - lo > 1) {
        i64 mid = (lo + hi) / 2;
        if (launch_programs(run_len, run_chunks, nruns, mid, heads) <= resident_slots) hi = mid;
        else lo = mid;
    }
    if (lpt_makespan(run_len, run_chunks, NULL, nruns, hi, heads, block_kv, resident_slots,
                     program_cost, 0, count, load, group) <
        lpt_makespan(run_len, run_chunks, NULL, nruns, best, heads, block_kv, resident_slots,
                     program_cost, 0, count, load, group))
        return hi;
    return best;
}

/* The launch model's makespan at coarsening factor u (deft.plan.coarsen.modelled_makespan),
 * on resident_slots where 0 < resident_slots < slots, else on slots; 0 without a model. */
static i64 modelled_makespan(const i64 *kqs, const i64 *kqe, const i64 *masked, i64 nk, i64 u,
                             i64 g, i64 block_m, i64 heads, i64 block_kv, i64 slots,
                             i64 program_cost, i64 resident_slots, i64 masked_apart,
                             i64 masked_cost, i64 *x, const Ws *w) {
    i64 nruns;
    if (slots <= 0 || nk == 0) return 0;
    nruns = model_runs(kqs, kqe, masked, nk, g, block_m, masked_apart, masked_cost, x, w);
    return lpt_makespan(x + w->mask_from, x + w->slot0, x + w->run_flag, nruns, u, heads,
                        block_kv, resident_slots > 0 && resident_slots < slots ? resident_slots
                                                                                : slots,
                        program_cost, masked_cost, x + w->bucket, x + w->heap_load,
                        x + w->heap_count);
}

/* The coarsening factor of the kept tiles (deft.plan.coarsen.coarsen_factor): about work /
 * (waves * SMs) tokens, at least min_tile_tokens unless that leaves fewer programs than SMs,
 * rounded down to 2^k or 3 * 2^k plan tiles, then the launch model's choice (lpt_factor). */
static i64 rule_factor(const i64 *kqs, const i64 *kqe, const i64 *masked, i64 nk, i64 work,
                       i64 block_kv, i64 g, i64 block_m, i64 num_kv_heads, i64 sms,
                       double waves, i64 min_tile_tokens, i64 max_factor, i64 slots,
                       i64 program_cost, i64 resident_slots, i64 masked_apart,
                       i64 masked_cost, i64 *x, const Ws *w) {
    double wk = (double)num_kv_heads * (double)work, length = (double)block_kv;
    double floor_len = fmin((double)min_tile_tokens, wk / (double)sms);
    double balanced = wk / (waves * (double)sms);
    double e;
    i64 factor = 1;
    if (nk == 0) return 1;
    if (floor_len > length) length = floor_len;
    if (balanced > length) length = balanced;
    /* _factor: the largest 2^k or 3 * 2^k plan tiles within the length. */
    e = floor(log2(length / (double)block_kv));
    for (; e >= 1 && factor < max_factor; e -= 1) factor *= 2;
    if (factor >= 2 && factor < max_factor && 1.5 * (double)factor <= length / (double)block_kv)
        factor += factor / 2;
    if (factor > max_factor) factor = max_factor;
    return lpt_factor(kqs, kqe, masked, nk, factor, g, block_m, num_kv_heads, block_kv,
                      max_factor, slots, program_cost, resident_slots, masked_apart,
                      masked_cost, x, w);
}

/* Whether kept tile i, of the run starting at run_start, starts a tile of coarsen_plan: every
 * factor-th tile of a run, and with masked_apart a run's masked last tile after an unmasked
 * one. */
static int starts_tile(const i64 *kqs, const i64 *kqe, const i64 *masked, i64 nk, i64 i,
                       i64 run_start, i64 factor, i64 masked_apart) {
    return (i - run_start) % factor == 0 ||
           (masked_apart && (i + 1 == nk || new_run(kqs, kqe, i + 1)) && masked[i] &&
            !masked[i - 1]);
}

/* Partial states of the kept tiles coarsened by `factor` (a state per query of each tile's
 * group). */
static i64 coarsened_partials(const i64 *kqs, const i64 *kqe, const i64 *masked, i64 nk,
                              i64 factor, i64 masked_apart) {
    i64 parts = 0, run_start = 0;
    for (i64 i = 0; i < nk; i++) {
        if (new_run(kqs, kqe, i)) run_start = i;
        if (starts_tile(kqs, kqe, masked, nk, i, run_start, factor, masked_apart))
            parts += kqe[i] - kqs[i];
    }
    return parts;
}
