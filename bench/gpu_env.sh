# Sourced by the bench/run_*_gpu.sh scripts: cd to the repository root, logs to $OUT (or ./gpu_logs),
# megatron-core from the carried wheels in .whl/ when there are any, this checkout on PYTHONPATH,
# kernels compiled (not interpreted).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-gpu_logs}"; mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
