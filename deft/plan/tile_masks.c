/* Dense visibility masks of plan tiles for the torch backend; included by flatten_plan.c
 * (one extension module), after its types and buffer helpers. */

/* First index in the ascending a[0:n] whose value is >= v. */
static i64 lower_bound(const i64 *a, i64 n, i64 v) {
    i64 lo = 0, hi = n;
    while (lo < hi) {
        i64 mid = lo + (hi - lo) / 2;
        if (a[mid] < v) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* Visibility masks of nt tiles, out[t, i, j] (uint8 0/1, [nt, G, L]): sorted query
 * q0[t] + i sees plan token tok0[t] + j, for i < group[t] and j < len[t]; 0 elsewhere.
 * q_pre is ascending, as in every plan. A run of tokens on one node at consecutive offsets
 * is seen wholly by the queries in the node's subtree below it and, up to their
 * query_kv_len, by those on the node: a range of sorted queries each, found by bisection,
 * so each (query, run) pair that sees anything is one memset. Returns 0, or -1 for a tile
 * out of bounds. */
static int tile_masks(const i64 *q_pre, const i64 *q_len, i64 nq, const i64 *lo, const i64 *hi,
                      const i64 *off, i64 ntok, const i64 *tok0, const i64 *len, const i64 *q0,
                      const i64 *group, i64 nt, i64 G, i64 L, uint8_t *out) {
    for (i64 t = 0; t < nt; t++)
        if (tok0[t] < 0 || len[t] < 0 || len[t] > L || tok0[t] > ntok - len[t] || q0[t] < 0 ||
            group[t] < 0 || group[t] > G || q0[t] > nq - group[t])
            return -1;
    if (nt * G * L > 0) memset(out, 0, (size_t)(nt * G * L));
    for (i64 t = 0; t < nt; t++) {
        const i64 *tlo = lo + tok0[t], *thi = hi + tok0[t], *toff = off + tok0[t];
        const i64 *pre = q_pre + q0[t], *qlen = q_len + q0[t];
        uint8_t *m = out + t * G * L;
        for (i64 j0 = 0, j1; j0 < len[t]; j0 = j1) {
            i64 k = tlo[j0], h = thi[j0], a, b, c;
            for (j1 = j0 + 1; j1 < len[t] && tlo[j1] == k && thi[j1] == h &&
                              toff[j1] == toff[j1 - 1] + 1; j1++) {}
            a = lower_bound(pre, group[t], k);  /* queries on node k: [a, b) */
            b = lower_bound(pre, group[t], k + 1);
            c = lower_bound(pre, group[t], h);  /* below it: [b, c) */
            for (i64 i = a; i < b; i++) {
                i64 n = qlen[i] - toff[j0];  /* tokens of the run within query_kv_len */
                if (n > 0) memset(m + i * L + j0, 1, (size_t)(n < j1 - j0 ? n : j1 - j0));
            }
            for (i64 i = b; i < c; i++) memset(m + i * L + j0, 1, (size_t)(j1 - j0));
        }
    }
    return 0;
}

/* mask(query_pre, query_len, token_lo, token_hi, token_off, tok0, len, q0, group, G, L, out)
 * Writes tile_masks into out, a writable C-contiguous buffer of nt * G * L bytes (a numpy
 * bool array). Returns 0, or -1 for bad arrays or a tile out of bounds. */
static PyObject *py_mask(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer v[9], o;
    i64 rc = -1, G, L, nt;
    int got = 0;
    (void)self;
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError, "mask() takes 12 arguments");
        return NULL;
    }
    G = PyLong_AsLongLong(args[9]);
    L = PyLong_AsLongLong(args[10]);
    if (PyErr_Occurred()) return NULL;
    for (; got < 9; got++)
        if (int64_view(args[got], &v[got], 0) < 0) break;
    if (got == 9 && PyObject_GetBuffer(args[11], &o, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) == 0) {
        i64 nq = v[0].len / 8, ntok = v[2].len / 8;
        nt = v[5].len / 8;
        if (v[1].len / 8 == nq && v[3].len / 8 == ntok && v[4].len / 8 == ntok &&
            v[6].len / 8 == nt && v[7].len / 8 == nt && v[8].len / 8 == nt && G >= 0 &&
            L >= 0 && o.itemsize == 1 &&
            (G == 0 || L == 0 ? o.len == 0 : nt <= o.len / G / L && o.len == nt * G * L)) {
            Py_BEGIN_ALLOW_THREADS
            rc = tile_masks(v[0].buf, v[1].buf, nq, v[2].buf, v[3].buf, v[4].buf, ntok,
                            v[5].buf, v[6].buf, v[7].buf, v[8].buf, nt, G, L, o.buf);
            Py_END_ALLOW_THREADS
        }
        PyBuffer_Release(&o);
    } else {
        PyErr_Clear();
    }
    release(v, got);
    return PyLong_FromLongLong(rc);
}
