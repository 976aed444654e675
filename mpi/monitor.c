#include <stdlib.h>

#include "kqsvd_mpi.h"
#include "kqsvd_util.h"

/* Ranks report progress to rank 0 and announce failures to everyone with
 * small point-to-point messages on a private communicator, polled between
 * blocks, so a failing rank stops the others without MPI_Abort and without
 * a collective inside the streaming loop. */
enum { TAG_PROGRESS = 1, TAG_CANCEL = 2, TAG_FIN = 3 };

/* Non-root ranks send at most this often. */
#define SEND_INTERVAL 0.25

struct kqsvd_monitor {
  MPI_Comm comm;
  int rank, size;
  int64_t total;
  kqsvd_progress_fn fn;
  void *ctx;
  double interval, last_show, last_send;
  int64_t *counts;    /* rank 0: latest report of each rank */
  int64_t send_value; /* buffer of the progress message in flight */
  MPI_Request send_req;
  int raised, stop;
  int *cancel_seen; /* cancel already received from rank q */
  MPI_Request *cancel_reqs;
  int64_t cancel_token; /* sent as MPI_INT64_T */
};

kqsvd_status_t kqsvd_monitor_init(MPI_Comm comm, int64_t total, kqsvd_progress_fn fn, void *ctx,
                                  double interval, kqsvd_monitor_t **out) {
  kqsvd_status_t st = KQSVD_OK;
  kqsvd_monitor_t *m = calloc(1, sizeof *m);
  *out = NULL;
  KQSVD_CHECK(m, KQSVD_ERR_NOMEM, "cannot allocate the progress monitor");
  m->comm = MPI_COMM_NULL;
  m->send_req = MPI_REQUEST_NULL;
  KQSVD_MPI(MPI_Comm_dup(comm, &m->comm));
  KQSVD_MPI(MPI_Comm_rank(m->comm, &m->rank));
  KQSVD_MPI(MPI_Comm_size(m->comm, &m->size));
  m->total = total;
  m->fn = fn;
  m->ctx = ctx;
  m->interval = interval;
  m->last_show = m->last_send = kqsvd_now();
  KQSVD_MALLOC(m->counts, m->size, "progress counters");
  KQSVD_MALLOC(m->cancel_seen, m->size, "cancel flags");
  KQSVD_MALLOC(m->cancel_reqs, m->size, "cancel requests");
  for (int q = 0; q < m->size; q++) {
    m->counts[q] = 0;
    m->cancel_seen[q] = 0;
    m->cancel_reqs[q] = MPI_REQUEST_NULL;
  }
  *out = m;
  m = NULL;
done:
  kqsvd_monitor_free(&m);
  return st;
}

/* Receives one matched message and files it. */
static kqsvd_status_t handle(kqsvd_monitor_t *m, const MPI_Status *probe) {
  kqsvd_status_t st = KQSVD_OK;
  int64_t value = 0;
  KQSVD_MPI(MPI_Recv(&value, 1, MPI_INT64_T, probe->MPI_SOURCE, probe->MPI_TAG, m->comm,
                     MPI_STATUS_IGNORE));
  if (probe->MPI_TAG == TAG_CANCEL) {
    m->cancel_seen[probe->MPI_SOURCE] = 1;
    m->stop = 1;
  } else {
    m->counts[probe->MPI_SOURCE] = value;
  }
done:
  return st;
}

static int64_t summed(const kqsvd_monitor_t *m) {
  int64_t s = 0;
  for (int q = 0; q < m->size; q++) s += m->counts[q];
  return s;
}

kqsvd_status_t kqsvd_monitor_update(kqsvd_monitor_t *m, int64_t local_done, int *stop) {
  kqsvd_status_t st = KQSVD_OK;
  const double now = kqsvd_now();
  m->counts[m->rank] = local_done;
  /* FIN messages are left for kqsvd_monitor_finish to match. */
  static const int tags[2] = {TAG_PROGRESS, TAG_CANCEL};
  for (int t = 0; t < 2; t++)
    for (;;) {
      int flag = 0;
      MPI_Status probe;
      KQSVD_MPI(MPI_Iprobe(MPI_ANY_SOURCE, tags[t], m->comm, &flag, &probe));
      if (!flag) break;
      KQSVD_CALL(handle(m, &probe));
    }
  if (m->rank != 0 && now - m->last_send >= SEND_INTERVAL) {
    int idle = 1;
    if (m->send_req != MPI_REQUEST_NULL)
      KQSVD_MPI(MPI_Test(&m->send_req, &idle, MPI_STATUS_IGNORE));
    if (idle) {
      m->send_value = local_done;
      KQSVD_MPI(MPI_Isend(&m->send_value, 1, MPI_INT64_T, 0, TAG_PROGRESS, m->comm, &m->send_req));
      m->last_send = now;
    }
  }
  if (m->rank == 0 && m->fn && now - m->last_show >= m->interval) {
    m->fn(m->ctx, summed(m), m->total, 0);
    m->last_show = now;
  }
  *stop = m->stop;
done:
  return st;
}

kqsvd_status_t kqsvd_monitor_raise(kqsvd_monitor_t *m) {
  kqsvd_status_t st = KQSVD_OK;
  if (m->raised) return KQSVD_OK;
  m->raised = 1;
  for (int q = 0; q < m->size; q++)
    if (q != m->rank)
      KQSVD_MPI(
          MPI_Isend(&m->cancel_token, 1, MPI_INT64_T, q, TAG_CANCEL, m->comm, &m->cancel_reqs[q]));
done:
  return st;
}

kqsvd_status_t kqsvd_monitor_finish(kqsvd_monitor_t *m, int64_t local_done, kqsvd_status_t local) {
  kqsvd_status_t st = KQSVD_OK;
  int *raised = NULL;
  m->counts[m->rank] = local_done;
  if (m->rank != 0) {
    /* Everything a rank sent to 0 precedes its FIN (MPI keeps the order of
     * messages between a pair of ranks), so rank 0 can drain up to it. */
    KQSVD_MPI(MPI_Wait(&m->send_req, MPI_STATUS_IGNORE));
    KQSVD_MPI(MPI_Send(&local_done, 1, MPI_INT64_T, 0, TAG_FIN, m->comm));
  } else {
    for (int q = 1; q < m->size; q++)
      for (;;) {
        MPI_Status probe;
        KQSVD_MPI(MPI_Probe(q, MPI_ANY_TAG, m->comm, &probe));
        KQSVD_CALL(handle(m, &probe));
        if (probe.MPI_TAG == TAG_FIN) break;
      }
  }
  /* Receive the cancel notices still in flight, then complete our own. */
  KQSVD_MALLOC(raised, m->size, "cancel flags");
  KQSVD_MPI(MPI_Allgather(&m->raised, 1, MPI_INT, raised, 1, MPI_INT, m->comm));
  for (int q = 0; q < m->size; q++)
    if (q != m->rank && raised[q] && !m->cancel_seen[q]) {
      int64_t token;
      KQSVD_MPI(MPI_Recv(&token, 1, MPI_INT64_T, q, TAG_CANCEL, m->comm, MPI_STATUS_IGNORE));
      m->cancel_seen[q] = 1;
    }
  KQSVD_MPI(MPI_Waitall(m->size, m->cancel_reqs, MPI_STATUSES_IGNORE));
  st = kqsvd_mpi_agree(m->comm, local);
  /* The closing line only for a run that completed. */
  if (st == KQSVD_OK && m->rank == 0 && m->fn) m->fn(m->ctx, summed(m), m->total, 1);
done:
  free(raised);
  return st;
}

void kqsvd_monitor_free(kqsvd_monitor_t **m) {
  if (!m || !*m) return;
  if ((*m)->comm != MPI_COMM_NULL) MPI_Comm_free(&(*m)->comm);
  free((*m)->counts);
  free((*m)->cancel_seen);
  free((*m)->cancel_reqs);
  free(*m);
  *m = NULL;
}
