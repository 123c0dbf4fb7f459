#!/usr/bin/env bash
# Runs every test that needs the real vLLM (the `vllm` mark, which tests/vllm_support.py's
# require_vllm() sets: the plugin's tests/test_vllm_*.py and the others that use it) against
# another vLLM release than the venv's: installs it with --no-deps into a temporary folder (the
# venv keeps its vLLM 0.33.0 and the pins of tools/requirements-vllm.txt), puts that folder first
# on PYTHONPATH and runs them with QWEN4EXP_REQUIRE_VLLM=<that release>, so that a missing or
# other vLLM fails rather than skips. Any test that skips fails the check too, except those that
# need a GPU this machine lacks (reason "needs a GPU..." or "...on a machine without a GPU") and
# those of a vLLM feature this release does not have (reason "vLLM <release> has no ...").
#
#   usage: tools/check-vllm.sh REQUIREMENTS [PYTEST_ARG ...]
#          e.g. tools/check-vllm.sh tools/requirements-vllm-0.34.txt -n auto
#   PYTHON: the venv's interpreter (default $QWEN4EXP_VENV/bin/python, ./.venv unless set), with
#           the extension built (tools/run-tests.sh once).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
[ $# -ge 1 ] && [ -f "$1" ] || { echo "usage: $0 REQUIREMENTS [PYTEST_ARG ...]" >&2; exit 2; }
reqs="$1"
shift
PY="${PYTHON:-${QWEN4EXP_VENV:-$root/.venv}/bin/python}"
release="$(sed -n 's/^vllm==\([0-9][0-9.]*\).*$/\1/p' "$reqs")"
[ -n "$release" ] || { echo "$reqs: no vllm==<version> line" >&2; exit 2; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "== vLLM $release (--no-deps, from $reqs) into $work/site"
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps --target "$work/site" \
  -r "$reqs" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
export QWEN4EXP_REQUIRE_VLLM="$release"
"$PY" - "$release" <<'PY'
import sys
from importlib.metadata import version

found = version("vllm")
if found.split("+", 1)[0] != sys.argv[1]:
    sys.exit(f"check-vllm: the path's vLLM is {found}, not {sys.argv[1]}")
PY
mapfile -t files < <(grep -rl --include='test_*.py' "require_vllm" tests | sort)
"$PY" -m pytest -m vllm -p no:cacheprovider --junitxml="$work/junit.xml" "${files[@]}" "$@"
"$PY" - "$work/junit.xml" "$release" <<'PY'
import sys
import xml.etree.ElementTree as ET

allowed = ("needs a GPU", "on a machine without a GPU", f"vLLM {sys.argv[2]} has no ")
cases = list(ET.parse(sys.argv[1]).iter("testcase"))
skipped = [
    (case.get("classname", "") + "::" + case.get("name", ""), skip.get("message", ""))
    for case in cases
    for skip in case.findall("skipped")
]
bad = [(name, why) for name, why in skipped if not any(a in why for a in allowed)]
for name, why in bad:
    print(f"check-vllm: skipped on vLLM {sys.argv[2]}: {name}: {why}")
print(f"== vLLM {sys.argv[2]}: {len(cases)} tests, {len(skipped)} skipped ({len(bad)} not allowed)")
sys.exit(1 if bad or not cases else 0)
PY
