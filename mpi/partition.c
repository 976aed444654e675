#include <math.h>
#include <stdlib.h>

#include "kqsvd_mpi.h"

void kqsvd_partition_items(int64_t n, int nranks, int p, int64_t *first, int64_t *last) {
  /* The first n % nranks ranks take one extra item. */
  const int64_t q = n / nranks, r = n % nranks;
  *first = p * q + (p < r ? p : r);
  *last = *first + q + (p < r ? 1 : 0);
}

/* Index of the shard boundary (prefix sum) nearest to `target`. */
static int64_t nearest_boundary(const int64_t *cum, int64_t nshards, int64_t target) {
  int64_t lo = 0, hi = nshards; /* cum[0] = 0, cum[nshards] = total */
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (cum[mid] <= target)
      lo = mid;
    else
      hi = mid;
  }
  return target - cum[lo] <= cum[hi] - target ? cum[lo] : cum[hi];
}

kqsvd_status_t kqsvd_partition_rows(int64_t nshards, const int64_t *rows, int nranks, double snap,
                                    kqsvd_segment_t **segs_out, int64_t **first_out) {
  kqsvd_status_t st = KQSVD_OK;
  int64_t *cum = NULL, *bound = NULL, *first = NULL;
  kqsvd_segment_t *segs = NULL;
  KQSVD_MALLOC(cum, nshards + 1, "partition prefix sums");
  KQSVD_MALLOC(bound, nranks + 1, "partition bounds");
  KQSVD_MALLOC(first, nranks + 1, "partition index");
  /* Each rank's range meets at most (shards + 1) segments in total. */
  KQSVD_MALLOC(segs, nshards + nranks, "partition segments");
  cum[0] = 0;
  for (int64_t s = 0; s < nshards; s++) cum[s + 1] = cum[s] + rows[s];
  const int64_t total = cum[nshards];
  const double share = (double)total / nranks;
  bound[0] = 0;
  bound[nranks] = total;
  for (int p = 1; p < nranks; p++) {
    const int64_t target = (int64_t)floor(share * p);
    const int64_t c = nearest_boundary(cum, nshards, target);
    int64_t b = llabs(c - target) <= snap * share && c > bound[p - 1] ? c : target;
    bound[p] = b > bound[p - 1] ? b : bound[p - 1];
  }
  int64_t n = 0, s = 0;
  for (int p = 0; p < nranks; p++) {
    first[p] = n;
    while (s < nshards && cum[s + 1] <= bound[p]) s++;
    for (int64_t t = s; t < nshards && cum[t] < bound[p + 1]; t++) {
      const int64_t r0 = bound[p] > cum[t] ? bound[p] - cum[t] : 0;
      const int64_t r1 = (bound[p + 1] < cum[t + 1] ? bound[p + 1] : cum[t + 1]) - cum[t];
      if (r1 > r0) segs[n++] = (kqsvd_segment_t){t, r0, r1};
    }
  }
  first[nranks] = n;
  *segs_out = segs;
  *first_out = first;
  segs = NULL;
  first = NULL;
done:
  free(cum);
  free(bound);
  free(first);
  free(segs);
  return st;
}

int kqsvd_partition_readers(const kqsvd_segment_t *segs, const int64_t *first, int nranks,
                            int64_t shard, int *ranks) {
  int n = 0;
  for (int p = 0; p < nranks; p++)
    for (int64_t k = first[p]; k < first[p + 1]; k++)
      if (segs[k].shard == shard) {
        ranks[n++] = p;
        break;
      }
  return n;
}
