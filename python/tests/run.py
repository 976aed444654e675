"""Runs one test module of the package under ctest: exit 0 when every test
passed, 1 on a failure, 77 (ctest's SKIP_RETURN_CODE) when any test was
skipped or the environment lacks torch and transformers, so a skip is never
reported as a pass.

    .venv/bin/python python/tests/run.py test_attention"""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    # transformers 5 draws a bar for every model it loads: noise in a test log
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # ctest starts this with the Python that has numpy and h5py; the model
    # stack lives in the repository's .venv, or the venv KQSVD_VENV names
    # (.venv-floor: the oldest supported transformers; .venv-peers: the
    # frontier's peers with the transformers they take), all made by
    # scripts/hf-env.sh.
    name = os.environ.get("KQSVD_VENV", ".venv")
    venv = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", name, "bin",
                        "python3")
    if not os.path.exists(venv) and name != ".venv":
        print(f"SKIPPED: {name} is missing; scripts/hf-env.sh prepares it (./test.sh runs it)")
        return 77
    if os.path.exists(venv) and os.path.realpath(sys.prefix) != os.path.realpath(
            os.path.join(os.path.dirname(venv), "..")):
        os.execv(venv, [venv] + sys.argv)
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"SKIPPED: {e}; scripts/hf-env.sh prepares .venv (./test.sh runs it)")
        return 77
    suite = unittest.defaultTestLoader.loadTestsFromNames(sys.argv[1:])
    res = unittest.TextTestRunner(verbosity=2).run(suite)
    if not res.wasSuccessful():
        return 1
    if res.skipped:
        print(f"SKIPPED: {len(res.skipped)} of {res.testsRun} tests: " +
              "; ".join(sorted({why for _, why in res.skipped})))
        return 77
    return 0


if __name__ == "__main__":
    sys.exit(main())
