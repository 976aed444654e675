"""The bootstrap on a fresh machine.

apt_lock: scripts/apt-install.sh (which scripts/bootstrap.sh, hence
./demo.sh and ./test.sh, and .ci/run install through) waits for another
package manager holding apt's locks, as unattended upgrades do on a new
cloud machine: one line saying so, then the install goes on once they
are free; past KQSVD_APT_LOCK_WAIT it fails with apt's message.  A child
process holds the locks as apt does (fcntl locks on dpkg's lock files and
the lists lock).  Needs root and apt-get; reinstalls nothing (the package
asked for is installed already)."""
import os
import shutil
import subprocess
import sys
import time

from harness import check, finish

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "apt-install.sh")
DPKG = ("/var/lib/dpkg/lock-frontend", "/var/lib/dpkg/lock")
LISTS = ("/var/lib/apt/lists/lock",)
HOLD = """
import fcntl, os, sys, time
fds = [os.open(p, os.O_RDWR | os.O_CREAT, 0o640) for p in sys.argv[2:]]
for fd in fds:
    fcntl.lockf(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(float(sys.argv[1]))
"""


def held(seconds, paths):
    """A child holding the locks at paths for `seconds`, once it says so."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(seconds), *paths],
                         stdout=subprocess.PIPE, text=True)
    check(p.stdout.readline().strip() == "held", "the lock holder did not start")
    return p


def install(*args, wait=None):
    env = dict(os.environ)
    if wait is not None:
        env["KQSVD_APT_LOCK_WAIT"] = str(wait)
    t0 = time.time()
    p = subprocess.run([SCRIPT, *args], capture_output=True, text=True, env=env, timeout=600)
    return p, time.time() - t0


def apt_lock():
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        print("SKIPPED: needs root and apt-get (it takes apt's locks)")
        raise SystemExit(77)
    # Someone else's lock: waited for, said once, then the install goes on.
    for label, paths, args in (("dpkg's locks", DPKG, ["--no-update"]),
                               ("the lists lock", LISTS + DPKG, [])):
        holder = held(6, paths)
        p, took = install(*args, "hostname")
        holder.wait()
        lines = p.stderr.strip().splitlines()
        check(p.returncode == 0, f"{label}: exit {p.returncode}: {p.stderr[-600:]}")
        check(took >= 4, f"{label}: ended after {took:.1f} s while the lock was held")
        # apt names the holder of the lists lock, not of dpkg's frontend lock
        named = f"held by process {holder.pid}" if paths[0] in LISTS else ""
        check(any("holds apt's lock" in x and "waiting for it, up to 600 s" in x and named in x
                  for x in lines), f"{label}: no line saying it waits: {p.stderr[-600:]}")
        check(sum("holds apt's lock" in x for x in lines) == 1, f"{label}: said more than once")
        print(f"apt_lock: {label} held 6 s: waited {took:.1f} s, exit 0", flush=True)
    # Within a bound: past it, apt's own message and a failure.
    holder = held(20, LISTS)
    p, took = install("hostname", wait=2)
    holder.kill()
    holder.wait()
    check(p.returncode != 0 and "Could not get lock" in p.stderr and took < 15,
          f"bounded wait: exit {p.returncode} after {took:.1f} s: {p.stderr[-600:]}")
    p, _ = install("hostname", wait="soon")
    check(p.returncode == 2 and "KQSVD_APT_LOCK_WAIT" in p.stderr, f"bad bound: {p.stderr}")
    finish("apt_lock")
