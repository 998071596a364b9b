#!/usr/bin/env bash
# Run one of the Python steps Make runs on every call (the rehearsal's wait at its parse, assets,
# stamp: draftline/cli/status.py) only when something it read changed since its last
# success, so that a no-op `make` starts no Python at all.
#
#   bash draftline/cli/when_changed.sh [--answer] STATE COMMAND...
#
# What a step reads: its command line (the experiment, the overrides), conf/, the project's
# code, and the files it named in STATE-inputs when it last ran (the installed packages'
# directory and both patch records, which move when `make setup` re-syncs or re-applies; the
# input files its config names; its stamps). Their sizes and mtimes after a success are kept
# in STATE-stats; the same listing now means the step would write and answer the same.
# The command is echoed when it runs, as Make echoes a recipe line, except with --answer: then
# its stdout is its answer (the gate's, read by Make's parse), kept in STATE-answer and
# printed again when the step is skipped.
set -euo pipefail

answer=
if [ "$1" = --answer ]; then answer=1; shift; fi
state=$1
shift

listing() {
  printf '%s\n' "$@"
  find conf draftline stages \( -name '*.py' -o -name '*.yaml' \) -printf '%p %s %T@\n'
  # A file that is missing now is left out: its coming back changes the listing.
  if [ -f "$state-inputs" ]; then
    xargs -r -d '\n' -a "$state-inputs" stat -c '%n %s %y' 2>/dev/null || true
  fi
}

# Written whole (readable by all, as the stages' files), then renamed: the hosts of a
# multi-host extraction share the run dir.
write() {
  local tmp
  tmp=$(mktemp "$1.XXXXXX")
  cat > "$tmp"
  chmod 644 "$tmp"
  mv "$tmp" "$1"
}

if [ -f "$state-stats" ] && listing "$@" | cmp -s - "$state-stats"; then
  if [ -n "$answer" ]; then cat "$state-answer"; fi
  exit 0
fi
rm -f "$state-stats"  # a step that fails is run again next time, whatever changed
if [ -n "$answer" ]; then
  # A refusal is the answer's one line too (exit 2, draftline.cli.status main): pass it on.
  out=$("$@") || { code=$?; printf '%s\n' "$out"; exit "$code"; }
  mkdir -p "$(dirname "$state")"
  printf '%s\n' "$out" | write "$state-answer"
else
  printf '%s\n' "$*"
  "$@"
  mkdir -p "$(dirname "$state")"
fi
listing "$@" | write "$state-stats"
if [ -n "$answer" ]; then cat "$state-answer"; fi
