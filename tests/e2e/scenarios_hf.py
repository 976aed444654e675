"""Real models: the Hugging Face exporter's self-consistency (run with the
exporter's environment, .venv), and all-MiniLM-L6-v2 end to end: export,
calibrate, evaluate, against the brute-force reference."""
import json
import os
import subprocess

from eval_reference import METHODS, compare, evaluate as ref_evaluate, report_ranks
from harness import calibrate, check, finish, run, workdir

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
VENV_PY = os.path.join(ROOT, ".venv", "bin", "python3")
EXPORT = os.path.join(ROOT, "examples", "export_hf.py")
TEXT = os.path.join(ROOT, "examples", "data", "us-founding-documents.txt")


def need_venv(name):
    if not os.path.exists(VENV_PY):
        print(f"{name}: SKIPPED, no {VENV_PY}; scripts/hf-env.sh prepares it (./test.sh runs it)")
        raise SystemExit(77)


def venv_script(name, script):
    """Runs tests/e2e/SCRIPT WORKDIR with .venv's Python; returns WORKDIR."""
    need_venv(name)
    wd = workdir(name)
    p = subprocess.run([VENV_PY, os.path.join(HERE, script), wd], capture_output=True, text=True,
                       timeout=550)
    print(p.stdout)
    check(p.returncode == 0, f"{script} failed:\n{p.stdout}\n{p.stderr[-3000:]}")
    return wd


def hf_export():
    """Exported Q, K, V, W^O reproduce each attention module's output, for
    every family; each tiny family's caches calibrate and evaluate."""
    wd = venv_script("hf_export", "hf_consistency.py")
    # Every family's tiny export goes on through calibrate (2 ranks) and
    # evaluate (3 ranks), against the brute-force reference.
    for kind in ("llama", "mistral", "qwen2", "mixtral", "phi3", "gemma", "starcoder2"):
        out = os.path.join(wd, f"tiny-{kind}-out")
        if not os.path.isdir(out):
            continue  # hf_consistency.py failed before it, and said so
        model = os.path.join(out, "model.h5")
        shards = sorted(os.path.join(out, f) for f in os.listdir(out) if f.startswith("shard-"))
        proj, rj = os.path.join(wd, f"{kind}-proj.h5"), os.path.join(wd, f"{kind}-report.json")
        calibrate(model, proj, shards, np_=2)
        run(["evaluate", "--progress", "off", "--model", model, "--proj", proj, "--json", rj]
            + shards, np_=3)
        rep = json.load(open(rj))
        worst, where = compare(rep, ref_evaluate(model, proj, shards, report_ranks(rep)))
        check(worst <= 1e-9, f"{kind}: report vs reference: {worst:.2e} at {where}")
        print(f"tiny {kind}: calibrated and evaluated, reference deviation {worst:.1e}")
    finish("hf_export")


def hf_export_runs():
    """A crash mid-export resumes to the same shards; batches, device maps,
    BOS and weight types (tests/e2e/hf_export_runs.py)."""
    venv_script("hf_export_runs", "hf_export_runs.py")
    finish("hf_export_runs")


def hf_minilm():
    """all-MiniLM-L6-v2 on the bundled text, disjoint splits: the tool agrees
    with the reference, and KQ-SVD is best on what attention uses."""
    need_venv("hf_minilm")
    wd = workdir("hf_minilm")
    sets = {}
    for split, n in (("train", 24), ("validation", 8)):
        out = os.path.join(wd, split)
        p = subprocess.run([EXPORT, "--model", "sentence-transformers/all-MiniLM-L6-v2", "--text",
                            TEXT, "--seq-len", "128", "--num-seqs", str(n), "--split", split,
                            "--shard-seqs", "8", "--out", out], capture_output=True, text=True)
        check(p.returncode == 0, f"export {split}: {p.stderr[-2000:]}")
        sets[split] = (os.path.join(out, "model.h5"),
                       sorted(os.path.join(out, f) for f in os.listdir(out) if f.startswith("shard-")))
    model, cal = sets["train"]
    proj = os.path.join(wd, "proj.h5")
    calibrate(model, proj, cal, np_=2)
    rj = os.path.join(wd, "report.json")
    run(["evaluate", "--progress", "off", "--model", sets["validation"][0], "--proj", proj,
         "--json", rj] + sets["validation"][1], np_=3)
    rep = json.load(open(rj))
    ref = ref_evaluate(sets["validation"][0], proj, sets["validation"][1], report_ranks(rep))
    worst, where = compare(rep, ref)
    check(worst <= 1e-9, f"report vs reference: {worst:.2e} at {where}")
    mean = {m: rep["methods"][m]["mean"] for m in METHODS}
    for k in ("err_kq", "err_out"):
        check(mean["kqsvd"][k] <= min(mean["ksvd"][k], mean["eigen"][k]),
              f"{k}: kqsvd {mean['kqsvd'][k]:.3e}, ksvd {mean['ksvd'][k]:.3e}, eigen {mean['eigen'][k]:.3e}")
    print("mean err_kq / err_out:", {m: (round(mean[m]["err_kq"], 5), round(mean[m]["err_out"], 5))
                                     for m in METHODS}, f"reference deviation {worst:.1e}")
    finish("hf_minilm")
