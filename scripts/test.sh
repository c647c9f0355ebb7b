#!/usr/bin/env bash
# The test command (README "Two commands"; .ci/run calls it): set up .venv if needed, then run pytest.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k roundtrip -x`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest -q -ra "$@"
