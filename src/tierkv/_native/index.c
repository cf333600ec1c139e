/* The prefix index's per-block loops on the index's own Python objects: a C translation of
   tierkv/index.py's and the lru / hit_density / heap policies' methods (see tierkv/index_native.py,
   which builds and loads it through tierkv.native, and docs/design.md's native section). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <math.h>

/* No fused multiply-adds: tierkv.native compiles every source here with -ffp-contract=off (GCC and
   clang), so floating point rounds as the Python code does and the two paths decide alike. */

#define SLOT(o, off) (*(PyObject **)((char *)(o) + (off)))
enum { TAG_BITS = 4, BINS = 64, LEVELS = 2, CLASSES = 16, TIP = 1, SEEN = 2, EXTRA_SHIFT = 2, EXTRA_MASK = 3,
       BANDS = 4, BAND_SHIFT = 4, BAND_MASK = 3 };

static PyTypeObject *EntryT, *QueueT, *LruT, *HdT, *HeapT, *CostT;
static PyObject *heapify_f, *heap_taken_f;
static Py_ssize_t P_tier, P_index, P_heap, P_seq, P_size, C_beta, C_inv_beta, C_benefit, C_theta, C_keyed, C_rekeys,
    C_rekeyed;
static double theta_weight, rekey_drift;
static PyObject *zero, *zero_f, *deque_t, *deque_append, *deque_popleft, *hd_globals, *best_of[8];
/* The clock of the index an evict call runs on, for its policy's reads of ``self.index.clock``
   (per thread: a callback may let another thread run another index's evict meanwhile). */
static __thread PyObject *clock_index = NULL;
static __thread long clock_value = 0;
static Py_ssize_t E_key, E_parent, E_depth, E_mask, E_best, E_l1, E_ref, E_last, E_freq, E_hits, E_tag,
    E_children, E_handles;
static Py_ssize_t Q_tier, Q_tag, Q_buckets, Q_keys, Q_live, Q_stored;
static Py_ssize_t H_tier, H_index, H_queues, H_scored, H_scores, H_scored_clock, H_scored_version, H_benefit,
    H_hit_hist, H_end_hist, H_density, H_events, H_period, H_updates, H_ghosts, H_counts, H_ghost_hits, H_ghost_factor;
static PyObject *s_append, *s_popleft, *s_discard, *s_add, *s_touch, *s_pop, *s_pop_after, *s_sweep, *s_update,
    *s_benefit_at, *s_popitem, *s_stored_keys, *s_removed, *s_notify, *s_ev_listeners, *s_clock, *s_queue, *s_mg, *s_observe,
    *s_entries, *s_uncached, *s_policies, *s_admits, *s_events, *s_counts, *s_listeners, *s_observing, *s_decay,
    *s_priority, *s_taken, *s_rekey, *s_priority_by_key;
static int ready = 0;

/* -- small helpers ------------------------------------------------------------------------------ */

static inline long L(PyObject *o, Py_ssize_t off) { return PyLong_AsLong(SLOT(o, off)); }

static inline int setO(PyObject *o, Py_ssize_t off, PyObject *v) { /* steals v */
  if (v == NULL) return -1;
  PyObject *old = SLOT(o, off);
  SLOT(o, off) = v;
  Py_XDECREF(old);
  return 0;
}
static inline int setL(PyObject *o, Py_ssize_t off, long v) { return setO(o, off, PyLong_FromLong(v)); }
static inline long LI(PyObject *list, Py_ssize_t i) { return PyLong_AsLong(PyList_GET_ITEM(list, i)); }
static inline int setLI(PyObject *list, Py_ssize_t i, long v) {
  PyObject *n = PyLong_FromLong(v);
  if (n == NULL) return -1;
  PyObject *old = PyList_GET_ITEM(list, i);
  PyList_SET_ITEM(list, i, n);
  Py_DECREF(old);
  return 0;
}
static inline int setI(PyObject *list, Py_ssize_t i, PyObject *v) { /* borrowed v */
  Py_INCREF(v);
  PyObject *old = PyList_GET_ITEM(list, i);
  PyList_SET_ITEM(list, i, v);
  Py_DECREF(old);
  return 0;
}
static inline int bump(PyObject *list, Py_ssize_t i) { /* list[i] += 1.0 */
  double x = PyFloat_AsDouble(PyList_GET_ITEM(list, i));
  if (x == -1.0 && PyErr_Occurred()) return -1;
  PyObject *n = PyFloat_FromDouble(x + 1.0);
  if (n == NULL) return -1;
  PyObject *old = PyList_GET_ITEM(list, i);
  PyList_SET_ITEM(list, i, n);
  Py_DECREF(old);
  return 0;
}
static inline int call_drop(PyObject *r) { if (r == NULL) return -1; Py_DECREF(r); return 0; }
/* A list to gather a save's stored keys in when ``events`` (the index's TierEvents, or None) has
   listeners (an object without ``_listeners`` counts as listened to); NULL otherwise, or on error. */
static PyObject *events_keys(PyObject *events, int *err) {
  *err = 0;
  if (events == Py_None) return NULL;
  PyObject *listeners = PyObject_GetAttr(events, s_ev_listeners);
  int on = 1;
  if (listeners == NULL) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) { *err = 1; return NULL; }
    PyErr_Clear();
  } else {
    on = PyObject_IsTrue(listeners);
    Py_DECREF(listeners);
    if (on < 0) { *err = 1; return NULL; }
  }
  if (!on) return NULL;
  PyObject *keys = PyList_New(0);
  if (keys == NULL) *err = 1;
  return keys;
}
/* events.<name>(keys, tier_o) once for the gathered keys (none: no call); with an exception already
   set (a save that failed part way records what it did), that exception is kept. */
static int events_record(PyObject *events, PyObject *name, PyObject *keys, PyObject *tier_o) {
  if (keys == NULL || PyList_GET_SIZE(keys) == 0) return 0;
  PyObject *et, *ev, *tb;
  PyErr_Fetch(&et, &ev, &tb);
  int rc = call_drop(PyObject_CallMethodObjArgs(events, name, keys, tier_o, NULL));
  if (et != NULL) {
    if (rc < 0) PyErr_Clear();
    PyErr_Restore(et, ev, tb);
    return -1;
  }
  return rc;
}
static PyObject *attr(PyObject *o, PyObject *name) { return PyObject_GetAttr(o, name); }
static inline PyObject *bucket_popleft(PyObject *bucket) { return PyObject_Vectorcall(deque_popleft, &bucket, 1, NULL); }
static inline int bucket_append(PyObject *bucket, PyObject *e) {
  PyObject *args[2] = {bucket, e};
  return call_drop(PyObject_Vectorcall(deque_append, args, 2, NULL));
}
static inline int bitlen(long v) { if (v < 0) v = -v; return v ? 64 - __builtin_clzl((unsigned long)v) : 0; }
static inline int age_bin(long age) {
  int bl = bitlen(age);
  if (bl < 2) return bl;
  int b = 2 * bl - 2 + (int)((age >> (bl - 2)) & 1);
  return b < BINS ? b : BINS - 1;
}
static inline int is_entry(PyObject *e) {
  if (Py_TYPE(e) == EntryT) return 1;
  PyErr_Format(PyExc_TypeError, "index_native: expected an Entry, got %R", e);
  return 0;
}
static inline PyObject *handles_of(PyObject *e) { return SLOT(e, E_handles); }
static inline int handle_is(PyObject *e, long tier, long handle) {
  PyObject *h = PyList_GET_ITEM(handles_of(e), tier);
  return PyLong_CheckExact(h) && PyLong_AsLong(h) == handle;
}

/* -- heapq on a list of ints (the same algorithm: the same layouts) ------------------------------ */

static void siftdown(PyObject **a, Py_ssize_t start, Py_ssize_t pos) {
  PyObject *item = a[pos];
  long v = PyLong_AsLong(item);
  while (pos > start) {
    Py_ssize_t pp = (pos - 1) >> 1;
    PyObject *parent = a[pp];
    if (v < PyLong_AsLong(parent)) { a[pos] = parent; pos = pp; continue; }
    break;
  }
  a[pos] = item;
}
static void siftup(PyObject **a, Py_ssize_t n, Py_ssize_t pos) {
  Py_ssize_t start = pos, child = 2 * pos + 1;
  PyObject *item = a[pos];
  while (child < n) {
    Py_ssize_t right = child + 1;
    if (right < n && !(PyLong_AsLong(a[child]) < PyLong_AsLong(a[right]))) child = right;
    a[pos] = a[child];
    pos = child;
    child = 2 * pos + 1;
  }
  a[pos] = item;
  siftdown(a, start, pos);
}
static int heap_push(PyObject *heap, PyObject *item) {
  if (PyList_Append(heap, item) < 0) return -1;
  siftdown(((PyListObject *)heap)->ob_item, 0, PyList_GET_SIZE(heap) - 1);
  return 0;
}
static PyObject *heap_pop(PyObject *heap) { /* new reference */
  Py_ssize_t n = PyList_GET_SIZE(heap);
  PyObject *last = PyList_GET_ITEM(heap, n - 1);
  Py_INCREF(last);
  if (PyList_SetSlice(heap, n - 1, n, NULL) < 0) { Py_DECREF(last); return NULL; }
  if (n - 1 == 0) return last;
  PyObject **a = ((PyListObject *)heap)->ob_item;
  PyObject *top = a[0];
  a[0] = last;
  siftup(a, n - 1, 0);
  return top;
}

/* -- AgeQueue (policy/age_queue.py) --------------------------------------------------------------- */

static int aq_add(PyObject *q, PyObject *e) {
  long tier = L(q, Q_tier), tag = L(q, Q_tag);
  PyObject *keyobj = SLOT(e, E_last);
  long key = PyLong_AsLong(keyobj);
  if (setLI(handles_of(e), tier, key << TAG_BITS | tag) < 0) return -1;
  PyObject *buckets = SLOT(q, Q_buckets);
  PyObject *bucket = PyDict_GetItemWithError(buckets, keyobj);
  if (bucket == NULL) {
    if (PyErr_Occurred()) return -1;
    bucket = PyObject_CallNoArgs(deque_t);
    if (bucket == NULL) return -1;
    int rc = PyDict_SetItem(buckets, keyobj, bucket);
    Py_DECREF(bucket);
    if (rc < 0 || heap_push(SLOT(q, Q_keys), keyobj) < 0) return -1;
  }
  if (bucket_append(bucket, e) < 0) return -1;
  if (setL(q, Q_live, L(q, Q_live) + 1) < 0) return -1;
  return setL(q, Q_stored, L(q, Q_stored) + 1);
}

static int aq_discard(PyObject *q, PyObject *e) {
  long tier = L(q, Q_tier);
  PyObject *h = handles_of(e);
  if (PyList_GET_ITEM(h, tier) == Py_None) return 0;
  setI(h, tier, Py_None);
  long live = L(q, Q_live) - 1;
  if (setL(q, Q_live, live) < 0) return -1;
  if (L(q, Q_stored) > 4 * live + 64) return call_drop(PyObject_CallMethodNoArgs(q, s_sweep));
  return 0;
}

/* buckets[keys[0]], the head bucket (every caller passes keys[0]); borrowed; KeyError as buckets[key].
   Remembered per queue with the dict's version tag: the key heap changes only together with the
   dict (a bucket made or dropped with each push and pop; a sweep makes a new dict), and a dict's
   version is new after every change to any dict, so an unchanged version means the same head. */
#if PY_VERSION_HEX < 0x030C0000
#define HEAD_CACHE 64
static struct { PyObject *q, *dict, *bucket; uint64_t version; } head_cache[HEAD_CACHE];
#endif
static PyObject *bucket_of(PyObject *q, PyObject *keyobj) {
  PyObject *buckets = SLOT(q, Q_buckets);
#if PY_VERSION_HEX < 0x030C0000
  size_t h = ((uintptr_t)q >> 4) % HEAD_CACHE;
  int exact = PyDict_CheckExact(buckets);
  if (exact && head_cache[h].q == q && head_cache[h].dict == buckets &&
      ((PyDictObject *)buckets)->ma_version_tag == head_cache[h].version)
    return head_cache[h].bucket;
#endif
  PyObject *b = PyDict_GetItemWithError(buckets, keyobj);
  if (b == NULL) {
    if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, keyobj);
    return NULL;
  }
#if PY_VERSION_HEX < 0x030C0000
  if (exact) {
    head_cache[h].q = q;
    head_cache[h].dict = buckets;
    head_cache[h].bucket = b;
    head_cache[h].version = ((PyDictObject *)buckets)->ma_version_tag;
  }
#endif
  return b;
}

/* New reference to the oldest listed block; NULL with no error set: none. */
static PyObject *aq_head(PyObject *q) {
  long tier = L(q, Q_tier), tag = L(q, Q_tag);
  PyObject *keys = SLOT(q, Q_keys);
  while (PyList_GET_SIZE(keys)) {
    PyObject *keyobj = PyList_GET_ITEM(keys, 0);
    long handle = PyLong_AsLong(keyobj) << TAG_BITS | tag;
    PyObject *bucket = bucket_of(q, keyobj);
    if (bucket == NULL) return NULL;
    while (PyObject_Size(bucket) > 0) {
      PyObject *e = PySequence_GetItem(bucket, 0);
      if (e == NULL) return NULL;
      if (handle_is(e, tier, handle)) return e;
      Py_DECREF(e);
      if (call_drop(bucket_popleft(bucket)) < 0) return NULL;
      if (setL(q, Q_stored, L(q, Q_stored) - 1) < 0) return NULL;
    }
    if (PyDict_DelItem(SLOT(q, Q_buckets), keyobj) < 0) return NULL;
    PyObject *k = heap_pop(keys);
    if (k == NULL) return NULL;
    Py_DECREF(k);
  }
  return NULL;
}

static PyObject *aq_pop(PyObject *q) { /* new reference; NULL, no error: none */
  long tier = L(q, Q_tier), tag = L(q, Q_tag);
  PyObject *keys = SLOT(q, Q_keys);
  while (PyList_GET_SIZE(keys)) {
    PyObject *keyobj = PyList_GET_ITEM(keys, 0);
    long handle = PyLong_AsLong(keyobj) << TAG_BITS | tag;
    PyObject *bucket = bucket_of(q, keyobj);
    if (bucket == NULL) return NULL;
    while (PyObject_Size(bucket) > 0) {
      PyObject *e = bucket_popleft(bucket);
      if (e == NULL) return NULL;
      if (setL(q, Q_stored, L(q, Q_stored) - 1) < 0) { Py_DECREF(e); return NULL; }
      if (handle_is(e, tier, handle)) {
        setI(handles_of(e), tier, Py_None);
        if (setL(q, Q_live, L(q, Q_live) - 1) < 0) { Py_DECREF(e); return NULL; }
        return e;
      }
      Py_DECREF(e);
    }
    if (PyDict_DelItem(SLOT(q, Q_buckets), keyobj) < 0) return NULL;
    PyObject *k = heap_pop(keys);
    if (k == NULL) return NULL;
    Py_DECREF(k);
  }
  return NULL;
}

static PyObject *aq_pop_after(PyObject *q, PyObject *e) { /* new reference */
  PyObject *keys = SLOT(q, Q_keys);
  if (PyList_GET_SIZE(keys)) {
    PyObject *keyobj = PyList_GET_ITEM(keys, 0);
    PyObject *bucket = bucket_of(q, keyobj);
    if (bucket == NULL) return NULL;
    int live = 0;
    if (PyObject_Size(bucket) > 0) {
      PyObject *first = PySequence_GetItem(bucket, 0);
      if (first == NULL) return NULL;
      live = handle_is(first, L(q, Q_tier), PyLong_AsLong(keyobj) << TAG_BITS | L(q, Q_tag));
      Py_DECREF(first);
    }
    if (!live) {
      PyObject *h = aq_head(q);
      if (h == NULL && PyErr_Occurred()) return NULL;
      Py_XDECREF(h);
    }
  }
  if (!PyList_GET_SIZE(keys) || LI(keys, 0) > L(e, E_last)) { Py_INCREF(e); return e; }
  if (aq_add(q, e) < 0) return NULL;
  return aq_pop(q);
}

/* -- hit_density (policy/hit_density.py) -------------------------------------------------------- */

static int hd_clock_of(PyObject *idx, long *clock) { /* 0: no index; 1: *clock set; -1: error */
  if (idx == Py_None) return 0;
  if (idx == clock_index) { *clock = clock_value; return 1; }
  PyObject *c = PyObject_GetAttr(idx, s_clock);
  if (c == NULL) return -1;
  *clock = PyLong_AsLong(c);
  Py_DECREF(c);
  return 1;
}

static int hd_clock(PyObject *self, long *clock) { /* 0: no index; 1: *clock set; -1: error */
  PyObject *idx = SLOT(self, H_index);
  if (idx == Py_None) return 0;
  if (idx == clock_index) { *clock = clock_value; return 1; }
  PyObject *c = PyObject_GetAttr(idx, s_clock);
  if (c == NULL) return -1;
  *clock = PyLong_AsLong(c);
  Py_DECREF(c);
  return 1;
}

static inline PyObject *hd_queue(PyObject *self, long c) { return PyList_GET_ITEM(SLOT(self, H_queues), c); }

static inline int block_class(PyObject *e) {
  long tag = L(e, E_tag), hits = L(e, E_hits) + ((tag >> EXTRA_SHIFT) & EXTRA_MASK);
  int hc = hits ? 1 + (hits < LEVELS ? (int)hits : LEVELS) : (int)(tag & TIP);
  return hc * BANDS + (int)((tag >> BAND_SHIFT) & BAND_MASK);
}

static int hd_listing_class(PyObject *self, PyObject *e) {
  long tag = L(e, E_tag);
  if (!(tag & SEEN)) {
    long tip = 0, clock;
    if (L(e, E_hits) == 0) {
      int has = hd_clock(self, &clock);
      if (has < 0) return -1;
      if (has && L(e, E_last) == clock) tip = TIP;
    }
    if (setL(e, E_tag, tag | SEEN | tip) < 0) return -1;
  }
  return block_class(e);
}

static int hd_add(PyObject *self, PyObject *e) {
  int c = hd_listing_class(self, e);
  return c < 0 ? -1 : aq_add(hd_queue(self, c), e);
}

static int hd_discard(PyObject *self, PyObject *e) {
  PyObject *h = PyList_GET_ITEM(handles_of(e), L(self, H_tier));
  if (h == Py_None) return 0;
  return aq_discard(hd_queue(self, PyLong_AsLong(h) & ((1 << TAG_BITS) - 1)), e);
}

static double hd_score(PyObject *self, long c, long age, long depth) {
  int bl = bitlen(age), b;
  double frac;
  if (bl < 2) { b = bl; frac = 0.0; }
  else {
    int shift = bl - 2;
    long half = (age >> shift) & 1;
    b = 2 * bl - 2 + (int)half;
    frac = (double)(age - ((2 + half) << shift)) / (double)(1L << shift);
  }
  if (b >= BINS - 1) { b = BINS - 2; frac = 1.0; }
  PyObject *curve = PyList_GET_ITEM(SLOT(self, H_density), c);
  double at = PyFloat_AsDouble(PyList_GET_ITEM(curve, b)), next = PyFloat_AsDouble(PyList_GET_ITEM(curve, b + 1));
  PyObject *benefit = SLOT(self, H_benefit);
  double ben;
  if (depth < PyList_GET_SIZE(benefit)) ben = PyFloat_AsDouble(PyList_GET_ITEM(benefit, depth));
  else {
    PyObject *r = PyObject_CallMethod(self, "_benefit_at", "l", depth);
    if (r == NULL) return -1.0;
    ben = PyFloat_AsDouble(r);
    Py_DECREF(r);
  }
  return (at + (next - at) * frac) * ben;
}

/* MAX_GHOSTS (a module global, read per use like the Python code; an evict call reads it once:
   nothing it calls assigns it). Ghosts per block are the policy's own ghost_factor slot. */
static __thread int limits_cached = 0;
static __thread long cached_cap;

static int ghost_cap(long *cap) {
  if (limits_cached) { *cap = cached_cap; return 0; }
  PyObject *m = PyDict_GetItemWithError(hd_globals, s_mg);
  if (m == NULL) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "hit_density: MAX_GHOSTS missing");
    return -1;
  }
  *cap = PyLong_AsLong(m);
  return 0;
}

static int hd_trim_ghosts(PyObject *self, long now) {
  PyObject *ghosts = SLOT(self, H_ghosts), *ends = SLOT(self, H_end_hist);
  long factor = L(self, H_ghost_factor), cap;
  if (ghost_cap(&cap) < 0) return -1;
  long limit = factor * LI(SLOT(self, H_counts), L(self, H_tier)) + 64;
  if (cap < limit) limit = cap;
  while (PyObject_Size(ghosts) > limit) {
    PyObject *item = PyObject_CallMethodOneArg(ghosts, s_popitem, Py_False);
    if (item == NULL) return -1;
    long ghost = PyLong_AsLong(PyTuple_GET_ITEM(item, 1));
    Py_DECREF(item);
    if (bump(PyList_GET_ITEM(ends, ghost & ((1 << TAG_BITS) - 1)), age_bin(now - (ghost >> TAG_BITS))) < 0)
      return -1;
  }
  return 0;
}

static int hd_event(PyObject *self, long n) { /* _events += n; an update when due */
  long events = L(self, H_events) + n;
  if (setL(self, H_events, events) < 0) return -1;
  if (events >= L(self, H_period)) return call_drop(PyObject_CallMethodNoArgs(self, s_update));
  return 0;
}

/* _take: new reference to the victim; NULL, no error: none. extra: borrowed or NULL. */
static PyObject *hd_take(PyObject *self, PyObject *extra, int extra_c) {
  long now = 0, tier = L(self, H_tier), updates = L(self, H_updates);
  if (hd_clock(self, &now) < 0) return NULL;
  if (L(self, H_scored_clock) != now || L(self, H_scored_version) != updates) {
    if (setL(self, H_scored_clock, now) < 0 || setL(self, H_scored_version, updates) < 0) return NULL;
    PyObject *fresh = PyList_New(CLASSES);
    if (fresh == NULL) return NULL;
    for (int c = 0; c < CLASSES; c++) { Py_INCREF(Py_None); PyList_SET_ITEM(fresh, c, Py_None); }
    setO(self, H_scored, fresh);
  }
  PyObject *scored = SLOT(self, H_scored), *scores = SLOT(self, H_scores);
  PyObject *best = NULL;
  double best_score = 0.0;
  long best_last = 0;
  int best_c = 0;
  for (int c = 0; c < CLASSES; c++) {
    PyObject *queue = hd_queue(self, c), *entry;
    if (c == extra_c) { entry = extra; Py_INCREF(entry); }
    else {
      PyObject *keys = SLOT(queue, Q_keys);
      if (!PyList_GET_SIZE(keys)) continue;
      PyObject *keyobj = PyList_GET_ITEM(keys, 0);
      PyObject *bucket = bucket_of(queue, keyobj);
      if (bucket == NULL) goto fail;
      entry = PyObject_Size(bucket) > 0 ? PySequence_GetItem(bucket, 0) : NULL;
      if (entry == NULL && PyErr_Occurred()) goto fail;
      if (entry == NULL || !handle_is(entry, tier, PyLong_AsLong(keyobj) << TAG_BITS | c)) {
        Py_XDECREF(entry);
        entry = aq_head(queue);
        if (entry == NULL) { if (PyErr_Occurred()) goto fail; continue; }
      }
    }
    long last = L(entry, E_last);
    double score;
    if (PyList_GET_ITEM(scored, c) == entry) score = PyFloat_AsDouble(PyList_GET_ITEM(scores, c));
    else {
      score = hd_score(self, c, now - last, L(entry, E_depth));
      if (PyErr_Occurred()) { Py_DECREF(entry); goto fail; }
      PyObject *f = PyFloat_FromDouble(score);
      if (f == NULL) { Py_DECREF(entry); goto fail; }
      PyObject *old = PyList_GET_ITEM(scores, c);
      PyList_SET_ITEM(scores, c, f);
      Py_DECREF(old);
      setI(scored, c, entry);
    }
    if (best == NULL || score < best_score || (score == best_score && last < best_last)) {
      Py_XDECREF(best);
      best = entry; best_score = score; best_last = last; best_c = c;
    } else Py_DECREF(entry);
  }
  if (best == NULL) return NULL;
  if (best != extra) {
    if (extra != NULL && aq_add(hd_queue(self, extra_c), extra) < 0) goto fail;
    PyObject *p = aq_pop(hd_queue(self, best_c));
    if (p == NULL && PyErr_Occurred()) goto fail;
    Py_XDECREF(p);
  }
  {
    PyObject *ghosts = SLOT(self, H_ghosts);
    PyObject *g = PyLong_FromLong(best_last << TAG_BITS | best_c);
    if (g == NULL) goto fail;
    int rc = PyObject_SetItem(ghosts, SLOT(best, E_key), g);
    Py_DECREF(g);
    if (rc < 0) goto fail;
    long factor = L(self, H_ghost_factor), cap, n = PyObject_Size(ghosts);
    if (ghost_cap(&cap) < 0) goto fail;
    if (n > factor * LI(SLOT(self, H_counts), tier) + 64 || n > cap)
      if (hd_trim_ghosts(self, now) < 0) goto fail;
  }
  if (hd_event(self, 1) < 0) goto fail;
  return best;
fail:
  Py_XDECREF(best);
  return NULL;
}

static PyObject *hd_pop_after(PyObject *self, PyObject *e) {
  int c = hd_listing_class(self, e);
  if (c < 0) return NULL;
  PyObject *queue = hd_queue(self, c);
  PyObject *h = aq_head(queue);
  if (h == NULL && PyErr_Occurred()) return NULL;
  if (h != NULL) {
    Py_DECREF(h);
    if (LI(SLOT(queue, Q_keys), 0) <= L(e, E_last)) {
      if (aq_add(queue, e) < 0) return NULL;
      return hd_take(self, NULL, -1);
    }
  }
  return hd_take(self, e, c);
}

static int hd_observe(PyObject *self, PyObject *const *items, Py_ssize_t n, long clock) {
  long bit = 1L << L(self, H_tier), count = 0;
  PyObject *hist = SLOT(self, H_hit_hist);
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *e = items[i];
    if (!is_entry(e)) return -1;
    if (L(e, E_mask) & bit) {
      if (bump(PyList_GET_ITEM(hist, block_class(e)), age_bin(clock - L(e, E_last))) < 0) return -1;
      count++;
    }
  }
  return hd_event(self, count);
}

static int hd_admit(PyObject *self, PyObject *e) {
  PyObject *ghosts = SLOT(self, H_ghosts), *key = SLOT(e, E_key);
  PyObject *g = PyDict_GetItemWithError(ghosts, key);
  if (g == NULL) return PyErr_Occurred() ? -1 : 0;
  long ghost = PyLong_AsLong(g);
  if (PyObject_DelItem(ghosts, key) < 0) return -1;
  long c = ghost & ((1 << TAG_BITS) - 1), last = ghost >> TAG_BITS, now = 0;
  if (hd_clock(self, &now) <= 0) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_AttributeError, "hit_density.admit: policy not bound");
    return -1;
  }
  if (bump(PyList_GET_ITEM(SLOT(self, H_hit_hist), c), age_bin(now - last)) < 0) return -1;
  if (setL(self, H_ghost_hits, L(self, H_ghost_hits) + 1) < 0) return -1;
  if (L(e, E_hits) == 0) {
    long hc = c / BANDS, band = c % BANDS;
    long extra = (hc < 2 ? 0 : hc - 1) + 1;
    long tag = (L(e, E_tag) & (TIP | SEEN)) | ((extra < LEVELS ? extra : LEVELS) << EXTRA_SHIFT) | band << BAND_SHIFT;
    if (setL(e, E_tag, tag) < 0) return -1;
  }
  return setL(self, H_events, L(self, H_events) + 1);
}


/* -- HeapPolicy (policy/base.py), with cost_aware's priority and taken (policy/cost_aware.py) ---------
   The heap is run by _heapq's algorithm below; priorities of other heap policies (lfu, the replay's
   oracle, unless it declares priority_by_key) and their ``taken`` hooks are their Python methods. */


/* heapq on heap items [priority, seq, entry]: _heapq's own algorithm (the same layouts), with the
   list comparison it would make done in C when priorities and sequence numbers are plain floats or
   ints (exact as doubles); anything else is compared by Python, as _heapq does. */
static inline int as_double(PyObject *o, double *d) {
  if (PyFloat_CheckExact(o)) { *d = PyFloat_AS_DOUBLE(o); return 1; }
  if (PyLong_CheckExact(o)) {
    int overflow;
    long v = PyLong_AsLongAndOverflow(o, &overflow);
    if (overflow || v > (1L << 53) || v < -(1L << 53)) return 0;
    *d = (double)v;
    return 1;
  }
  return 0;
}
static int item_lt(PyObject *a, PyObject *b) { /* a < b as Python compares the two lists */
  if (!PyList_CheckExact(a) || !PyList_CheckExact(b) || PyList_GET_SIZE(a) != 3 || PyList_GET_SIZE(b) != 3)
    return PyObject_RichCompareBool(a, b, Py_LT);
  for (int i = 0; i < 2; i++) {
    PyObject *x = PyList_GET_ITEM(a, i), *y = PyList_GET_ITEM(b, i);
    if (x == y) continue;
    double u, v;
    if (as_double(x, &u) && as_double(y, &v)) {
      if (u == v) continue;
      if (u != u || v != v) return 0;  /* a NaN: not equal, and not less */
      return u < v;
    }
    return PyObject_RichCompareBool(a, b, Py_LT);
  }
  return PyObject_RichCompareBool(a, b, Py_LT);
}
static int hq_siftdown(PyObject *heap, Py_ssize_t startpos, Py_ssize_t pos) {
  Py_ssize_t size = PyList_GET_SIZE(heap);
  while (pos > startpos) {
    PyObject **arr = ((PyListObject *)heap)->ob_item;
    Py_ssize_t parentpos = (pos - 1) >> 1;
    PyObject *newitem = arr[pos], *parent = arr[parentpos];
    Py_INCREF(newitem); Py_INCREF(parent);
    int cmp = item_lt(newitem, parent);
    Py_DECREF(parent); Py_DECREF(newitem);
    if (cmp < 0) return -1;
    if (size != PyList_GET_SIZE(heap)) { PyErr_SetString(PyExc_RuntimeError, "list changed size during iteration"); return -1; }
    if (cmp == 0) break;
    arr = ((PyListObject *)heap)->ob_item;
    parent = arr[parentpos]; newitem = arr[pos];
    arr[parentpos] = newitem; arr[pos] = parent;
    pos = parentpos;
  }
  return 0;
}
static int hq_siftup(PyObject *heap, Py_ssize_t pos) {
  Py_ssize_t endpos = PyList_GET_SIZE(heap), startpos = pos, limit = endpos >> 1;
  while (pos < limit) {
    PyObject **arr = ((PyListObject *)heap)->ob_item;
    Py_ssize_t childpos = 2 * pos + 1;
    if (childpos + 1 < endpos) {
      PyObject *a = arr[childpos], *b = arr[childpos + 1];
      Py_INCREF(a); Py_INCREF(b);
      int cmp = item_lt(a, b);
      Py_DECREF(a); Py_DECREF(b);
      if (cmp < 0) return -1;
      childpos += ((unsigned)cmp ^ 1);
      arr = ((PyListObject *)heap)->ob_item;
      if (endpos != PyList_GET_SIZE(heap)) { PyErr_SetString(PyExc_RuntimeError, "list changed size during iteration"); return -1; }
    }
    PyObject *t1 = arr[childpos], *t2 = arr[pos];
    arr[childpos] = t2; arr[pos] = t1;
    pos = childpos;
  }
  return hq_siftdown(heap, startpos, pos);
}
static int hq_push(PyObject *heap, PyObject *item) {
  if (PyList_Append(heap, item) < 0) return -1;
  return hq_siftdown(heap, 0, PyList_GET_SIZE(heap) - 1);
}
static PyObject *hq_pop(PyObject *heap) { /* new reference; the list must be non-empty */
  Py_ssize_t n = PyList_GET_SIZE(heap);
  PyObject *last = PyList_GET_ITEM(heap, n - 1);
  Py_INCREF(last);
  if (PyList_SetSlice(heap, n - 1, n, NULL) < 0) { Py_DECREF(last); return NULL; }
  if (n - 1 == 0) return last;
  PyObject *top = PyList_GET_ITEM(heap, 0);
  PyList_SET_ITEM(heap, 0, last);
  if (hq_siftup(heap, 0) < 0) { Py_DECREF(top); return NULL; }
  return top;
}
static PyObject *hq_replace(PyObject *heap, PyObject *item) { /* new reference; non-empty list */
  PyObject *top = PyList_GET_ITEM(heap, 0);
  Py_INCREF(item);
  PyList_SET_ITEM(heap, 0, item);
  if (hq_siftup(heap, 0) < 0) { Py_DECREF(top); return NULL; }
  return top;
}

static PyObject *cost_priority(PyObject *self, PyObject *e) { /* new reference */
  PyObject *table = SLOT(self, C_benefit);
  long depth = L(e, E_depth);
  double benefit;
  if (PyList_CheckExact(table) && depth >= 0 && depth < PyList_GET_SIZE(table))
    benefit = PyFloat_AsDouble(PyList_GET_ITEM(table, depth));
  else return PyObject_CallMethod(self, "priority", "O", e);
  double freq = PyFloat_AsDouble(SLOT(e, E_freq)), keyed = PyFloat_AsDouble(SLOT(self, C_keyed));
  double inv = PyFloat_AsDouble(SLOT(self, C_inv_beta));
  if (PyErr_Occurred()) return NULL;
  double x = (1.0 + freq) * benefit / keyed;
  if (!(x > 0.0) || !isfinite(x) || !isfinite(inv) || !PyLong_CheckExact(SLOT(e, E_last)))
    return PyObject_CallMethod(self, "priority", "O", e);  /* float_pow's special cases: Python decides */
  double y = pow(x, inv);
  if (!isfinite(y)) return PyObject_CallMethod(self, "priority", "O", e);
  return PyFloat_FromDouble((double)L(e, E_last) + y);
}

static PyObject *hp_priority(PyObject *self, PyObject *e) {
  if (Py_TYPE(self) == CostT) return cost_priority(self, e);
  PyObject *d = PyObject_GenericGetDict(self, NULL);  /* priority_by_key = (mapping, default)? */
  if (d == NULL) return NULL;
  PyObject *by_key = PyDict_GetItemWithError(d, s_priority_by_key);
  Py_DECREF(d);  /* the instance keeps it */
  if (by_key == NULL && PyErr_Occurred()) return NULL;
  if (by_key != NULL && PyTuple_CheckExact(by_key) && PyTuple_GET_SIZE(by_key) == 2 &&
      PyDict_CheckExact(PyTuple_GET_ITEM(by_key, 0))) {
    PyObject *v = PyDict_GetItemWithError(PyTuple_GET_ITEM(by_key, 0), SLOT(e, E_key));
    if (v == NULL) { if (PyErr_Occurred()) return NULL; v = PyTuple_GET_ITEM(by_key, 1); }
    Py_INCREF(v);
    return v;
  }
  return PyObject_CallMethodOneArg(self, s_priority, e);
}

static PyObject *cost_taken(PyObject *self, PyObject *e) { /* new reference to e */
  long now, last = L(e, E_last);
  int has = hd_clock_of(SLOT(self, P_index), &now);
  if (has < 0) return NULL;
  if (!has) now = last;
  long age = now - last > 1 ? now - last : 1;
  PyObject *table = SLOT(self, C_benefit);
  long depth = L(e, E_depth);
  double benefit;
  if (PyList_CheckExact(table) && depth >= 0 && depth < PyList_GET_SIZE(table))
    benefit = PyFloat_AsDouble(PyList_GET_ITEM(table, depth));
  else {
    PyObject *r = PyObject_CallMethod(self, "_benefit_per_byte", "l", depth);
    if (r == NULL) return NULL;
    benefit = PyFloat_AsDouble(r);
    Py_DECREF(r);
  }
  double freq = PyFloat_AsDouble(SLOT(e, E_freq)), beta = PyFloat_AsDouble(SLOT(self, C_beta));
  double theta = PyFloat_AsDouble(SLOT(self, C_theta)), keyed = PyFloat_AsDouble(SLOT(self, C_keyed));
  if (PyErr_Occurred()) return NULL;
  double worth = (1.0 + freq) * benefit;
  double score = worth / pow((double)age, beta);
  theta = theta + theta_weight * (score - theta);
  if (setO(self, C_theta, PyFloat_FromDouble(theta)) < 0) return NULL;
  double ratio = theta / keyed;
  if (ratio > rekey_drift || ratio * rekey_drift < 1.0) {
    Py_INCREF(SLOT(self, C_theta));
    if (setO(self, C_keyed, SLOT(self, C_theta)) < 0) return NULL;
    if (setL(self, C_rekeys, L(self, C_rekeys) + 1) < 0) return NULL;
    if (setL(self, C_rekeyed, L(self, C_rekeyed) + L(self, P_size)) < 0) return NULL;
    if (call_drop(PyObject_CallMethodNoArgs(self, s_rekey)) < 0) return NULL;
  }
  Py_INCREF(e);
  return e;
}


static PyObject *hp_taken(PyObject *self, PyObject *e, int plain) { /* new reference */
  if (plain) { Py_INCREF(e); return e; }
  if (Py_TYPE(self) == CostT) return cost_taken(self, e);
  return PyObject_CallMethodOneArg(self, s_taken, e);
}

static int hp_add(PyObject *self, PyObject *e) {
  PyObject *prio = hp_priority(self, e);
  if (prio == NULL) return -1;
  PyObject *seq = PyIter_Next(SLOT(self, P_seq));
  if (seq == NULL) { Py_DECREF(prio); if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "heap: sequence ended"); return -1; }
  PyObject *item = PyList_New(3);
  if (item == NULL) { Py_DECREF(prio); Py_DECREF(seq); return -1; }
  PyList_SET_ITEM(item, 0, prio);
  PyList_SET_ITEM(item, 1, seq);
  Py_INCREF(e);
  PyList_SET_ITEM(item, 2, e);
  setI(handles_of(e), L(self, P_tier), item);
  int rc = hq_push(SLOT(self, P_heap), item);
  Py_DECREF(item);
  if (rc < 0) return -1;
  return setL(self, P_size, L(self, P_size) + 1);
}

static int hp_discard(PyObject *self, PyObject *e) {
  long tier = L(self, P_tier);
  PyObject *item = PyList_GET_ITEM(handles_of(e), tier);
  if (item == Py_None) return 0;
  if (!PyList_CheckExact(item) || PyList_GET_SIZE(item) != 3) { PyErr_SetString(PyExc_TypeError, "heap: bad handle"); return -1; }
  setI(item, 2, Py_None);
  setI(handles_of(e), tier, Py_None);
  long size = L(self, P_size) - 1;
  if (setL(self, P_size, size) < 0) return -1;
  PyObject *heap = SLOT(self, P_heap);
  Py_ssize_t n = PyList_GET_SIZE(heap);
  if (n > 64 && n > 4 * size) {
    PyObject *live = PyList_New(0);
    if (live == NULL) return -1;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(heap); i++) {
      PyObject *it = PyList_GET_ITEM(heap, i);
      if (PyList_GET_ITEM(it, 2) != Py_None && PyList_Append(live, it) < 0) { Py_DECREF(live); return -1; }
    }
    if (setO(self, P_heap, live) < 0) return -1;
    if (call_drop(PyObject_CallOneArg(heapify_f, live)) < 0) return -1;
  }
  return 0;
}

static PyObject *hp_pop(PyObject *self, int plain) { /* new reference; NULL, no error: none */
  long tier = L(self, P_tier);
  for (;;) {
    PyObject *heap = SLOT(self, P_heap);
    if (!PyList_GET_SIZE(heap)) return NULL;
    if (!PyList_CheckExact(heap)) { PyErr_SetString(PyExc_TypeError, "heap: not a list"); return NULL; }
    PyObject *item = hq_pop(heap);
    if (item == NULL) return NULL;
    if (!PyList_CheckExact(item) || PyList_GET_SIZE(item) != 3) { Py_DECREF(item); PyErr_SetString(PyExc_TypeError, "heap: bad item"); return NULL; }
    PyObject *e = PyList_GET_ITEM(item, 2);
    if (e != Py_None) {
      Py_INCREF(e);
      Py_DECREF(item);
      setI(handles_of(e), tier, Py_None);
      if (setL(self, P_size, L(self, P_size) - 1) < 0) { Py_DECREF(e); return NULL; }
      PyObject *r = hp_taken(self, e, plain);
      Py_DECREF(e);
      return r;
    }
    Py_DECREF(item);
  }
}

static PyObject *hp_pop_after(PyObject *self, PyObject *e, int plain) { /* new reference */
  PyObject *heap = SLOT(self, P_heap);
  while (PyList_GET_SIZE(heap) && PyList_GET_ITEM(PyList_GET_ITEM(heap, 0), 2) == Py_None) {
    PyObject *dead = hq_pop(heap);
    if (dead == NULL) return NULL;
    Py_DECREF(dead);
  }
  PyObject *prio = hp_priority(self, e);
  if (prio == NULL) return NULL;
  int lower = 1;
  if (PyList_GET_SIZE(heap)) {
    lower = PyObject_RichCompareBool(prio, PyList_GET_ITEM(PyList_GET_ITEM(heap, 0), 0), Py_LT);
    if (lower < 0) { Py_DECREF(prio); return NULL; }
  }
  if (lower) { Py_DECREF(prio); return hp_taken(self, e, plain); }
  PyObject *seq = PyIter_Next(SLOT(self, P_seq));
  if (seq == NULL) { Py_DECREF(prio); if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "heap: sequence ended"); return NULL; }
  PyObject *item = PyList_New(3);
  if (item == NULL) { Py_DECREF(prio); Py_DECREF(seq); return NULL; }
  PyList_SET_ITEM(item, 0, prio);
  PyList_SET_ITEM(item, 1, seq);
  Py_INCREF(e);
  PyList_SET_ITEM(item, 2, e);
  long tier = L(self, P_tier);
  setI(handles_of(e), tier, item);
  PyObject *out = hq_replace(heap, item);
  Py_DECREF(item);
  if (out == NULL) return NULL;
  PyObject *victim = PyList_GET_ITEM(out, 2);
  Py_INCREF(victim);
  Py_DECREF(out);
  if (victim == Py_None || !is_entry(victim)) {
    Py_DECREF(victim);
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "heap: a dead head after the sweep");
    return NULL;
  }
  setI(handles_of(victim), tier, Py_None);
  PyObject *r = hp_taken(self, victim, plain);
  Py_DECREF(victim);
  return r;
}

/* _alive(): per class and age bin, the lives not ended (this tier's blocks, ghosts); sample is
   _ALIVE_SAMPLE. The counts are whole numbers, so summing them in another order gives the same floats. */
static PyObject *py_hd_alive(PyObject *m, PyObject *const *a, Py_ssize_t nargs) {
  if (nargs != 2 || Py_TYPE(a[0]) != HdT) { PyErr_SetString(PyExc_TypeError, "hd_alive(policy, sample)"); return NULL; }
  PyObject *self = a[0];
  Py_ssize_t sample = PyLong_AsSsize_t(a[1]);
  if (sample == -1 && PyErr_Occurred()) return NULL;
  if (sample < 1) sample = 1;
  double alive[CLASSES][BINS] = {{0.0}};
  long now = 0;
  int has = hd_clock(self, &now);
  if (has < 0) return NULL;
  if (has) {
    PyObject *ghosts = SLOT(self, H_ghosts);
    Py_ssize_t n = PyObject_Size(ghosts);
    if (n < 0) return NULL;
    Py_ssize_t stride = n / sample > 1 ? n / sample : 1;
    if (stride == 1) {
      Py_ssize_t pos = 0;
      PyObject *k, *v;
      while (PyDict_Next(ghosts, &pos, &k, &v)) {
        long g = PyLong_AsLong(v);
        alive[g & ((1 << TAG_BITS) - 1)][age_bin(now - (g >> TAG_BITS))] += 1.0;
      }
    } else {  /* every stride-th in the ghosts' own order, as islice over values() */
      PyObject *values = PyObject_CallMethod(ghosts, "values", NULL);
      PyObject *it = values == NULL ? NULL : PyObject_GetIter(values);
      Py_XDECREF(values);
      if (it == NULL) return NULL;
      PyObject *v;
      for (Py_ssize_t i = 0; (v = PyIter_Next(it)) != NULL; i++) {
        if (i % stride == 0) {
          long g = PyLong_AsLong(v);
          alive[g & ((1 << TAG_BITS) - 1)][age_bin(now - (g >> TAG_BITS))] += (double)stride;
        }
        Py_DECREF(v);
      }
      Py_DECREF(it);
      if (PyErr_Occurred()) return NULL;
    }
    PyObject *entries = attr(SLOT(self, H_index), s_entries);
    if (entries == NULL) return NULL;
    if (!PyDict_CheckExact(entries)) { Py_DECREF(entries); PyErr_SetString(PyExc_TypeError, "hd_alive: index._entries"); return NULL; }
    n = PyDict_GET_SIZE(entries);
    stride = n / sample > 1 ? n / sample : 1;
    long bit = 1L << L(self, H_tier);
    Py_ssize_t pos = 0, i = 0;
    PyObject *k, *e;
    while (PyDict_Next(entries, &pos, &k, &e)) {
      if (i++ % stride) continue;
      if (!is_entry(e)) { Py_DECREF(entries); return NULL; }
      if (!(L(e, E_mask) & bit)) continue;
      alive[block_class(e)][age_bin(now - L(e, E_last))] += (double)stride;
    }
    Py_DECREF(entries);
    if (PyErr_Occurred()) return NULL;
  }
  PyObject *out = PyList_New(CLASSES);
  if (out == NULL) return NULL;
  for (int c = 0; c < CLASSES; c++) {
    PyObject *row = PyList_New(BINS);
    if (row == NULL) { Py_DECREF(out); return NULL; }
    PyList_SET_ITEM(out, c, row);
    for (int b = 0; b < BINS; b++) {
      PyObject *f = PyFloat_FromDouble(alive[c][b]);
      if (f == NULL) { Py_DECREF(out); return NULL; }
      PyList_SET_ITEM(row, b, f);
    }
  }
  return out;
}

/* -- a tier's policy, dispatched: an AgeQueue (lru), hit_density, or Python calls ----------------- */

typedef struct { PyObject *policy; PyObject *queue; int kind; int plain; } Pol;  /* kind: -1 unset, 0 None, 1 lru, 2 hd, 3 py, 4 heap */

static int pol_init(Pol *p, PyObject *policy) {
  p->policy = policy;
  p->queue = NULL;
  if (policy == Py_None) { p->kind = 0; return 0; }
  p->kind = 3;
  if (Py_TYPE(policy) == LruT) {
    PyObject *q = PyObject_GetAttr(policy, s_queue);
    if (q == NULL) return -1;
    if (Py_TYPE(q) == QueueT) { p->queue = q; p->kind = 1; }
    else Py_DECREF(q);
  } else if (Py_TYPE(policy) == HdT) {
    PyObject *queues = SLOT(policy, H_queues);
    int ok = queues != NULL && PyList_CheckExact(queues) && PyList_GET_SIZE(queues) == CLASSES;
    for (int c = 0; ok && c < CLASSES; c++) ok = Py_TYPE(PyList_GET_ITEM(queues, c)) == QueueT;
    if (ok) p->kind = 2;
  } else if (PyType_IsSubtype(Py_TYPE(policy), HeapT)) {
    /* a heap policy that keeps HeapPolicy's seam (its own priority and taken are called) */
    PyTypeObject *t = Py_TYPE(policy);
    PyObject *add = _PyType_Lookup(t, s_add), *discard = _PyType_Lookup(t, s_discard);
    PyObject *pop = _PyType_Lookup(t, s_pop), *pop_after = _PyType_Lookup(t, s_pop_after);
    PyObject *taken = _PyType_Lookup(t, s_taken), *touch = _PyType_Lookup(t, s_touch);
    int same = add == _PyType_Lookup(HeapT, s_add) && discard == _PyType_Lookup(HeapT, s_discard) &&
               pop == _PyType_Lookup(HeapT, s_pop) && pop_after == _PyType_Lookup(HeapT, s_pop_after) &&
               touch == _PyType_Lookup(HeapT, s_touch);
    PyObject *d = PyObject_GenericGetDict(policy, NULL);  /* nothing shadowing the seam on the instance */
    if (d == NULL) { PyErr_Clear(); }
    else {
      if (PyDict_GET_SIZE(d) && (PyDict_GetItemWithError(d, s_add) || PyDict_GetItemWithError(d, s_pop) ||
                                 PyDict_GetItemWithError(d, s_pop_after) || PyDict_GetItemWithError(d, s_discard) ||
                                 PyDict_GetItemWithError(d, s_priority) || PyDict_GetItemWithError(d, s_taken)))
        same = 0;
      Py_DECREF(d);
      if (PyErr_Occurred()) return -1;
    }
    if (same && PyList_CheckExact(SLOT(policy, P_heap))) { p->kind = 4; p->plain = taken == heap_taken_f; }
  }
  return 0;
}
static void pol_clear(Pol *p) { Py_XDECREF(p->queue); p->queue = NULL; p->kind = -1; }

static int pol_add(Pol *p, PyObject *e) {
  switch (p->kind) {
    case 1: return aq_add(p->queue, e);
    case 2: return hd_add(p->policy, e);
    case 3: return call_drop(PyObject_CallMethodOneArg(p->policy, s_add, e));
    case 4: return hp_add(p->policy, e);
  }
  return 0;
}
static int pol_discard(Pol *p, PyObject *e) {
  switch (p->kind) {
    case 1: return aq_discard(p->queue, e);
    case 2: return hd_discard(p->policy, e);
    case 3: return call_drop(PyObject_CallMethodOneArg(p->policy, s_discard, e));
    case 4: return hp_discard(p->policy, e);
  }
  return 0;
}
static int pol_touch(Pol *p, PyObject *e) {
  switch (p->kind) {
    case 1: return aq_discard(p->queue, e) < 0 ? -1 : aq_add(p->queue, e);
    case 2: return hd_discard(p->policy, e) < 0 ? -1 : hd_add(p->policy, e);
    case 3: case 4: return call_drop(PyObject_CallMethodOneArg(p->policy, s_touch, e));
  }
  return 0;
}
static PyObject *py_entry_or_none(PyObject *r) { /* a Python pop's result: None -> NULL, no error */
  if (r == Py_None) { Py_DECREF(r); return NULL; }
  return r;
}
static PyObject *pol_pop(Pol *p) {
  switch (p->kind) {
    case 1: return aq_pop(p->queue);
    case 2: return hd_take(p->policy, NULL, -1);
    case 4: return hp_pop(p->policy, p->plain);
    case 3: {
      PyObject *r = PyObject_CallMethodNoArgs(p->policy, s_pop);
      return r == NULL ? NULL : py_entry_or_none(r);
    }
  }
  return NULL;
}
static PyObject *pol_pop_after(Pol *p, PyObject *e) {
  switch (p->kind) {
    case 1: return aq_pop_after(p->queue, e);
    case 2: return hd_pop_after(p->policy, e);
    case 4: return hp_pop_after(p->policy, e, p->plain);
    case 3: {
      PyObject *r = PyObject_CallMethodOneArg(p->policy, s_pop_after, e);
      return r == NULL ? NULL : py_entry_or_none(r);
    }
  }
  return NULL;
}

/* The index's policies, one Pol per tier, set up on first use in a call. */
typedef struct { PyObject *policies; Pol p[3]; } Pols;
static void pols_start(Pols *ps, PyObject *policies) { ps->policies = policies; for (int t = 0; t < 3; t++) ps->p[t].kind = -1, ps->p[t].queue = NULL; }
static Pol *pols_get(Pols *ps, long t) {
  Pol *p = &ps->p[t];
  if (p->kind < 0 && pol_init(p, PyList_GET_ITEM(ps->policies, t)) < 0) return NULL;
  return p;
}
static void pols_end(Pols *ps) { for (int t = 0; t < 3; t++) pol_clear(&ps->p[t]); }

static int check_policies(PyObject *policies) {
  if (!PyList_CheckExact(policies) || PyList_GET_SIZE(policies) != 3) {
    PyErr_SetString(PyExc_TypeError, "index_native: index.policies must be a list of 3");
    return -1;
  }
  return 0;
}

/* -- the index's loops (index.py) ---------------------------------------------------------------- */

/* A new Entry, as Entry(key, parent, depth, last, mask, ref) would make it. Its ``children`` holds
   ints only, and with ``untrack`` (every tier's policy keeps ints in ``handles``: lru, hit_density)
   the entry and both lists hold only atomic values: such objects can be in no reference cycle and
   are freed by reference counting alone, so they are left out of the garbage collector's scans,
   which otherwise revisit every cached block. (A heap policy's handle is a list holding the entry:
   that entry and its handles stay tracked, or a dropped index's cycles would never be freed.) */
static PyObject *new_entry(PyObject *key, PyObject *parent, long depth, PyObject *last, long mask, long ref,
                           int untrack) {
  PyObject *e = EntryT->tp_alloc(EntryT, 0);
  if (e == NULL) return NULL;
  Py_INCREF(key); SLOT(e, E_key) = key;
  Py_INCREF(parent); SLOT(e, E_parent) = parent;
  Py_INCREF(best_of[mask]); SLOT(e, E_best) = best_of[mask];
  Py_INCREF(Py_None); SLOT(e, E_l1) = Py_None;
  PyObject *children = PyList_New(3), *handles = PyList_New(3);
  if (setO(e, E_depth, PyLong_FromLong(depth)) < 0 || setO(e, E_mask, PyLong_FromLong(mask)) < 0 ||
      setO(e, E_ref, PyLong_FromLong(ref)) < 0 || setO(e, E_last, (Py_INCREF(last), last)) < 0 ||
      setO(e, E_freq, (Py_INCREF(zero_f), zero_f)) < 0 || setO(e, E_hits, PyLong_FromLong(0)) < 0 ||
      setO(e, E_tag, PyLong_FromLong(0)) < 0 || children == NULL || handles == NULL) {
    Py_XDECREF(children); Py_XDECREF(handles); Py_DECREF(e);
    return NULL;
  }
  for (int t = 0; t < 3; t++) {
    PyList_SET_ITEM(children, t, PyLong_FromLong(0));
    Py_INCREF(Py_None);
    PyList_SET_ITEM(handles, t, Py_None);
  }
  SLOT(e, E_children) = children;
  SLOT(e, E_handles) = handles;
  PyObject_GC_UnTrack(children);  /* ints only, whatever the policies: never in a cycle */
  if (untrack) {
    PyObject_GC_UnTrack(handles);
    PyObject_GC_UnTrack(e);
  }
  return e;
}


/* match_entries(entries, keys): the entries of the longest cached prefix. */
static PyObject *impl_match_entries(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyDict_CheckExact(args[0])) { PyErr_SetString(PyExc_TypeError, "match_entries(dict, keys)"); return NULL; }
  PyObject *seq = PySequence_Fast(args[1], "match_entries: keys must be a sequence");
  if (seq == NULL) return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject **keys = PySequence_Fast_ITEMS(seq);
  PyObject *out = PyList_New(0);
  for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
    PyObject *e = PyDict_GetItemWithError(args[0], keys[i]);
    if (e == NULL) { if (PyErr_Occurred()) Py_CLEAR(out); break; }
    if (PyList_Append(out, e) < 0) Py_CLEAR(out);
  }
  Py_DECREF(seq);
  return out;
}

/* use(index, entries, pin) */
static PyObject *impl_use(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "use(index, entries, pin)"); return NULL; }
  PyObject *index = args[0], *entries = args[1];
  int pin = PyObject_IsTrue(args[2]);
  if (pin < 0) return NULL;
  PyObject *clk = attr(index, s_clock);
  if (clk == NULL) return NULL;
  long clock = PyLong_AsLong(clk) + 1;
  Py_DECREF(clk);
  PyObject *c2 = PyLong_FromLong(clock);
  if (c2 == NULL || PyObject_SetAttr(index, s_clock, c2) < 0) { Py_XDECREF(c2); return NULL; }
  PyObject *observing = attr(index, s_observing), *seq = NULL, *policies = NULL, *dec = NULL;
  if (observing == NULL) { Py_DECREF(c2); return NULL; }
  Pols ps;
  int ok = 0;
  if (PyTuple_GET_SIZE(observing)) seq = PyList_CheckExact(entries) ? (Py_INCREF(entries), entries) : PySequence_List(entries);
  else seq = PySequence_Fast(entries, "use: entries must be iterable");
  if (seq == NULL) goto done0;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject **items = PySequence_Fast_ITEMS(seq);
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(observing); i++) {
    PyObject *p = PyTuple_GET_ITEM(observing, i);
    if (Py_TYPE(p) == HdT) { if (hd_observe(p, items, n, clock) < 0) goto done0; }
    else if (call_drop(PyObject_CallMethodObjArgs(p, s_observe, seq, c2, NULL)) < 0) goto done0;
    n = PySequence_Fast_GET_SIZE(seq);  /* an observer may not change it; re-read anyway */
    items = PySequence_Fast_ITEMS(seq);
  }
  dec = attr(index, s_decay);
  policies = attr(index, s_policies);
  if (dec == NULL || policies == NULL || check_policies(policies) < 0) goto done0;
  double decay = PyFloat_AsDouble(dec);
  if (decay == -1.0 && PyErr_Occurred()) goto done0;
  pols_start(&ps, policies);
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *e = items[i];
    if (!is_entry(e)) goto done;
    long last = L(e, E_last);
    double freq = PyFloat_AsDouble(SLOT(e, E_freq));
    if (setO(e, E_freq, PyFloat_FromDouble(freq * pow(decay, (double)(clock - last)) + 1.0)) < 0) goto done;
    if (setL(e, E_hits, L(e, E_hits) + 1) < 0) goto done;
    Py_INCREF(c2);
    setO(e, E_last, c2);
    long ref = L(e, E_ref);
    if (pin && setL(e, E_ref, ref + 1) < 0) goto done;
    if (ref == 0) {
      long mask = L(e, E_mask);
      for (long t = 0; t < 3; t++) {
        if (!(mask >> t & 1) || PyList_GET_ITEM(handles_of(e), t) == Py_None) continue;
        Pol *p = pols_get(&ps, t);
        if (p == NULL || (pin ? pol_discard(p, e) : pol_touch(p, e)) < 0) goto done;
      }
    }
  }
  ok = !PyErr_Occurred();
done:
  pols_end(&ps);
done0:
  Py_DECREF(c2); Py_DECREF(observing); Py_XDECREF(seq); Py_XDECREF(dec); Py_XDECREF(policies);
  if (!ok) return NULL;
  Py_RETURN_NONE;
}

/* unpin(index, entries) */
static PyObject *impl_unpin(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "unpin(index, entries)"); return NULL; }
  PyObject *policies = attr(args[0], s_policies);
  if (policies == NULL) return NULL;
  if (check_policies(policies) < 0) { Py_DECREF(policies); return NULL; }
  PyObject *seq = PySequence_Fast(args[1], "unpin: entries must be iterable");
  if (seq == NULL) { Py_DECREF(policies); return NULL; }
  Pols ps;
  pols_start(&ps, policies);
  int ok = 0;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject **items = PySequence_Fast_ITEMS(seq);
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *e = items[i];
    if (!is_entry(e)) goto done;
    long ref = L(e, E_ref) - 1;
    if (ref < 0) { PyErr_Format(PyExc_RuntimeError, "unpin of an unpinned block %R", e); goto done; }
    if (setL(e, E_ref, ref) < 0) goto done;
    if (ref == 0) {
      long mask = L(e, E_mask);
      PyObject *children = SLOT(e, E_children), *handles = handles_of(e);
      for (long t = 0; t < 3; t++) {
        if (!(mask >> t & 1) || LI(children, t) || PyList_GET_ITEM(handles, t) != Py_None) continue;
        Pol *p = pols_get(&ps, t);
        if (p == NULL || pol_add(p, e) < 0) goto done;
      }
    }
  }
  ok = !PyErr_Occurred();
done:
  pols_end(&ps);
  Py_DECREF(seq); Py_DECREF(policies);
  if (!ok) return NULL;
  Py_RETURN_NONE;
}

/* save_chain(index, keys, start, tier) -> the entries it pinned */
static PyObject *impl_save_chain(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 4) { PyErr_SetString(PyExc_TypeError, "save_chain(index, keys, start, tier)"); return NULL; }
  PyObject *index = args[0], *tier_o = args[3];
  Py_ssize_t start = PyLong_AsSsize_t(args[2]);
  long tier = PyLong_AsLong(tier_o);
  if (PyErr_Occurred()) return NULL;
  if (tier < 0 || tier > 2 || start < 0) { PyErr_SetString(PyExc_ValueError, "save_chain: bad tier or start"); return NULL; }
  PyObject *entries = attr(index, s_entries), *uncached = attr(index, s_uncached), *policies = attr(index, s_policies);
  PyObject *clk = attr(index, s_clock), *admits = attr(index, s_admits), *events = attr(index, s_events);
  PyObject *counts = attr(index, s_counts), *seq = PySequence_Fast(args[1], "save_chain: keys must be a sequence");
  PyObject *pinned = PyList_New(0), *admit = NULL, *parent = NULL, *parent_entry = NULL, *entry = NULL;
  PyObject *recorded = NULL;  /* the keys the tier gains, told to events once at the end */
  Pols ps;
  pols_start(&ps, policies);
  int ok = 0, admit_kind = 0;  /* 0 none, 1 hit_density's in C, 2 a Python call */
  if (!entries || !uncached || !policies || !clk || !admits || !events || !counts || !seq || !pinned) goto done;
  {
    int err;
    recorded = events_keys(events, &err);
    if (err) goto done;
  }
  if (!PyDict_CheckExact(entries) || !PyDict_CheckExact(uncached) || check_policies(policies) < 0 ||
      !PyList_CheckExact(counts) || PyList_GET_SIZE(counts) != 3) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "save_chain: unexpected index state");
    goto done;
  }
  long clock = PyLong_AsLong(clk), bit = 1L << tier;
  Pol *pol = pols_get(&ps, tier);
  if (pol == NULL) goto done;
  admit = PySequence_GetItem(admits, tier);
  if (admit == NULL) goto done;
  if (admit != Py_None) admit_kind = pol->kind == 2 ? 1 : 2;
  int untrack = 1;
  for (long t = 0; t < 3; t++) {
    Pol *p = pols_get(&ps, t);
    if (p == NULL) goto done;
    if (p->kind >= 3) untrack = 0;  /* a Python or heap policy may keep objects in handles */
  }
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), skipped = 0, depth = start;
  PyObject **keys = PySequence_Fast_ITEMS(seq);
  if (start > n) start = depth = n;
  if (start) {
    parent = keys[start - 1]; Py_INCREF(parent);
    parent_entry = PyDict_GetItemWithError(entries, parent);
    if (parent_entry == NULL && !PyErr_Occurred()) parent_entry = PyDict_GetItemWithError(uncached, parent);
    if (PyErr_Occurred()) goto done;
    Py_XINCREF(parent_entry);
  } else { parent = Py_None; Py_INCREF(parent); }
  for (Py_ssize_t i = start; i < n; i++) {
    PyObject *key = keys[i];
    entry = PyDict_GetItemWithError(entries, key);
    if (entry == NULL && PyErr_Occurred()) goto done;
    Py_XINCREF(entry);
    if (entry == NULL) {
      PyObject *revived = NULL;
      if (PyDict_GET_SIZE(uncached)) {
        revived = PyDict_GetItemWithError(uncached, key);
        if (revived == NULL && PyErr_Occurred()) goto done;
        if (revived != NULL) { Py_INCREF(revived); if (PyDict_DelItem(uncached, key) < 0) { Py_DECREF(revived); goto done; } }
      }
      if (revived == NULL) {
        entry = new_entry(key, parent, depth, clk, bit, 1, untrack);
        if (entry == NULL || PyDict_SetItem(entries, key, entry) < 0 || PyList_Append(pinned, entry) < 0) goto done;
      } else {
        entry = revived;
        if (!is_entry(entry) || PyDict_SetItem(entries, key, entry) < 0) goto done;
        Py_INCREF(parent);
        setO(entry, E_parent, parent);
        if (setL(entry, E_depth, depth) < 0 || setL(entry, E_last, clock) < 0 || setL(entry, E_mask, bit) < 0) goto done;
        Py_INCREF(best_of[bit]);
        setO(entry, E_best, best_of[bit]);
        if (L(entry, E_ref) == 0) {
          if (setL(entry, E_ref, 1) < 0 || PyList_Append(pinned, entry) < 0) goto done;
        }
      }
    } else {
      if (!is_entry(entry)) goto done;
      long mask = L(entry, E_mask);
      if (mask & bit) {
        Py_SETREF(parent, (Py_INCREF(key), key));
        Py_XSETREF(parent_entry, entry);
        entry = NULL;
        depth++;
        skipped++;
        continue;
      }
      if (L(entry, E_ref) == 0) {
        if (setL(entry, E_ref, 1) < 0) goto done;
        for (long t = 0; t < 3; t++) {
          if (!(mask >> t & 1) || PyList_GET_ITEM(handles_of(entry), t) == Py_None) continue;
          Pol *p = pols_get(&ps, t);
          if (p == NULL || pol_discard(p, entry) < 0) goto done;
        }
        if (PyList_Append(pinned, entry) < 0) goto done;
      }
      mask = L(entry, E_mask) | bit;
      if (setL(entry, E_mask, mask) < 0) goto done;
      Py_INCREF(best_of[mask]);
      setO(entry, E_best, best_of[mask]);
    }
    if (admit_kind == 1) { if (hd_admit(pol->policy, entry) < 0) goto done; }
    else if (admit_kind == 2 && call_drop(PyObject_CallOneArg(admit, entry)) < 0) goto done;
    if (recorded != NULL && PyList_Append(recorded, key) < 0) goto done;
    if (parent != Py_None) {
      if (parent_entry == NULL) {
        parent_entry = new_entry(parent, Py_None, depth - 1 > 0 ? depth - 1 : 0, zero, 0, 0, untrack);
        if (parent_entry == NULL || PyDict_SetItem(uncached, parent, parent_entry) < 0) goto done;
      }
      PyObject *children = SLOT(parent_entry, E_children);
      long nc = LI(children, tier) + 1;
      if (setLI(children, tier, nc) < 0) goto done;
      if (nc == 1 && PyList_GET_ITEM(handles_of(parent_entry), tier) != Py_None && pol_discard(pol, parent_entry) < 0)
        goto done;
    }
    Py_SETREF(parent, (Py_INCREF(key), key));
    Py_XSETREF(parent_entry, entry);
    entry = NULL;
    depth++;
  }
  if (setLI(counts, tier, LI(counts, tier) + (depth - start - skipped)) < 0) goto done;
  ok = !PyErr_Occurred();
done:
  if (recorded != NULL && events_record(events, s_stored_keys, recorded, tier_o) < 0) ok = 0;
  Py_XDECREF(recorded);
  pols_end(&ps);
  Py_XDECREF(entry); Py_XDECREF(parent); Py_XDECREF(parent_entry); Py_XDECREF(admit);
  Py_XDECREF(entries); Py_XDECREF(uncached); Py_XDECREF(policies); Py_XDECREF(clk); Py_XDECREF(admits);
  Py_XDECREF(events); Py_XDECREF(counts); Py_XDECREF(seq);
  if (!ok) { Py_XDECREF(pinned); return NULL; }
  return pinned;
}

/* _drop(entry, tier, defer) of index.py; *exposed gets a new reference or NULL. */
typedef struct { PyObject *index, *entries, *uncached, *counts, *events, *tier_o; Pol *pol; long tier; int listeners; } DropCtx;

static int drop_entry(DropCtx *d, PyObject *e, int defer, PyObject **exposed) {
  long tier = d->tier;
  *exposed = NULL;
  if (PyList_GET_ITEM(handles_of(e), tier) != Py_None && pol_discard(d->pol, e) < 0) return -1;
  long mask = L(e, E_mask) & ~(1L << tier);
  if (setL(e, E_mask, mask) < 0) return -1;
  Py_INCREF(best_of[mask]);
  setO(e, E_best, best_of[mask]);
  if (tier == 0) { Py_INCREF(Py_None); setO(e, E_l1, Py_None); }
  if (setLI(d->counts, tier, LI(d->counts, tier) - 1) < 0) return -1;
  PyObject *key = SLOT(e, E_key);
  if (d->events != Py_None && call_drop(PyObject_CallMethodObjArgs(d->events, s_removed, key, d->tier_o, NULL)) < 0)
    return -1;
  PyObject *parent = SLOT(e, E_parent);
  if (parent != Py_None) {
    PyObject *pe = PyDict_GetItemWithError(d->entries, parent);
    if (pe == NULL && !PyErr_Occurred()) pe = PyDict_GetItemWithError(d->uncached, parent);
    if (PyErr_Occurred()) return -1;
    if (pe != NULL) {
      PyObject *children = SLOT(pe, E_children);
      long nc = LI(children, tier) - 1;
      if (setLI(children, tier, nc) < 0) return -1;
      if (nc == 0) {
        long pmask = L(pe, E_mask);
        if (pmask >> tier & 1 && L(pe, E_ref) == 0 && PyList_GET_ITEM(handles_of(pe), tier) == Py_None) {
          if (defer) { Py_INCREF(pe); *exposed = pe; }
          else if (pol_add(d->pol, pe) < 0) return -1;
        } else if (pmask == 0 && !LI(children, 0) && !LI(children, 1) && !LI(children, 2)) {
          if (PyDict_DelItem(d->uncached, parent) < 0) return -1;
        }
      }
    }
  }
  if (mask == 0) {
    Py_INCREF(key);
    int rc = PyDict_DelItem(d->entries, key);
    if (rc == 0) {
      PyObject *children = SLOT(e, E_children);
      if (LI(children, 0) || LI(children, 1) || LI(children, 2)) rc = PyDict_SetItem(d->uncached, key, e);
    }
    if (rc == 0 && d->listeners && call_drop(PyObject_CallMethodOneArg(d->index, s_notify, key)) < 0) rc = -1;
    Py_DECREF(key);
    if (rc < 0) { Py_CLEAR(*exposed); return -1; }
  }
  return 0;
}

/* evict(index, tier, n) -> victims */
static PyObject *impl_evict(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "evict(index, tier, n)"); return NULL; }
  PyObject *index = args[0];
  long tier = PyLong_AsLong(args[1]);
  Py_ssize_t n = PyLong_AsSsize_t(args[2]);
  if (PyErr_Occurred()) return NULL;
  if (tier < 0 || tier > 2) { PyErr_SetString(PyExc_ValueError, "evict: bad tier"); return NULL; }
  PyObject *victims = PyList_New(0);
  if (victims == NULL) return NULL;
  PyObject *policies = attr(index, s_policies);
  if (policies == NULL) { Py_DECREF(victims); return NULL; }
  if (check_policies(policies) < 0 || PyList_GET_ITEM(policies, tier) == Py_None || n <= 0) {
    Py_DECREF(policies);
    if (PyErr_Occurred()) { Py_DECREF(victims); return NULL; }
    return victims;
  }
  Pol pol;
  DropCtx d = {index, NULL, NULL, NULL, NULL, args[1], &pol, tier, 0};
  PyObject *exposed = NULL, *entry = NULL, *saved_index = clock_index;
  long saved_clock = clock_value;
  int ok = 0, deferring = 1;
  PyObject *clk = attr(index, s_clock);
  if (clk == NULL) { Py_DECREF(policies); Py_DECREF(victims); return NULL; }
  clock_value = PyLong_AsLong(clk);
  Py_DECREF(clk);
  clock_index = index;
  int saved_cached = limits_cached;
  long saved_cap = cached_cap;
  if (pol_init(&pol, PyList_GET_ITEM(policies, tier)) < 0) { pol.kind = -1; goto done; }
  if (pol.kind == 2) {
    limits_cached = 0;
    if (ghost_cap(&cached_cap) < 0) goto done;
    limits_cached = 1;
  }
  if (pol.kind == 3) {
    int has = PyObject_HasAttr(pol.policy, s_pop_after);
    deferring = has;
  }
  d.entries = attr(index, s_entries); d.uncached = attr(index, s_uncached);
  d.counts = attr(index, s_counts); d.events = attr(index, s_events);
  if (!d.entries || !d.uncached || !d.counts || !d.events) goto done;
  {  /* registered listeners, read once per call (the tuple is replaced, never changed, on registration) */
    PyObject *listeners = attr(index, s_listeners);
    if (listeners == NULL) goto done;
    d.listeners = PyObject_IsTrue(listeners);
    Py_DECREF(listeners);
    if (d.listeners < 0) goto done;
  }
  if (!PyDict_CheckExact(d.entries) || !PyDict_CheckExact(d.uncached) || !PyList_CheckExact(d.counts) ||
      PyList_GET_SIZE(d.counts) != 3) {
    PyErr_SetString(PyExc_TypeError, "evict: unexpected index state");
    goto done;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    if (exposed == NULL) {
      entry = pol_pop(&pol);
      if (entry == NULL) { if (PyErr_Occurred()) goto done; break; }
    } else {
      entry = pol_pop_after(&pol, exposed);
      Py_CLEAR(exposed);
      if (entry == NULL) { if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "evict: pop_after gave None"); goto done; }
    }
    if (!is_entry(entry) || drop_entry(&d, entry, deferring, &exposed) < 0) goto done;
    if (PyList_Append(victims, entry) < 0) goto done;
    Py_CLEAR(entry);
  }
  if (exposed != NULL && pol_add(&pol, exposed) < 0) goto done;
  ok = !PyErr_Occurred();
done:
  clock_index = saved_index;
  clock_value = saved_clock;
  limits_cached = saved_cached;
  cached_cap = saved_cap;
  pol_clear(&pol);
  Py_XDECREF(entry); Py_XDECREF(exposed); Py_DECREF(policies);
  Py_XDECREF(d.entries); Py_XDECREF(d.uncached); Py_XDECREF(d.counts); Py_XDECREF(d.events);
  if (!ok) { Py_DECREF(victims); return NULL; }
  return victims;
}


/* Keyword arguments for the index's entry points (PrefixIndex binds them to itself with partial,
   so ``index.use(entries, pin=True)`` works as the Python method does). */
static PyObject *with_keywords(PyObject *(*impl)(PyObject *, PyObject *const *, Py_ssize_t), PyObject *m,
                               PyObject *const *args, size_t nargsf, PyObject *kwnames,
                               const char *const *names, Py_ssize_t n) {
  /* names[0]: the function; names[1..n-1]: its parameters, in order */
  Py_ssize_t nargs = PyVectorcall_NARGS(nargsf), params = n - 1;
  if (kwnames == NULL || PyTuple_GET_SIZE(kwnames) == 0) return impl(m, args, nargs);
  PyObject *bound[8] = {NULL};
  if (nargs > params || params > 8) { PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments", names[0], params); return NULL; }
  for (Py_ssize_t i = 0; i < nargs; i++) bound[i] = args[i];
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(kwnames); k++) {
    const char *kw = PyUnicode_AsUTF8(PyTuple_GET_ITEM(kwnames, k));
    if (kw == NULL) return NULL;
    Py_ssize_t j = 0;
    while (j < params && strcmp(names[j + 1], kw) != 0) j++;
    if (j == params || bound[j] != NULL) {
      PyErr_Format(PyExc_TypeError, "%s() got an unexpected or repeated argument '%s'", names[0], kw);
      return NULL;
    }
    bound[j] = args[nargs + k];
  }
  for (Py_ssize_t j = 0; j < params; j++)
    if (bound[j] == NULL) { PyErr_Format(PyExc_TypeError, "%s() missing argument '%s'", names[0], names[j + 1]); return NULL; }
  return impl(m, bound, params);
}
#define KW_ENTRY(name, ...) \
  static const char *const names_##name[] = {#name, __VA_ARGS__}; \
  static PyObject *py_##name(PyObject *m, PyObject *const *args, size_t nargsf, PyObject *kwnames) { \
    return with_keywords(impl_##name, m, args, nargsf, kwnames, names_##name, \
                         (Py_ssize_t)(sizeof(names_##name) / sizeof(char *))); \
  }

KW_ENTRY(match_entries, "entries", "keys")
KW_ENTRY(use, "index", "entries", "pin")
KW_ENTRY(unpin, "index", "entries")
KW_ENTRY(save_chain, "index", "keys", "start", "tier")
KW_ENTRY(evict, "index", "tier", "n")

/* The AgeQueue and hit_density methods themselves, for the policies' own Python seams. */
static PyObject *ret_entry(PyObject *e) { if (e == NULL && !PyErr_Occurred()) Py_RETURN_NONE; return e; }
static int args_ok(Py_ssize_t nargs, Py_ssize_t want, PyObject *const *args, PyTypeObject *t, const char *name) {
  if (nargs != want || Py_TYPE(args[0]) != t || (want > 1 && !is_entry(args[1]))) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_TypeError, "index_native.%s: bad arguments", name);
    return 0;
  }
  return 1;
}
static PyObject *py_aq_add(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  if (!args_ok(n, 2, a, QueueT, "aq_add") || aq_add(a[0], a[1]) < 0) return NULL;
  Py_RETURN_NONE;
}
static PyObject *py_aq_discard(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  if (!args_ok(n, 2, a, QueueT, "aq_discard") || aq_discard(a[0], a[1]) < 0) return NULL;
  Py_RETURN_NONE;
}
static PyObject *py_aq_pop(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  if (!args_ok(n, 1, a, QueueT, "aq_pop")) return NULL;
  return ret_entry(aq_pop(a[0]));
}
static PyObject *py_aq_head(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  if (!args_ok(n, 1, a, QueueT, "aq_head")) return NULL;
  return ret_entry(aq_head(a[0]));
}
static PyObject *py_aq_pop_after(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  if (!args_ok(n, 2, a, QueueT, "aq_pop_after")) return NULL;
  return aq_pop_after(a[0], a[1]);
}
static PyObject *py_hd_pop(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  if (!args_ok(n, 1, a, HdT, "hd_pop")) return NULL;
  return ret_entry(hd_take(a[0], NULL, -1));
}
static PyObject *py_hd_pop_after(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  if (!args_ok(n, 2, a, HdT, "hd_pop_after")) return NULL;
  return ret_entry(hd_pop_after(a[0], a[1]));
}

/* -- setup ---------------------------------------------------------------------------------------- */

static int offset_of(PyTypeObject *t, const char *name, Py_ssize_t *out) {
  PyObject *d = PyObject_GetAttrString((PyObject *)t, name);
  if (d == NULL) return -1;
  int ok = Py_TYPE(d) == &PyMemberDescr_Type && ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX;
  if (ok) *out = ((PyMemberDescrObject *)d)->d_member->offset;
  Py_DECREF(d);
  if (!ok) PyErr_Format(PyExc_TypeError, "index_native: %s.%s is not a slot", t->tp_name, name);
  return ok ? 0 : -1;
}

#define OFF(t, name, var) if (offset_of(t, name, &var) < 0) return NULL
#define STR(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

/* setup(Entry, AgeQueue, LRUPolicy, HitDensityPolicy, hit_density_globals, deque, best, constants) */
static PyObject *py_setup(PyObject *m, PyObject *const *a, Py_ssize_t n) {
  if (n != 9) { PyErr_SetString(PyExc_TypeError, "setup: 9 arguments"); return NULL; }
  /* a[8]: (HeapPolicy, CostAwarePolicy, heapq, _THETA_WEIGHT, _REKEY_DRIFT) */
  if (!PyTuple_Check(a[8]) || PyTuple_GET_SIZE(a[8]) != 5 || !PyType_Check(PyTuple_GET_ITEM(a[8], 0)) ||
      !PyType_Check(PyTuple_GET_ITEM(a[8], 1))) { PyErr_SetString(PyExc_TypeError, "setup: heap"); return NULL; }
  HeapT = (PyTypeObject *)PyTuple_GET_ITEM(a[8], 0); CostT = (PyTypeObject *)PyTuple_GET_ITEM(a[8], 1);
  Py_INCREF(HeapT); Py_INCREF(CostT);
  {
    PyObject *hq = PyTuple_GET_ITEM(a[8], 2);
    if ((heapify_f = PyObject_GetAttrString(hq, "heapify")) == NULL) return NULL;
    theta_weight = PyFloat_AsDouble(PyTuple_GET_ITEM(a[8], 3));
    rekey_drift = PyFloat_AsDouble(PyTuple_GET_ITEM(a[8], 4));
    if (PyErr_Occurred()) return NULL;
    heap_taken_f = _PyType_Lookup(HeapT, PyUnicode_InternFromString("taken"));
    if (heap_taken_f == NULL) { PyErr_SetString(PyExc_TypeError, "setup: HeapPolicy.taken"); return NULL; }
    Py_INCREF(heap_taken_f);
  }
  for (int i = 0; i < 4; i++) if (!PyType_Check(a[i])) { PyErr_SetString(PyExc_TypeError, "setup: types"); return NULL; }
  long want[] = {TAG_BITS, BINS, LEVELS, CLASSES, TIP, SEEN, EXTRA_SHIFT, EXTRA_MASK, BANDS, BAND_SHIFT, BAND_MASK};
  enum { N_WANT = sizeof(want) / sizeof(want[0]) };
  if (!PyTuple_Check(a[7]) || PyTuple_GET_SIZE(a[7]) != N_WANT) { PyErr_SetString(PyExc_TypeError, "setup: constants"); return NULL; }
  for (int i = 0; i < N_WANT; i++) if (PyLong_AsLong(PyTuple_GET_ITEM(a[7], i)) != want[i]) {
    PyErr_Format(PyExc_ValueError, "index_native: constant %d is %R, the C code assumes %ld", i, PyTuple_GET_ITEM(a[7], i), want[i]);
    return NULL;
  }
  if (!PyTuple_Check(a[6]) || PyTuple_GET_SIZE(a[6]) != 8) { PyErr_SetString(PyExc_TypeError, "setup: best"); return NULL; }
  EntryT = (PyTypeObject *)a[0]; QueueT = (PyTypeObject *)a[1]; LruT = (PyTypeObject *)a[2]; HdT = (PyTypeObject *)a[3];
  Py_INCREF(EntryT); Py_INCREF(QueueT); Py_INCREF(LruT); Py_INCREF(HdT);
  hd_globals = a[4]; Py_INCREF(hd_globals);
  deque_t = a[5]; Py_INCREF(deque_t);
  if ((zero = PyLong_FromLong(0)) == NULL || (zero_f = PyFloat_FromDouble(0.0)) == NULL) return NULL;
  if ((deque_append = PyObject_GetAttrString(deque_t, "append")) == NULL) return NULL;
  if ((deque_popleft = PyObject_GetAttrString(deque_t, "popleft")) == NULL) return NULL;
  for (int i = 0; i < 8; i++) { best_of[i] = PyTuple_GET_ITEM(a[6], i); Py_INCREF(best_of[i]); }
  OFF(EntryT, "key", E_key); OFF(EntryT, "parent", E_parent); OFF(EntryT, "depth", E_depth);
  OFF(EntryT, "mask", E_mask); OFF(EntryT, "best", E_best); OFF(EntryT, "l1_slot", E_l1);
  OFF(EntryT, "ref_count", E_ref); OFF(EntryT, "last_access", E_last); OFF(EntryT, "freq", E_freq);
  OFF(EntryT, "hits", E_hits); OFF(EntryT, "tag", E_tag); OFF(EntryT, "children", E_children);
  OFF(EntryT, "handles", E_handles);
  OFF(QueueT, "tier", Q_tier); OFF(QueueT, "tag", Q_tag); OFF(QueueT, "buckets", Q_buckets);
  OFF(QueueT, "keys", Q_keys); OFF(QueueT, "live", Q_live); OFF(QueueT, "stored", Q_stored);
  OFF(HdT, "tier", H_tier); OFF(HdT, "index", H_index); OFF(HdT, "_queues", H_queues);
  OFF(HdT, "_scored", H_scored); OFF(HdT, "_scores", H_scores); OFF(HdT, "_scored_clock", H_scored_clock);
  OFF(HdT, "_scored_version", H_scored_version); OFF(HdT, "_benefit", H_benefit);
  OFF(HdT, "hit_hist", H_hit_hist); OFF(HdT, "end_hist", H_end_hist); OFF(HdT, "density", H_density);
  OFF(HdT, "_events", H_events); OFF(HdT, "_period", H_period); OFF(HdT, "updates", H_updates);
  OFF(HdT, "ghosts", H_ghosts); OFF(HdT, "_counts", H_counts); OFF(HdT, "ghost_hits", H_ghost_hits);
  OFF(HdT, "ghost_factor", H_ghost_factor);
  OFF(HeapT, "tier", P_tier); OFF(HeapT, "index", P_index); OFF(HeapT, "_heap", P_heap); OFF(HeapT, "_seq", P_seq);
  OFF(HeapT, "_size", P_size);
  OFF(CostT, "beta", C_beta); OFF(CostT, "_inv_beta", C_inv_beta); OFF(CostT, "_benefit", C_benefit);
  OFF(CostT, "theta", C_theta); OFF(CostT, "_keyed_theta", C_keyed); OFF(CostT, "rekeys", C_rekeys);
  OFF(CostT, "rekeyed", C_rekeyed);
  STR(s_append, "append"); STR(s_popleft, "popleft"); STR(s_discard, "discard"); STR(s_add, "add");
  STR(s_touch, "touch"); STR(s_pop, "pop"); STR(s_pop_after, "pop_after"); STR(s_sweep, "_sweep");
  STR(s_update, "_update"); STR(s_benefit_at, "_benefit_at"); STR(s_popitem, "popitem"); STR(s_stored_keys, "stored_keys"); STR(s_ev_listeners, "_listeners");
  STR(s_removed, "removed"); STR(s_notify, "_notify_removed"); STR(s_clock, "clock"); STR(s_queue, "_queue");
  STR(s_mg, "MAX_GHOSTS"); STR(s_observe, "observe"); STR(s_entries, "_entries");
  STR(s_uncached, "_uncached_parents"); STR(s_policies, "policies"); STR(s_admits, "_admits");
  STR(s_events, "events"); STR(s_counts, "counts"); STR(s_listeners, "_removal_listeners");
  STR(s_observing, "_observing"); STR(s_decay, "_decay"); STR(s_priority, "priority"); STR(s_taken, "taken");
  STR(s_rekey, "rekey"); STR(s_priority_by_key, "priority_by_key");
  ready = 1;
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
  {"setup", (PyCFunction)(void (*)(void))py_setup, METH_FASTCALL, NULL},
  {"match_entries", (PyCFunction)(void (*)(void))py_match_entries, METH_FASTCALL | METH_KEYWORDS, NULL},
  {"use", (PyCFunction)(void (*)(void))py_use, METH_FASTCALL | METH_KEYWORDS, NULL},
  {"unpin", (PyCFunction)(void (*)(void))py_unpin, METH_FASTCALL | METH_KEYWORDS, NULL},
  {"save_chain", (PyCFunction)(void (*)(void))py_save_chain, METH_FASTCALL | METH_KEYWORDS, NULL},
  {"evict", (PyCFunction)(void (*)(void))py_evict, METH_FASTCALL | METH_KEYWORDS, NULL},
  {"aq_add", (PyCFunction)(void (*)(void))py_aq_add, METH_FASTCALL, NULL},
  {"aq_discard", (PyCFunction)(void (*)(void))py_aq_discard, METH_FASTCALL, NULL},
  {"aq_pop", (PyCFunction)(void (*)(void))py_aq_pop, METH_FASTCALL, NULL},
  {"aq_head", (PyCFunction)(void (*)(void))py_aq_head, METH_FASTCALL, NULL},
  {"aq_pop_after", (PyCFunction)(void (*)(void))py_aq_pop_after, METH_FASTCALL, NULL},
  {"hd_alive", (PyCFunction)(void (*)(void))py_hd_alive, METH_FASTCALL, NULL},
  {"hd_pop", (PyCFunction)(void (*)(void))py_hd_pop, METH_FASTCALL, NULL},
  {"hd_pop_after", (PyCFunction)(void (*)(void))py_hd_pop_after, METH_FASTCALL, NULL},
  {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tierkv_index", NULL, -1, methods};

PyMODINIT_FUNC PyInit__tierkv_index(void) { return PyModule_Create(&module); }
