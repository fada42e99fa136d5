#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv on first use, then
#   ./cwm.sh run   [cwm tune options]   tune the default workload with the shipped world model
#   ./cwm.sh test  [pytest options]     run the test suite (slow benchmarks skipped)
#   ./cwm.sh cwm   ARGS...              any other cwm command
set -euo pipefail
cd "$(dirname "$0")"
VENV=.venv
STAMP="$VENV/.installed-$(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -f "$STAMP" ]; then
    python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q -e ".[test]"
    rm -f "$VENV"/.installed-*
    touch "$STAMP"
fi
cmd="${1:-run}"; shift || true
case "$cmd" in
    run)  exec "$VENV/bin/cwm" tune "$@" ;;
    test) exec "$VENV/bin/python" -m pytest "$@" ;;
    cwm)  exec "$VENV/bin/cwm" "$@" ;;
    *) echo "usage: ./cwm.sh run|test|cwm ..." >&2; exit 2 ;;
esac
