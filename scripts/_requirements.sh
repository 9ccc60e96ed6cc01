# Sourced by the scripts that build environments from setup.py's requirements.
# own_requirements VAR [ARGS...]: fills the array VAR with scripts/requirements.py's lines (ARGS passed on), one
# whole requirement an element: a requirement with an environment marker holds spaces and must reach pip as one
# argument.
own_requirements() {
  local -n _into="$1"
  shift
  local _lines
  _lines="$(python3 "$(dirname "${BASH_SOURCE[0]}")/requirements.py" "$@")"
  mapfile -t _into <<<"$_lines"
}
