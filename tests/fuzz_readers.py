#!/usr/bin/env python3
"""Fuzzes kqsvd's readers with mutated inputs: every mutant must be refused
with one clear error naming the mutated file, or accepted, without a crash,
a hang, a sanitizer report or a file left behind.

    tests/fuzz_readers.py [--kqsvd build-asan/kqsvd] [--seed 1] [--count 240]
                          [--jobs N] [--timeout 20] [--only ID[,ID...]] [--kind PREFIX]
                          [--list] [--keep] [--no-leaks] [--work DIR]

It makes a tiny valid set with `kqsvd synth` (model file + 2 shards), its
projections (`calibrate`), checkpoints of a killed calibrate on 1 and 2
ranks and a manifest, then runs each mutant through the reader it targets:

  shard0, model  kqsvd calibrate --model M --out OUT S0 S1
  shard1, proj   kqsvd evaluate --model M --proj P --json OUT/report.json S0 S1
  ck1, ck2       kqsvd calibrate ... --checkpoint DIR (resume from the mutated checkpoint)
  manifest       kqsvd manifest MAN --lists DIR, or kqsvd calibrate --manifest MAN

Mutants: `b*` random byte edits of the HDF5 files (bit flips, overwrites
with boundary values, truncation, insertion, deletion, block copies),
three quarters of them aimed at metadata (the bytes outside the datasets'
raw data: superblock, object headers, attribute heaps, B-trees); `t*`
random edits of the manifest text (--count of both together); `s:*`
structured mutants written with h5py (types, shapes, missing objects, odd
attributes, NaN/Inf, seq_lens overflow, filters, virtual, external and
linked datasets, special files) and `m:*` mangled manifests (always all
of them, about 250).  Every recipe follows from --seed and its ID alone:
`--only ID --keep` reproduces one and keeps its folder (work/m/ID), where
`cmd` holds the command line and `stderr` what it printed.

Verdicts.  PASS: exit 0 with the output in place (for checkpoints, equal to
an uninterrupted run's on as many ranks; for mutants that stay valid,
equal to the reference), or exit 1/2 with a `kqsvd CMD: error: ...` line
naming the mutated file and nothing left next to OUT.  FAIL: a signal,
another exit code (MPI_Abort; a sanitizer's exit, exitcode=86), a sanitizer
report (written under the mutant's folder by log_path, so every rank and
forked child is seen), a timeout, a leftover `*.tmp*` or partial output,
files left next to the shared inputs, an error that does not name the
file, an invalid mutant accepted, a valid one refused or giving another
result, a resumed checkpoint giving another result.  Not failures, listed
apart: a metadata edit accepted with a different result (HDF5's version-0
metadata has no checksums, so a flipped attribute value makes a valid,
different file), and a sanitizer report inside libhdf5 in the child
process that kqsvd forks to read a file's headers (io/isolate.c), when
kqsvd itself ends with a clean error.

`--check-logs DIR` only checks a folder of sanitizer logs the same way
(tests/sanitize.sh uses it for the ctest part).

Prints "N passed, M failed" and exits 1 when any failed, with each failure's
kind, recipe and reproducer, grouped by kind.

The parts are in tests/fuzz/ (its __init__.py says which module holds what);
this script parses the options, runs the mutants and prints the summary."""
import argparse
import collections
import concurrent.futures
import json
import os
import sys
import time

# The parts live in the package tests/fuzz/, next to this script, whatever
# the current directory.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fuzz.mutant import run_one  # noqa: E402
from fuzz.recipes import describe, recipes  # noqa: E402
from fuzz.runner import ROOT, SAN_DEFAULTS, Ctx  # noqa: E402
from fuzz.valid_set import setup  # noqa: E402
from fuzz.verdict import check_logs, group_of, tree  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_bin = os.environ.get("KQSVD") or next(
        (p for p in (os.path.join(ROOT, "build-asan", "kqsvd"), os.path.join(ROOT, "build", "kqsvd"))
         if os.path.exists(p)), "kqsvd")
    ap.add_argument("--kqsvd", default=default_bin, help="the kqsvd executable [%(default)s]")
    ap.add_argument("--mpiexec", default=os.environ.get("KQSVD_MPIEXEC", "mpirun"))
    ap.add_argument("--work", default=None, help="work folder [next to the executable: fuzz/]")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--count", type=int, default=240,
                    help="random byte mutants (HDF5 and manifest text), on top of the "
                         "structured ones [%(default)s]")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds per run [%(default)s]")
    ap.add_argument("--only", default=None, help="comma-separated mutant IDs")
    ap.add_argument("--kind", default=None, help="only IDs starting with this prefix (b, t, s:, m:)")
    ap.add_argument("--list", action="store_true", help="print the recipes and exit")
    ap.add_argument("--keep", action="store_true", help="keep every mutant's folder")
    ap.add_argument("--no-leaks", action="store_true", help="ASAN_OPTIONS detect_leaks=0 (faster)")
    ap.add_argument("--check-logs", metavar="DIR",
                    help="only check the sanitizer logs in DIR (tests/sanitize.sh): print each "
                         "report, except those contained in kqsvd's header-check child, and "
                         "exit 1 if there are any")
    a = ap.parse_args()
    if a.check_logs:
        return check_logs(a.check_logs)
    if a.work is None:
        a.work = os.path.join(os.path.dirname(os.path.abspath(a.kqsvd)), "fuzz")
    if a.no_leaks:
        SAN_DEFAULTS["ASAN_OPTIONS"] = SAN_DEFAULTS["ASAN_OPTIONS"].replace("detect_leaks=1",
                                                                            "detect_leaks=0")
    ctx = Ctx(a)
    os.makedirs(ctx.work, exist_ok=True)
    t0 = time.time()
    info = setup(ctx)
    t_setup = time.time() - t0
    todo = recipes(ctx, info, a.count)
    if a.only:
        want = set(a.only.split(","))
        todo = [r for r in todo if r["id"] in want]
        if len(todo) != len(want):
            sys.exit(f"fuzz_readers: unknown IDs: {sorted(want - {r['id'] for r in todo})}")
    if a.kind:
        todo = [r for r in todo if r["id"].startswith(a.kind)]
    if a.list:
        for r in todo:
            print(describe(r))
        return 0
    before = set(tree(ctx.base))
    print(f"fuzz_readers: {len(todo)} mutants of {a.kqsvd} (seed {a.seed}, {a.jobs} at a time, "
          f"setup {t_setup:.1f} s)", flush=True)
    results = []
    with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
        futs = [pool.submit(run_one, ctx, info, r) for r in todo]
        for i, fu in enumerate(concurrent.futures.as_completed(futs)):
            r, fails, warns, secs, cmd = fu.result()
            results.append((r, fails, warns, secs, cmd))
            if fails:
                print(f"FAIL {describe(r)}\n     {'; '.join(fails)}", flush=True)
            if (i + 1) % 50 == 0:
                print(f"  ... {i + 1}/{len(todo)} done, {time.time() - t0:.0f} s", flush=True)
    # Runs read the shared set in place: nothing may appear next to it.
    extra = sorted(set(tree(ctx.base)) - before)
    if extra:
        results.append(({"id": "base", "kind": "base", "target": "set", "runner": "all",
                          "np": 1, "expect": "any"},
                         [f"left behind next to the shared inputs: {', '.join(extra[:3])}"], [],
                         0.0, ""))
    failed = [x for x in results if x[1]]
    warned = [x for x in results if x[2] and not x[1]]
    groups = collections.defaultdict(list)
    for r, fails, *_ in failed:
        for f in fails:
            groups[group_of(f)].append(r["id"])
    summary = {"seed": a.seed, "kqsvd": a.kqsvd, "mutants": len(results), "failed": len(failed),
               "seconds": round(time.time() - t0, 1),
               "groups": {k: v for k, v in sorted(groups.items(), key=lambda kv: -len(kv[1]))},
               "warnings": {r["id"]: w for r, _f, w, *_ in warned},
               "failures": [{"id": r["id"], "recipe": describe(r), "why": fails, "cmd": cmd}
                            for r, fails, _w, _s, cmd in sorted(failed, key=lambda x: x[0]["id"])]}
    with open(os.path.join(ctx.work, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    if groups:
        print("\nfailures by kind:")
        for k, ids in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            print(f"  {len(ids):4d}  {k}: {' '.join(sorted(ids)[:8])}{' ...' if len(ids) > 8 else ''}")
        print(f"reproduce one: {sys.argv[0]} --kqsvd {a.kqsvd} --seed {a.seed} --only ID --keep "
              f"(its folder: {ctx.work}/m/ID, with cmd and stderr)")
    if warned:
        wgroups = collections.defaultdict(list)
        for r, _f, warns, *_ in warned:
            for w in warns:
                wgroups[w].append(r["id"])
        print("\nnot failures (metadata edits that HDF5 cannot detect; crashes inside libhdf5 "
              "that kqsvd's header check caught in its child process):")
        for k, ids in sorted(wgroups.items(), key=lambda kv: -len(kv[1])):
            print(f"  {len(ids):4d}  {k}: {' '.join(sorted(ids)[:8])}{' ...' if len(ids) > 8 else ''}")
    slow = max(results, key=lambda x: x[3]) if results else None
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed "
          f"({time.time() - t0:.0f} s; slowest {slow[0]['id']} {slow[3]:.1f} s)" if slow else
          "0 passed, 0 failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
