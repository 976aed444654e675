#!/usr/bin/env bash
# The linters, as ctest's lint_python and lint_c run them:
#   tests/lint.sh python   ruff (ruff.toml) over every Python file
#   tests/lint.sh c        clang-format 14 (.clang-format) over C and CUDA
# 77 (skipped) where the tool is missing; ./test.sh installs both (ruff
# into .venv, examples/requirements-hf.txt; Debian's clang-format).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
case ${1:-} in
  python)
    ruff=${KQSVD_RUFF:-$root/.venv/bin/ruff}
    [ -x "$ruff" ] || { echo "lint: no ruff at $ruff (scripts/hf-env.sh installs it)"; exit 77; }
    exec "$ruff" check --no-cache . ;;
  c)
    command -v clang-format >/dev/null || { echo "lint: no clang-format"; exit 77; }
    # Other versions lay some lines out otherwise: the layout is 14's.
    v=$(clang-format --version | sed -n 's/.*version \([0-9]*\).*/\1/p')
    [ "$v" = 14 ] || { echo "lint: clang-format $v, not 14 (Debian 12's), cannot check the layout"; exit 77; }
    if git rev-parse --git-dir >/dev/null 2>&1; then
      files=$(git ls-files '*.c' '*.h' '*.cu')
    else
      files=$(find bench cmake examples gpu include io mpi src tests \( -name '*.c' -o -name '*.h' -o -name '*.cu' \))
    fi
    # shellcheck disable=SC2086 # one word per file
    clang-format --dry-run --Werror $files && echo "lint: $(echo "$files" | wc -l) files laid out as .clang-format says" ;;
  *) sed -n '2,6p' "$0" >&2; exit 2 ;;
esac
