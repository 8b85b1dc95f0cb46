# Sourced by the scripts whose steps go into one table of seconds (scripts/test.sh prints it):
# `step NAME COMMAND...` runs COMMAND and, when PARATRAIN_TIMINGS names a file, appends "NAME
# SECONDS" to it, failed or not.
step() {
  local name="$1" t0 rc=0
  shift
  t0=$(date +%s)
  "$@" || rc=$?
  if [ "$rc" -ne 0 ]; then name="$name (failed)"; fi
  if [ -n "${PARATRAIN_TIMINGS:-}" ]; then
    echo "$name $(($(date +%s) - t0))" >>"$PARATRAIN_TIMINGS"
  fi
  return "$rc"
}
