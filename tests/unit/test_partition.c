/* Row partition: every row exactly once, contiguous and balanced; whole
 * shards when there are many, row ranges when there are few; item split. */
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "kqsvd_mpi.h"

/* Each boundary moves by at most snap (0.1) of a share, so a rank's rows
 * lie within `slack` = 0.1 of the share when one boundary moves and 0.2
 * when both of its boundaries move towards each other. */
static void verify(int64_t n, const int64_t *rows, int P, int expect_whole, double slack) {
  kqsvd_segment_t *segs = NULL;
  int64_t *first = NULL, total = 0;
  for (int64_t s = 0; s < n; s++) total += rows[s];
  CHECK_OK(kqsvd_partition_rows(n, rows, P, 0.1, &segs, &first));
  int64_t expect_shard = 0, expect_row = 0;
  while (expect_shard < n && rows[expect_shard] == 0) expect_shard++;
  const double share = (double)total / P;
  int split = 0;
  for (int p = 0; p < P; p++) {
    int64_t mine = 0;
    for (int64_t k = first[p]; k < first[p + 1]; k++) {
      /* Segments continue exactly where the previous one ended. */
      CHECK(segs[k].shard == expect_shard && segs[k].row0 == expect_row,
            "P=%d rank %d: segment %lld starts at shard %lld row %lld", P, p, (long long)k,
            (long long)segs[k].shard, (long long)segs[k].row0);
      CHECK(segs[k].row1 > segs[k].row0 && segs[k].row1 <= rows[segs[k].shard], "bad range");
      split += segs[k].row0 > 0 || segs[k].row1 < rows[segs[k].shard];
      mine += segs[k].row1 - segs[k].row0;
      expect_row = segs[k].row1;
      if (expect_row == rows[expect_shard]) {
        expect_shard++, expect_row = 0;
        while (expect_shard < n && rows[expect_shard] == 0) expect_shard++;
      }
    }
    CHECK(mine <= share * (1 + slack) + 1 && mine >= share * (1 - slack) - 1,
          "P=%d rank %d has %lld rows, share %.1f", P, p, (long long)mine, share);
  }
  CHECK(expect_shard == n, "P=%d: rows left over", P);
  if (expect_whole) CHECK(split == 0, "P=%d: %d shards split though there are many", P, split);
  free(segs);
  free(first);
}

/* The ranks that open a shard together: each rank computes the plan on
 * its own, and all must name exactly the ranks that hold a segment of the
 * shard, or the group-collective open waits forever. */
static void verify_readers(int64_t n, const int64_t *rows, int P) {
  kqsvd_segment_t *segs = NULL, *mine = NULL;
  int64_t *first = NULL, *mfirst = NULL;
  int readers[64], theirs[64];
  CHECK_OK(kqsvd_partition_rows(n, rows, P, 0.1, &segs, &first));
  for (int64_t s = 0; s < n; s++) {
    const int nr = kqsvd_partition_readers(segs, first, P, s, readers);
    int holders = 0;
    for (int p = 0; p < P; p++) {
      int has = 0;
      for (int64_t k = first[p]; k < first[p + 1]; k++) has |= segs[k].shard == s;
      if (!has) continue;
      CHECK(holders < nr && readers[holders] == p,
            "P=%d shard %lld: rank %d reads it but is not "
            "listed",
            P, (long long)s, p);
      holders++;
    }
    CHECK(holders == nr, "P=%d shard %lld: %d readers listed, %d hold rows", P, (long long)s, nr,
          holders);
    CHECK(rows[s] == 0 || nr >= 1, "P=%d shard %lld has rows but no reader", P, (long long)s);
    /* Every reader's own plan gives the same group. */
    for (int i = 0; i < nr; i++) {
      CHECK_OK(kqsvd_partition_rows(n, rows, P, 0.1, &mine, &mfirst));
      const int nm = kqsvd_partition_readers(mine, mfirst, P, s, theirs);
      CHECK(nm == nr && memcmp(theirs, readers, (size_t)nr * sizeof *readers) == 0,
            "P=%d shard %lld: rank %d sees another group", P, (long long)s, readers[i]);
      free(mine);
      free(mfirst);
    }
  }
  free(segs);
  free(first);
}

/* Random plans: 1 to a few hundred rows over uneven shards, 1 to 16 ranks,
 * including more ranks than rows. */
static void random_plans(void) {
  uint64_t x = 0x9e3779b97f4a7c15u;
  for (int trial = 0; trial < 400; trial++) {
    int64_t rows[12];
    x = x * 6364136223846793005u + 1442695040888963407u;
    const int64_t n = 1 + (int64_t)((x >> 33) % 12);
    int64_t total = 0;
    for (int64_t s = 0; s < n; s++) {
      x = x * 6364136223846793005u + 1442695040888963407u;
      const uint64_t r = x >> 33;
      /* Mostly tiny shards, some empty, a few large. */
      rows[s] = r % 7 == 0 ? 0 : r % 5 == 0 ? (int64_t)(r % 300) : (int64_t)(r % 6);
      total += rows[s];
    }
    if (total == 0) rows[0] = 1;
    for (int P = 1; P <= 16; P++) {
      verify(n, rows, P, 0, 0.2);
      verify_readers(n, rows, P);
    }
  }
}

int main(void) {
  random_plans();
  int64_t many[100], few[3] = {1000, 10, 2500}, one[1] = {777}, holes[5] = {0, 50, 0, 50, 0};
  for (int i = 0; i < 100; i++) many[i] = 100 + (i * 37) % 11;
  const int ranks[] = {1, 2, 3, 4, 7};
  for (int i = 0; i < 5; i++) {
    verify(100, many, ranks[i], 1, 0.1);
    verify(3, few, ranks[i], 0, 0.1);
    verify(1, one, ranks[i], 0, 0.1);
    verify(5, holes, ranks[i], 0, 0.1);
  }
  /* Items: blocks that cover 0..n-1 in order. */
  for (int P = 1; P <= 9; P++) {
    int64_t next = 0;
    for (int p = 0; p < P; p++) {
      int64_t a, b;
      kqsvd_partition_items(10, P, p, &a, &b);
      CHECK(a == next && b >= a && b - a <= 10 / P + 1, "items P=%d p=%d: [%lld, %lld)", P, p,
            (long long)a, (long long)b);
      next = b;
    }
    CHECK(next == 10, "items P=%d end at %lld", P, (long long)next);
  }
  return check_exit("test_partition");
}
