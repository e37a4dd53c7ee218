# The two commands of the README:
#   make demo   runs the generation demo (CPU by default, GPU when there is one)
#   make test   runs the unit tests (CPU, kernels through Triton's interpreter)
# Both create .venv and install everything they need on first use.

VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: venv test test-gpu demo bench clean

venv: $(VENV)/.installed

# --system-site-packages lets a machine that already has torch (e.g. a CUDA build) keep it;
# elsewhere torch's 2.13.0 CPU wheel is installed first so nothing pulls CUDA packages.
$(VENV)/.installed: setup.py
	python3 -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[test]"
	touch $@

test: venv
	TRITON_INTERPRET=1 $(PY) -m pytest tests/unit -q -n 2 -p no:cacheprovider

test-gpu: venv
	$(PY) -m pytest tests/functional -q -p no:cacheprovider

demo: venv
	$(PY) examples/generate.py --checkpoint examples/checkpoints/mtp_demo.pt

clean:
	rm -rf $(VENV) *.egg-info
