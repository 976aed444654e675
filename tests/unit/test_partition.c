/* Row partition: every row exactly once, contiguous and balanced; whole
 * shards when there are many, row ranges when there are few; item split. */
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "kqsvd_mpi.h"

static void verify(int64_t n, const int64_t *rows, int P, int expect_whole) {
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
    CHECK(mine <= share * 1.1 + 1 && mine >= share * 0.9 - 1,
          "P=%d rank %d has %lld rows, share %.1f", P, p, (long long)mine, share);
  }
  CHECK(expect_shard == n, "P=%d: rows left over", P);
  if (expect_whole) CHECK(split == 0, "P=%d: %d shards split though there are many", P, split);
  free(segs);
  free(first);
}

int main(void) {
  int64_t many[100], few[3] = {1000, 10, 2500}, one[1] = {777}, holes[5] = {0, 50, 0, 50, 0};
  for (int i = 0; i < 100; i++) many[i] = 100 + (i * 37) % 11;
  const int ranks[] = {1, 2, 3, 4, 7};
  for (int i = 0; i < 5; i++) {
    verify(100, many, ranks[i], 1);
    verify(3, few, ranks[i], 0);
    verify(1, one, ranks[i], 0);
    verify(5, holes, ranks[i], 0);
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
