#!/usr/bin/env bash
# Build the separate venv that holds the peer TransferQueue (PyPI `transferqueue`, on Ray) for
# `psrl bench queue`. Kept apart from the project venv: the package installs top-level `tests`,
# `scripts`, `recipe` and `tutorial` packages into site-packages.
# `psrl bench queue` runs it on first use (into ~/.cache/psrl/peer-venv); by hand:
#   usage: benchmarks/setup_peer_venv.sh [VENV_DIR]   (default ~/.cache/psrl/peer-venv)
# then, for another dir: PSRL_PEER_PYTHON=VENV_DIR/bin/python psrl bench queue --json
set -euo pipefail
VENV="${1:-$HOME/.cache/psrl/peer-venv}"
PY="${PYTHON:-python3}"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q -U pip
# CPU torch first: a bare `torch` requirement (via tensordict) would pull a CUDA build.
# (On the project's machines `torch==2.13.0` resolves to the CPU wheel; elsewhere add
# `--index-url https://download.pytorch.org/whl/cpu`.)
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q transferqueue
"$VENV/bin/python" -c "import transfer_queue, torch, ray; print('transferqueue ok', torch.__version__, ray.__version__)"
touch "$VENV/.psrl-ready"  # psrl bench queue rebuilds a venv without it (a build cut short)
