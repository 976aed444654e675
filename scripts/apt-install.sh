#!/usr/bin/env bash
# Installs Debian packages (apt-get update, then install), waiting for
# another package manager that holds apt's locks rather than failing at
# once: on a new cloud machine unattended upgrades hold them for minutes.
# It says so on one line and waits up to KQSVD_APT_LOCK_WAIT seconds
# (default 600), then fails with apt's own message.
#
#   scripts/apt-install.sh [--no-update] PACKAGE...
#
# apt-get's DPkg::Lock::Timeout alone does not do it: it covers the dpkg
# locks of an install, not the lists lock of `apt-get update`, and it waits
# without a word. So each apt-get runs with a short one (a lock held for a
# moment is ridden over) inside a loop that retries, having said so, while
# apt reports a held lock.  Used by scripts/bootstrap.sh (./demo.sh,
# ./test.sh) and .ci/run.
set -euo pipefail
update=1
if [ "${1:-}" = "--no-update" ]; then
  update=0
  shift
fi
[ $# -gt 0 ] || { echo "apt-install.sh: no package given" >&2; exit 2; }
wait_s=${KQSVD_APT_LOCK_WAIT:-600}
case $wait_s in
  '' | *[!0-9]*) echo "apt-install.sh: KQSVD_APT_LOCK_WAIT=$wait_s is not a whole number of seconds" >&2; exit 2 ;;
esac
sudo=""
[ "$(id -u)" -ne 0 ] && sudo=sudo
start=$SECONDS
said=""

# apt_get ARGS...: apt-get ARGS, again while another process holds a lock.
apt_get() {
  local err
  # LC_ALL=C: the messages below are read, and apt translates them
  while ! err=$($sudo env DEBIAN_FRONTEND=noninteractive LC_ALL=C apt-get -o DPkg::Lock::Timeout=1 \
                  "$@" 2>&1 >/dev/null); do
    if ! grep -qE "Could not get lock|Unable to acquire the dpkg frontend lock" <<<"$err" || [ $((SECONDS - start)) -ge "$wait_s" ]; then
      printf '%s\n' "$err" >&2
      return 1
    fi
    if [ -z "$said" ]; then
      holder=$(grep -o 'held by process [0-9]* ([^)]*)' <<<"$err" | head -1 || true)
      echo "apt-install.sh: another package manager holds apt's lock${holder:+ (${holder})};" \
           "waiting for it, up to ${wait_s} s (KQSVD_APT_LOCK_WAIT)" >&2
      said=1
    fi
    sleep 2
  done
}

[ "$update" = 0 ] || apt_get update -qq
apt_get install -y -qq --no-install-recommends "$@"
[ -z "$said" ] || echo "apt-install.sh: the lock was free after $((SECONDS - start)) s" >&2
