# The two commands of the README:
#   make demo   runs the generation demo (CPU by default, GPU when there is one)
#   make test   runs the unit tests (CPU, kernels through Triton's interpreter)
# Both create .venv and install everything they need on first use.

VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_FLAGS := -q -p no:cacheprovider -p no:benchmark

.PHONY: venv test test-gpu demo bench clean

venv: $(VENV)/.installed

# --system-site-packages lets a machine that already has torch (e.g. a CUDA build) keep it;
# elsewhere torch 2.13.0 is installed first (from PyTorch's CPU index when there is no GPU, so
# nothing pulls CUDA packages). pytest plugins installed system-wide come along with
# --system-site-packages: the test targets switch off the ones that print warnings of their own.
$(VENV)/.installed: setup.py
	python3 -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || { \
	  if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install torch==2.13.0; \
	  else $(PY) -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu; fi; }
	$(PY) -m pip install -e ".[test]"
	touch $@

test: venv
	TRITON_INTERPRET=1 $(PY) -m pytest tests/unit -n 2 $(PYTEST_FLAGS)

test-gpu: venv
	$(PY) -m pytest tests/functional $(PYTEST_FLAGS)

demo: venv
	$(PY) examples/generate.py --checkpoint mtp_ctrl/checkpoints/mtp_demo.pt

clean:
	rm -rf $(VENV) *.egg-info
