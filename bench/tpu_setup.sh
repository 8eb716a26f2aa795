# Set-up for the TPU machine (sourced, not piped: `source bench/tpu_setup.sh`), run from the repo root.
# Installs torch 2.13.0 (CPU build) and what shardtensor needs from the machine's own package index
# into /tmp/site (transformers into /tmp/site_hf, for bench/tpu.py --llama), then puts them and the
# repository at the END of PYTHONPATH, so that the machine's own JAX stays first. Idempotent.
PIP="env PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --index-url file:///opt/pypi/simple"
[ -d /tmp/site/torch ] || $PIP --target /tmp/site torch==2.13.0 rich tqdm flatbuffers ninja --find-links /opt/wheels
if [ -n "$TPU_SETUP_HF" ] && [ ! -d /tmp/site_hf/transformers ]; then
    # the project's pin (pyproject.toml): st.generate's device loop follows transformers' decoding code
    $PIP --target /tmp/site_hf transformers==5.24.0 || $PIP --target /tmp/site_hf transformers
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site:/tmp/site_hf:$PWD"
export PATH="/tmp/site/bin:$PATH"   # ninja, for the device guard extension built on first import
export SHARDTENSOR_PLATFORM=tpu
python3 -c "import torch, jax; print('torch', torch.__version__, 'jax', jax.__version__)"
