/* DeFT-Flatten planning for the kernel backends, in a few linear passes.
 *
 * Computes exactly what deft.plan.step.flatten_cut (the flatten tiles, cut at long nodes
 * where the launch model says so), then deft.plan.coarsen.refine (coarsening) and
 * deft.plan.packing.pack (work items, tile flags, reduction map, int32 packing) compute with
 * numpy, without a comparison sort but over nearly sorted work items: orders come from
 * counting sorts and walks over the nodes in DFS preorder. A CPython extension module: the
 * planning is plain C on raw arrays; thin wrappers at the end (`plan`, `fill`, `mask`) take
 * numpy arrays through the buffer protocol, so a step's planning is one call from Python.
 * `mask` (tile_masks.c, included) evaluates the visibility predicate (deft.plan.visibility)
 * of tiles of any plan into dense boolean masks, for the torch backend.
 *
 * The two steps share a workspace `ws` (int64) that the caller keeps between steps:
 *   flatten_plan  orders nodes and queries, cuts and coarsens the tiles and sizes
 *                 everything; the header of ws then holds the sizes below;
 *   flatten_fill  writes the plan arrays into `out` (int64, optional) and the device buffer
 *                 into `packed` (int32), which the caller sized from those sizes.
 * The layout is assumed valid (deft.TreeLayout checks it); a malformed forest gives -1.
 *
 * `out` holds, one after the other: token slots, lo, hi, off [N each], tile_indptr [T + 1],
 * tile_q_start, tile_q_end [T each], partial_indptr [T + 1], query_order, query_pre,
 * query_len [Q each], merge_indptr [Q + 1], merge_partials [P]: the TreePlan arrays.
 * `packed` holds the segments token slots, lo, hi, off, work items (8 per item), query
 * order, pre, len, merge indptr, merge partials, each starting at a multiple of 16 elements
 * (offsets in the header), gaps zeroed. Token lo, hi and off are written only where the
 * kernels read them, from each tile's mask_from on (usually few tokens: over a shared
 * prompt, none); other entries keep what the buffer held.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef int64_t i64;
typedef int32_t i32;

/* Header slots of ws (py_plan returns the sizes and segment offsets among them). */
enum {
    H_N, H_T, H_P, H_W, H_Q, H_SORTED, H_ALL_MERGED, H_OUT_SIZE,
    H_SEG, /* 11 offsets of the packed segments; the last is the buffer's length */
    H_NODES = H_SEG + 11, H_TOKENS, H_BLOCK_KV, H_MAX_FACTOR, H_G, H_BLOCK_M, H_NODE_CUT,
    /* for fill */
    H_SIZE
};

/* Offsets (in int64 elements) of the arrays inside ws. */
typedef struct {
    i64 order, hi, fstart, cnt_lt, min_len, child_ptr, children, stack;  /* [nodes + 3] */
    i64 q_order, q_pre, q_len, merge_indptr, cursor;                     /* [queries + 1] */
    i64 kept, kept_end, kept_qs, kept_qe, cstart, tile_indptr, tile_qs;  /* [tiles + 1] */
    i64 tile_qe;
    i64 partial_indptr, mask_from, slot0, by_len, run_flag;
    i64 bucket;                                                    /* [2 (max_factor + 2)] */
    i64 heap_load, heap_count;                                           /* [slots + 1] */
    i64 total;
} Ws;

/* For a >= 0, b > 0, without the overflow of (a + b - 1) / b when b is near INT64_MAX. */
static i64 ceil_div(i64 a, i64 b) { return a / b + (a % b != 0); }

/* End of the flattened tile that starts at token s, without overflowing s + block_kv. */
static i64 tile_end(i64 s, i64 block_kv, i64 nl) { return block_kv < nl - s ? s + block_kv : nl; }

/* Room for the tiles: a cut at nodes (node_cut > 0) adds at most one per node. */
static Ws ws_layout(i64 nodes, i64 tokens, i64 queries, i64 block_kv, i64 max_factor,
                    i64 slots, i64 node_cut) {
    Ws w;
    i64 off = H_SIZE, nn = nodes + 3, nq = queries + 1;
    i64 nt = ceil_div(tokens, block_kv) + 2 + (node_cut > 0 ? nodes : 0);
#define PLACE(field, size) (w.field = off, off += (size))
    PLACE(order, nn); PLACE(hi, nn); PLACE(fstart, nn); PLACE(cnt_lt, nn); PLACE(min_len, nn);
    PLACE(child_ptr, nn); PLACE(children, nn); PLACE(stack, nn);
    PLACE(q_order, nq); PLACE(q_pre, nq); PLACE(q_len, nq); PLACE(merge_indptr, nq);
    PLACE(cursor, nq);
    PLACE(kept, nt); PLACE(kept_end, nt); PLACE(kept_qs, nt); PLACE(kept_qe, nt);
    PLACE(cstart, nt);
    PLACE(tile_indptr, nt); PLACE(tile_qs, nt); PLACE(tile_qe, nt); PLACE(partial_indptr, nt);
    PLACE(mask_from, nt); PLACE(slot0, nt); PLACE(by_len, nt); PLACE(run_flag, nt);
    PLACE(bucket, 2 * (max_factor + 2));
    PLACE(heap_load, slots + 1); PLACE(heap_count, slots + 1);  /* planning only, so last */
#undef PLACE
    w.total = off;
    return w;
}

/* DFS preorder (roots, then children, in index order): order[k]; hi[k], the end of k's
 * subtree interval in preorder; fstart[k], the flattened offset of k's first token; and
 * pre[node] in `pre`. */
static int preorder(const i64 *parents, const i64 *indptr, i64 n, i64 *x, const Ws *w,
                    i64 *pre) {
    i64 *ptr = x + w->child_ptr, *children = x + w->children, *stack = x + w->stack;
    i64 *order = x + w->order, *hi = x + w->hi, *fstart = x + w->fstart;
    i64 sp = 0, k = 0;
    /* Children CSR by counting sort (stable); roots are the children of n. */
    memset(ptr, 0, (size_t)(n + 3) * sizeof(i64));
    for (i64 i = 0; i < n; i++) ptr[(parents[i] < 0 ? n : parents[i]) + 2]++;
    for (i64 j = 2; j < n + 3; j++) ptr[j] += ptr[j - 1];
    for (i64 i = 0; i < n; i++) children[ptr[(parents[i] < 0 ? n : parents[i]) + 1]++] = i;
    for (i64 j = ptr[n + 1] - 1; j >= ptr[n]; j--) stack[sp++] = children[j];
    while (sp) {
        i64 node = stack[--sp];
        if (k == n) return -1;
        order[k] = node;
        pre[node] = k++;
        for (i64 j = ptr[node + 1] - 1; j >= ptr[node]; j--) stack[sp++] = children[j];
    }
    if (k != n) return -1;
    /* Subtree sizes per node (in `stack`), children before parents. */
    for (i64 i = 0; i < n; i++) stack[i] = 1;
    for (k = n - 1; k >= 0; k--) {
        i64 node = order[k];
        hi[k] = k + stack[node];
        if (parents[node] >= 0) stack[parents[node]] += stack[node];
    }
    fstart[0] = 0;
    for (k = 0; k < n; k++) fstart[k + 1] = fstart[k] + indptr[order[k] + 1] - indptr[order[k]];
    return 0;
}

#include "launch_model.c"  /* the coarsening rule and its launch model */

/* Kept tiles of the flattened tokens (deft.plan.make_plan "flatten"): block_kv tokens each,
 * restarting at the first token of every node of at least node_cut tokens when node_cut > 0.
 * A tile's group is the queries whose node lies in [lo of its first token, max hi of its
 * tokens); tiles nobody sees are dropped. Writes each kept tile's token range, group and
 * (with want_masked) whether some group query may not see some of its tokens
 * (deft.plan.coarsen.masked_tiles); returns how many, with their tokens, token work
 * (tokens times row chunks) and partial states in *ntok, *work and *partials. */
static i64 cut_tiles(i64 n, i64 nl, i64 block_kv, i64 node_cut, i64 g, i64 block_m,
                     int want_masked, const i64 *hi, const i64 *fstart, const i64 *cnt_lt,
                     const i64 *min_len, i64 *kept, i64 *kend, i64 *kqs, i64 *kqe,
                     i64 *masked, i64 *ntok, i64 *work, i64 *partials) {
    i64 nk = 0;
    *ntok = *work = *partials = 0;
    for (i64 s = 0, k = 0; s < nl;) {
        i64 e = tile_end(s, block_kv, nl), ghi, qs, qe;
        while (fstart[k + 1] <= s) k++;
        if (node_cut > 0)
            for (i64 j = k + 1; j < n && fstart[j] < e; j++)
                if (fstart[j + 1] - fstart[j] >= node_cut) {
                    e = fstart[j];
                    break;
                }
        ghi = hi[k];
        for (i64 j = k + 1; j < n && fstart[j] < e; j++)
            if (fstart[j + 1] > fstart[j] && hi[j] > ghi) ghi = hi[j];
        qs = cnt_lt[k];
        qe = cnt_lt[ghi];
        if (qe > qs) {
            /* Some query of the group may not see some token of the tile
             * (deft.plan.packing.mask_from before the tile's end). */
            if (want_masked) {
                masked[nk] = 0;
                for (i64 j = k; j < n && fstart[j] < e && !masked[nk]; j++) {
                    i64 a = fstart[j] > s ? fstart[j] : s;
                    i64 b = fstart[j + 1] < e ? fstart[j + 1] : e;
                    if (b > a && (!(cnt_lt[j] <= qs && cnt_lt[hi[j]] >= qe) ||
                                  min_len[j] <= b - 1 - fstart[j]))
                        masked[nk] = 1;
                }
            }
            kept[nk] = s;
            kend[nk] = e;
            kqs[nk] = qs;
            kqe[nk] = qe;
            nk++;
            *ntok += e - s;
            *work += (e - s) * ceil_div((qe - qs) * g, block_m);
            *partials += qe - qs;
        }
        s = e;
    }
    return nk;
}

/* Returns 0; the workspace size needed if ws_size is smaller; -1 for a malformed forest.
 * parents [n], indptr [n + 1], query_nodes and query_kv_lens [nq]. */
static i64 flatten_plan(const i64 *parents, const i64 *indptr, i64 n, const i64 *query_nodes,
                        const i64 *query_kv_lens, i64 nq, i64 block_kv, i64 g, i64 block_m,
                        i64 num_kv_heads, i64 sms, double waves, i64 min_tile_tokens,
                        i64 max_factor, i64 slots, i64 program_cost, i64 resident_slots,
                        i64 masked_apart, i64 masked_cost, i64 node_cut, i64 *x,
                        i64 ws_size) {
    i64 nl, nk, ntok = 0, work = 0, factor = 1, nt = 0, sorted = 1, cut = 0;
    i64 span_cut = 0, parts_cut = 0;
    i64 all_merged = 1, nwork = 0, run_start = 0, np_, offset = 0;
    i64 *pre, *hi, *fstart, *cnt_lt, *min_len, *cursor, *q_order, *q_pre, *q_len;
    i64 *kept, *kend, *kqs, *kqe, *cstart, *tile_indptr, *tqs, *tqe, *partial_indptr;
    i64 *merge_indptr, *diff, *seg, *masked;
    int want_masked = masked_apart || masked_cost > 0;
    Ws w;
    nl = indptr[n];
    w = ws_layout(n, nl, nq, block_kv, max_factor, slots, node_cut);
    if (w.total > ws_size) return w.total;
    hi = x + w.hi; fstart = x + w.fstart; cnt_lt = x + w.cnt_lt;
    min_len = x + w.min_len; q_order = x + w.q_order; q_pre = x + w.q_pre; q_len = x + w.q_len;
    kept = x + w.kept; kend = x + w.kept_end; kqs = x + w.kept_qs; kqe = x + w.kept_qe;
    cstart = x + w.cstart; tile_indptr = x + w.tile_indptr; tqs = x + w.tile_qs;
    tqe = x + w.tile_qe; partial_indptr = x + w.partial_indptr; merge_indptr = x + w.merge_indptr;
    pre = x + w.min_len;  /* pre[node] lives there until the queries are sorted */
    masked = x + w.by_len;  /* per kept tile, with masked_apart or masked_cost (fill's by_len) */
    cursor = x + w.children;  /* free after the preorder */
    diff = x + w.cursor;

    fstart[0] = 0;
    if (n > 0 && preorder(parents, indptr, n, x, &w, pre)) return -1;

    /* Queries, stably sorted by the preorder index of their node (counting sort). */
    memset(cnt_lt, 0, (size_t)(n + 1) * sizeof(i64));
    for (i64 i = 0; i < nq; i++) cnt_lt[pre[query_nodes[i]] + 1]++;
    for (i64 k = 0; k < n; k++) cnt_lt[k + 1] += cnt_lt[k];  /* queries with pre < k */
    memcpy(cursor, cnt_lt, (size_t)n * sizeof(i64));
    for (i64 i = 0; i < nq; i++) {
        i64 k = pre[query_nodes[i]], pos = cursor[k]++;
        q_order[pos] = i;
        q_pre[pos] = k;
        q_len[pos] = query_kv_lens[i];
        sorted &= pos == i;
    }
    /* Smallest query_kv_len of the queries on each node (preorder index). */
    for (i64 k = 0; k < n; k++) min_len[k] = INT64_MAX;
    for (i64 pos = 0; pos < nq; pos++)
        if (q_len[pos] < min_len[q_pre[pos]]) min_len[q_pre[pos]] = q_len[pos];

    /* The tiles cut at nodes of node_cut+ tokens where the launch model finishes them sooner
     * (on a tie, where they hold fewer partial states coarsened) and they hold no more
     * partial states than the plain tiles before coarsening (deft.plan.step.flatten_cut).
     * Only a long node that starts off the block_kv grid makes the two cuts differ. */
    if (node_cut > 0 && slots > 0)
        for (i64 k = 0; k < n && !cut; k++)
            cut = fstart[k + 1] - fstart[k] >= node_cut && fstart[k] % block_kv != 0;
    for (int pass = cut ? 0 : 1; pass < 3; pass++) {  /* cut, plain, and the cut if chosen */
        i64 at = pass == 1 ? 0 : node_cut, span, parts;
        nk = cut_tiles(n, nl, block_kv, at, g, block_m, want_masked, hi, fstart, cnt_lt,
                       min_len, kept, kend, kqs, kqe, masked, &ntok, &work, &parts);
        factor = rule_factor(kqs, kqe, masked, nk, work, block_kv, g, block_m, num_kv_heads,
                             sms, waves, min_tile_tokens, max_factor, slots, program_cost,
                             resident_slots, masked_apart, masked_cost, x, &w);
        if (!cut || pass == 2) break;
        span = modelled_makespan(kqs, kqe, masked, nk, factor, g, block_m, num_kv_heads,
                                 block_kv, slots, program_cost, resident_slots, masked_apart,
                                 masked_cost, x, &w);
        if (pass == 0) {
            span_cut = span;
            parts_cut = coarsened_partials(kqs, kqe, masked, nk, factor, masked_apart);
        } else if (!(cut = (span_cut < span || (span_cut == span &&
                            parts_cut < coarsened_partials(kqs, kqe, masked, nk, factor,
                                                           masked_apart))) &&
                           parts_cut <= parts)) {
            break;  /* the plain tiles stay */
        }
    }

    /* coarsen_plan: runs of tiles with the same group are cut into tiles of `factor` plan
     * tiles, and with masked_apart before a run's masked last tile that follows an unmasked
     * one; a tile starts at its first kept tile's offset among the plan tokens. */
    for (i64 i = 0; i < nk; i++) {
        if (new_run(kqs, kqe, i)) run_start = i;
        if (starts_tile(kqs, kqe, masked, nk, i, run_start, factor, masked_apart)) {
            tile_indptr[nt] = offset;
            cstart[nt++] = i;
        }
        offset += kend[i] - kept[i];
    }
    cstart[nt] = nk;
    partial_indptr[0] = 0;
    for (i64 ct = 0; ct < nt; ct++) {
        tqs[ct] = kqs[cstart[ct]];
        tqe[ct] = kqe[cstart[ct]];
        partial_indptr[ct + 1] = partial_indptr[ct] + tqe[ct] - tqs[ct];
        nwork += ceil_div((tqe[ct] - tqs[ct]) * g, block_m);
    }
    tile_indptr[nt] = ntok;
    np_ = partial_indptr[nt];

    /* Partials per query: group coverage of each sorted position, then CSR by query. */
    memset(diff, 0, (size_t)(nq + 1) * sizeof(i64));
    for (i64 ct = 0; ct < nt; ct++) { diff[tqs[ct]]++; diff[tqe[ct]]--; }
    merge_indptr[0] = 0;
    for (i64 pos = 0, run = 0; pos < nq; pos++) {
        run += diff[pos];
        merge_indptr[q_order[pos] + 1] = run;
        all_merged &= run > 0;
    }
    for (i64 i = 0; i < nq; i++) merge_indptr[i + 1] += merge_indptr[i];

    x[H_N] = ntok; x[H_T] = nt; x[H_P] = np_; x[H_W] = nwork; x[H_Q] = nq;
    x[H_SORTED] = sorted; x[H_ALL_MERGED] = all_merged;
    x[H_OUT_SIZE] = 4 * ntok + 4 * nt + 2 + 4 * nq + 1 + np_;
    {
        i64 sizes[10] = {ntok, ntok, ntok, ntok, 8 * nwork, nq, nq, nq, nq + 1, np_};
        seg = x + H_SEG;
        seg[0] = 0;
        for (int j = 0; j < 10; j++) seg[j + 1] = seg[j] + ceil_div(sizes[j], 16) * 16;
    }
    x[H_NODES] = n; x[H_TOKENS] = nl; x[H_BLOCK_KV] = block_kv; x[H_MAX_FACTOR] = max_factor;
    x[H_G] = g; x[H_BLOCK_M] = block_m; x[H_NODE_CUT] = node_cut;
    return 0;
}

/* One node segment of plan tokens, as int64 (the plan, unless `slot` is NULL) and int32
 * (the device buffer: lo, hi and off only if `masked`); one simple loop per array so that
 * each vectorises. Returns 1 if the slots are consecutive. */
static int write_tokens(const i64 *restrict src, i64 len, i64 k, i64 h, i64 o, int masked,
                        i64 *restrict slot, i64 *restrict lo, i64 *restrict hi,
                        i64 *restrict off, i32 *restrict slot32, i32 *restrict lo32,
                        i32 *restrict hi32, i32 *restrict off32) {
    i64 gaps = 0;
    for (i64 j = 0; j < len; j++) slot32[j] = (i32)src[j];
    for (i64 j = 1; j < len; j++) gaps |= src[j] - src[j - 1] - 1;
    if (slot) {
        memcpy(slot, src, (size_t)len * sizeof(i64));
        for (i64 j = 0; j < len; j++) lo[j] = k;
        for (i64 j = 0; j < len; j++) hi[j] = h;
        for (i64 j = 0; j < len; j++) off[j] = o + j;
    }
    if (!masked) return gaps == 0;
    for (i64 j = 0; j < len; j++) lo32[j] = (i32)k;
    for (i64 j = 0; j < len; j++) hi32[j] = (i32)h;
    for (i64 j = 0; j < len; j++) off32[j] = (i32)(o + j);
    return gaps == 0;
}

/* Writes int64 src[0:n] at out (unless NULL) and as int32 at packed[start:], zeroing the
 * packed gap up to `end`. */
static void emit(i64 *out, i32 *packed, i64 start, i64 end, const i64 *src, i64 n) {
    if (out) memcpy(out, src, (size_t)n * sizeof(i64));
    for (i64 i = 0; i < n; i++) packed[start + i] = (i32)src[i];
    for (i64 i = start + n; i < end; i++) packed[i] = 0;
}

/* by_len: the tiles 0..nt-1 by decreasing length, stably (as deft.plan.packing.work_items
 * orders them): a bottom-up merge sort through tmp [nt]. */
static void sort_by_length(const i64 *tile_indptr, i64 nt, i64 *by_len, i64 *tmp) {
    i64 *src = by_len, *dst = tmp;
    for (i64 i = 0; i < nt; i++) by_len[i] = i;
    for (i64 width = 1; width < nt; width *= 2) {
        for (i64 lo = 0; lo < nt; lo += 2 * width) {
            i64 mid = lo + width < nt ? lo + width : nt;
            i64 end = mid + width < nt ? mid + width : nt, a = lo, b = mid, o = lo;
            while (a < mid && b < end)  /* the right one first only if strictly longer */
                dst[o++] = tile_indptr[src[b] + 1] - tile_indptr[src[b]] >
                           tile_indptr[src[a] + 1] - tile_indptr[src[a]] ? src[b++] : src[a++];
            while (a < mid) dst[o++] = src[a++];
            while (b < end) dst[o++] = src[b++];
        }
        src = dst;
        dst = src == by_len ? tmp : by_len;
    }
    if (src != by_len) memcpy(by_len, src, (size_t)nt * sizeof(i64));
}

/* Returns flags: 1 if every tile's slots are consecutive, | 2 if some tile's are. With
 * `out` NULL, writes the device buffer only (the plan arrays are not needed to run it). */
static i64 flatten_fill(const i64 *indptr, const i64 *kv_indices, i64 *x, i64 *out,
                        i32 *packed) {
    i64 n = x[H_NODES], nl = x[H_TOKENS], nq = x[H_Q], block_kv = x[H_BLOCK_KV];
    i64 g = x[H_G], block_m = x[H_BLOCK_M], ntok = x[H_N], nt = x[H_T], np_ = x[H_P];
    i64 nwork = x[H_W], p = 0, all_contig = 1, any_contig = 0;
    const i64 *seg = x + H_SEG;
    Ws w = ws_layout(n, nl, nq, block_kv, x[H_MAX_FACTOR], 0, x[H_NODE_CUT]);
    const i64 *order = x + w.order, *hi = x + w.hi, *fstart = x + w.fstart;
    const i64 *cnt_lt = x + w.cnt_lt, *min_len = x + w.min_len, *kept = x + w.kept;
    const i64 *kend = x + w.kept_end;
    const i64 *cstart = x + w.cstart, *tile_indptr = x + w.tile_indptr;
    const i64 *tqs = x + w.tile_qs, *tqe = x + w.tile_qe, *partial_indptr = x + w.partial_indptr;
    const i64 *q_order = x + w.q_order, *merge_indptr = x + w.merge_indptr;
    i64 *mask_from = x + w.mask_from, *slot0 = x + w.slot0, *by_len = x + w.by_len;
    i64 *cursor = x + w.cursor;
    i64 *slot = NULL, *lo = NULL, *hi_out = NULL, *off = NULL, *tiles = NULL, *queries = NULL;
    i32 *slot32 = packed + seg[0], *lo32 = packed + seg[1], *hi32 = packed + seg[2];
    i32 *off32 = packed + seg[3], *work = packed + seg[4], *partials32 = packed + seg[9];
    if (out) {
        slot = out; lo = out + ntok; hi_out = out + 2 * ntok; off = out + 3 * ntok;
        tiles = out + 4 * ntok;
        queries = tiles + 4 * nt + 2;
    }

    /* Plan tokens, tile by tile, node segment by node segment, with each tile's
     * mask_from (_mask_from: the first token some group query may not see, checked per
     * segment against the smallest query_kv_len on its node) and slot0 (_tile_slot0:
     * consecutive slots). */
    for (i64 ct = 0, k = 0; ct < nt; ct++) {
        i64 qs = tqs[ct], qe = tqe[ct], first_bad = tile_indptr[ct + 1], contig = 1, prev = 0;
        i64 first = -1;
        for (i64 i = cstart[ct]; i < cstart[ct + 1]; i++) {
            i64 s = kept[i], e = kend[i];
            while (s < e) {
                i64 seg_end, len, o, h;
                const i64 *src;
                while (fstart[k + 1] <= s) k++;
                seg_end = fstart[k + 1] < e ? fstart[k + 1] : e;
                len = seg_end - s;
                o = s - fstart[k];
                h = hi[k];
                src = kv_indices + indptr[order[k]] + o;
                if (first_bad == tile_indptr[ct + 1]) {
                    if (!(cnt_lt[k] <= qs && cnt_lt[h] >= qe)) first_bad = p;
                    else if (min_len[k] <= o + len - 1)  /* offsets >= min_len are not seen */
                        first_bad = p + (min_len[k] > o ? min_len[k] - o : 0);
                }
                if (p > tile_indptr[ct]) contig &= src[0] == prev + 1;
                else first = src[0];
                /* The kernels read lo, hi and off only from the tile's mask_from on. */
                contig &= write_tokens(src, len, k, h, o, first_bad < p + len,
                                       out ? slot + p : NULL,
                                       out ? lo + p : NULL, out ? hi_out + p : NULL,
                                       out ? off + p : NULL, slot32 + p, lo32 + p, hi32 + p,
                                       off32 + p);
                prev = src[len - 1];
                p += len;
                s = seg_end;
            }
        }
        mask_from[ct] = first_bad;
        slot0[ct] = contig ? first : -1;
        all_contig &= contig;
        any_contig |= contig;
    }
    for (int j = 0; j < 4; j++)
        for (i64 i = seg[j] + ntok; i < seg[j + 1]; i++) packed[i] = 0;

    /* Work items: tiles by decreasing length, stably, each cut into chunks of block_m query
     * rows. */
    sort_by_length(tile_indptr, nt, by_len, x + w.run_flag);
    for (i64 r = 0, item = 0; r < nt; r++) {
        i64 ct = by_len[r], rows = (tqe[ct] - tqs[ct]) * g;
        for (i64 row0 = 0; row0 < rows; row0 += block_m, item++) {
            i32 *d = work + 8 * item;
            d[0] = (i32)tile_indptr[ct]; d[1] = (i32)tile_indptr[ct + 1];
            d[2] = (i32)tqs[ct]; d[3] = (i32)tqe[ct]; d[4] = (i32)partial_indptr[ct];
            d[5] = (i32)mask_from[ct]; d[6] = (i32)slot0[ct]; d[7] = (i32)row0;
        }
    }
    for (i64 i = seg[4] + 8 * nwork; i < seg[5]; i++) packed[i] = 0;

    /* Tile arrays, then the reduction map: each query's partials in increasing id. */
    if (out) {
        memcpy(tiles, tile_indptr, (size_t)(nt + 1) * sizeof(i64));
        memcpy(tiles + nt + 1, tqs, (size_t)nt * sizeof(i64));
        memcpy(tiles + 2 * nt + 1, tqe, (size_t)nt * sizeof(i64));
        memcpy(tiles + 3 * nt + 1, partial_indptr, (size_t)(nt + 1) * sizeof(i64));
    }
    memcpy(cursor, merge_indptr, (size_t)nq * sizeof(i64));
    for (i64 ct = 0, pid = 0; ct < nt; ct++)
        for (i64 pos = tqs[ct]; pos < tqe[ct]; pos++) partials32[cursor[q_order[pos]]++] = (i32)pid++;
    for (i64 i = seg[9] + np_; i < seg[10]; i++) packed[i] = 0;
    if (out) {
        i64 *merge_partials = queries + 4 * nq + 1;
        for (i64 i = 0; i < np_; i++) merge_partials[i] = partials32[i];
    }
    emit(queries, packed, seg[5], seg[6], q_order, nq);
    emit(queries ? queries + nq : NULL, packed, seg[6], seg[7], x + w.q_pre, nq);
    emit(queries ? queries + 2 * nq : NULL, packed, seg[7], seg[8], x + w.q_len, nq);
    emit(queries ? queries + 3 * nq : NULL, packed, seg[8], seg[9], merge_indptr, nq + 1);
    return all_contig | any_contig << 1;
}

/* ---- Python interface ---------------------------------------------------------------- */

/* Borrows obj's data as a 1-D C-contiguous native int64 array (writable if asked): 0, or -1
 * with no Python error left set. */
static int int64_view(PyObject *obj, Py_buffer *view, int writable) {
    const union { uint16_t u; uint8_t b[2]; } one = {1};
    const char *f;
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT |
                                          (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Clear();
        return -1;
    }
    f = view->format ? view->format : "B";
    if (*f == '@' || *f == '=' || (*f == '<' && one.b[0])) f++;
    if (view->ndim != 1 || view->itemsize != 8 || (*f != 'l' && *f != 'q') || f[1]) {
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static void release(Py_buffer *views, int n) {
    for (int i = 0; i < n; i++) PyBuffer_Release(&views[i]);
}

/* plan(parents, node_kv_indptr, query_nodes, query_kv_lens, kv_indices, block_kv, g,
 *      block_m, num_kv_heads, sms, waves, min_tile_tokens, max_factor, slots, program_cost,
 *      resident_slots, masked_apart, masked_cost, node_cut, ws, packed_address,
 *      packed_capacity)
 * Plans into the int64 array ws and, when packed_address is not 0 and the buffer holds
 * packed_capacity >= the packed size int32, fills it. Returns the tuple (flags, tokens,
 * tiles, partials, work items, queries, sorted, all merged, plan-array size, 11 segment
 * offsets) with flags -3 when not filled; else an int: the ws size needed, -1 for a
 * malformed forest, -2 for arrays that are not 1-D int64 of consistent lengths. */
static PyObject *py_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer v[6];
    long long p[22];
    double waves;
    i64 rc = -2, flags = -3, n, nq;
    i32 *packed;
    int got = 0;
    PyObject *res;
    (void)self;
    if (nargs != 22) {
        PyErr_SetString(PyExc_TypeError, "plan() takes 22 arguments");
        return NULL;
    }
    for (int i = 5; i < 22; i++)
        if (i != 10 && i != 19) p[i] = PyLong_AsLongLong(args[i]);
    waves = PyFloat_AsDouble(args[10]);
    packed = (i32 *)PyLong_AsVoidPtr(args[20]);
    if (PyErr_Occurred()) return NULL;
    for (; got < 6; got++)
        if (int64_view(args[got == 5 ? 19 : got], &v[got], got == 5) < 0) break;
    if (got == 6) {
        const i64 *indptr = v[1].buf;
        n = v[0].len / 8;
        nq = v[2].len / 8;
        if (v[1].len / 8 == n + 1 && v[3].len / 8 == nq && indptr[0] == 0 &&
            indptr[n] <= v[4].len / 8 && p[5] > 0 && p[7] > 0 && p[9] > 0 && p[12] > 0 &&
            p[18] >= 0) {
            i64 *x = v[5].buf;
            Py_BEGIN_ALLOW_THREADS
            rc = flatten_plan(v[0].buf, indptr, n, v[2].buf, v[3].buf, nq, p[5], p[6], p[7],
                              p[8], p[9], waves, p[11], p[12], p[13], p[14], p[15], p[16], p[17],
                              p[18], x, v[5].len / 8);
            if (rc == 0 && packed && x[H_SEG + 10] <= p[21])
                flags = flatten_fill(indptr, v[4].buf, x, NULL, packed);
            Py_END_ALLOW_THREADS
        }
    }
    if (rc != 0 || got < 6) {
        release(v, got);
        return PyLong_FromLongLong(rc);
    }
    res = PyTuple_New(20);
    if (res) {
        const i64 *x = v[5].buf;
        i64 head[9] = {flags, x[H_N], x[H_T], x[H_P], x[H_W], x[H_Q], x[H_SORTED],
                       x[H_ALL_MERGED], x[H_OUT_SIZE]};
        for (int i = 0; i < 20; i++) {
            PyObject *item = PyLong_FromLongLong(i < 9 ? head[i] : x[H_SEG + i - 9]);
            if (!item) {
                Py_CLEAR(res);
                break;
            }
            PyTuple_SET_ITEM(res, i, item);
        }
    }
    release(v, got);
    return res;
}

/* fill(node_kv_indptr, kv_indices, ws, out, packed_address): after plan() on the same
 * layout and ws, writes the packed buffer and, unless out is None, the plan arrays into the
 * int64 array out. Returns the flags (1: every tile's slots are consecutive, 2: some tile's
 * are), or -2 for bad arrays. */
static PyObject *py_fill(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer v[4];
    i64 flags = -2;
    i32 *packed;
    int need = 3, got = 0;
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "fill() takes 5 arguments");
        return NULL;
    }
    packed = (i32 *)PyLong_AsVoidPtr(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (args[3] != Py_None) need = 4;
    for (; got < need; got++)
        if (int64_view(args[got], &v[got], got >= 2) < 0) break;
    if (got == need && packed && v[2].len / 8 >= H_SIZE) {
        i64 *x = v[2].buf;
        if (need == 3 || v[3].len / 8 >= x[H_OUT_SIZE]) {
            Py_BEGIN_ALLOW_THREADS
            flags = flatten_fill(v[0].buf, v[1].buf, x, need == 4 ? v[3].buf : NULL, packed);
            Py_END_ALLOW_THREADS
        }
    }
    release(v, got);
    return PyLong_FromLongLong(flags);
}

#include "tile_masks.c"  /* the torch backend's masks: tile_masks and py_mask */

static PyMethodDef methods[] = {
    {"plan", (PyCFunction)(void (*)(void))py_plan, METH_FASTCALL, "Plan a flatten step."},
    {"fill", (PyCFunction)(void (*)(void))py_fill, METH_FASTCALL, "Write a planned step."},
    {"mask", (PyCFunction)(void (*)(void))py_mask, METH_FASTCALL, "Tiles' visibility masks."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_flatten_plan", "DeFT-Flatten planning (deft.plan.compiled).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__flatten_plan(void) { return PyModule_Create(&module); }
