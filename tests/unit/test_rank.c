/* The paper's rank rule on spectra whose answer is known by hand. */
#include "check.h"
#include "kqsvd_rank.h"

int main(void) {
  /* One head, energies 4, 3, 2, 1 (sigma = sqrt): retained 0.4, 0.7, 0.9, 1. */
  const double a[4] = {2.0, 1.7320508075688772, 1.4142135623730951, 1.0};
  CHECK(kqsvd_rank_eps(1, 4, a, 0.65) == 1, "eps 0.65 -> 1");
  CHECK(kqsvd_rank_eps(1, 4, a, 0.35) == 2, "eps 0.35 -> 2");
  CHECK(kqsvd_rank_eps(1, 4, a, 0.1) == 3, "0.9 >= 0.9 -> 3 (boundary is inclusive)");
  CHECK(kqsvd_rank_eps(1, 4, a, 0.05) == 4, "eps 0.05 -> 4");
  /* Two heads: the average, not each head, must reach 1 - eps. */
  const double b[8] = {1, 0, 0, 0, /* all energy in one direction */
                       1, 1, 1, 1};
  /* retained averages: (1 + 0.25)/2, (1 + .5)/2, (1 + .75)/2, 1. */
  CHECK(kqsvd_rank_eps(2, 4, b, 0.4) == 1, "avg 0.625 >= 0.6");
  CHECK(kqsvd_rank_eps(2, 4, b, 0.2) == 3, "avg 0.875 >= 0.8 at r = 3");
  CHECK_CLOSE(kqsvd_rank_retained(2, 4, b, 2), 0.75, 1e-15, 1.0);
  /* A head without energy retains everything; rank is at least 1. */
  const double z[8] = {0, 0, 0, 0, 3, 0, 0, 0};
  CHECK(kqsvd_rank_eps(2, 4, z, 0.01) == 1, "zero head and a rank-1 head -> 1");
  CHECK(kqsvd_rank_eps(1, 4, z, 0.5) == 1, "all-zero layer -> 1");
  CHECK_CLOSE(kqsvd_rank_retained(1, 4, a, 4), 1.0, 0.0, 1.0);
  return check_exit("test_rank");
}
