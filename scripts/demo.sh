#!/usr/bin/env bash
# The main job: sets up .venv, then runs the end-to-end demo (offline). Extra arguments go to the demo.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
exec python -m ignite_ext demo "$@"
