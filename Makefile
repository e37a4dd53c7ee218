# The two commands of the README:
#   make demo   runs the generation demo (CPU by default, GPU when there is one)
#   make test   runs the unit tests (CPU, kernels through Triton's interpreter)
# Both create .venv and install everything they need on first use.
# make check-install: `pip install .` into a fresh virtual environment, used from another directory (CI).

VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_FLAGS := -q -p no:cacheprovider -p no:benchmark
TORCH_VERSION := 2.13.0
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
INSTALL_CHECK_VENV ?= /tmp/mtp_ctrl_install_check

.PHONY: venv test test-gpu demo check-install clean

# torch into the environment of the Python $(1), unless it has one: the default (CUDA) build on a
# machine with an NVIDIA driver; elsewhere the CPU build from PyTorch's CPU index. That index is
# asked once with a short timeout; where it cannot be reached the default index's build is taken
# (on Linux it bundles CUDA libraries: several GB, but it runs on a CPU too).
define install_torch
	$(1) -c "import torch" 2>/dev/null || { \
	  if command -v nvidia-smi >/dev/null 2>&1; then $(1) -m pip install torch==$(TORCH_VERSION); \
	  else $(1) -m pip install --timeout 10 --retries 1 --index-url $(TORCH_CPU_INDEX) torch==$(TORCH_VERSION) || { \
	    echo "PyTorch's CPU index ($(TORCH_CPU_INDEX)) is unreachable: torch $(TORCH_VERSION) from the default index"; \
	    $(1) -m pip install torch==$(TORCH_VERSION); }; fi; }
endef

venv: $(VENV)/.installed

# --system-site-packages lets a machine that already has torch (e.g. a CUDA build) keep it. pytest
# plugins installed system-wide come along: the test targets switch off the ones that print
# warnings of their own.
$(VENV)/.installed: pyproject.toml
	python3 -m venv --system-site-packages $(VENV)
	$(call install_torch,$(PY))
	$(PY) -m pip install -e ".[test]"
	touch $@

test: venv
	TRITON_INTERPRET=1 $(PY) -m pytest tests/unit -n 2 --dist worksteal $(PYTEST_FLAGS)

test-gpu: venv
	$(PY) -m pytest tests/functional $(PYTEST_FLAGS)

demo: venv
	$(PY) examples/generate.py

# A user's install: no editable link, no repository on sys.path, the checkpoint from package data.
check-install:
	rm -rf $(INSTALL_CHECK_VENV)
	python3 -m venv $(INSTALL_CHECK_VENV)
	$(call install_torch,$(INSTALL_CHECK_VENV)/bin/python)
	$(INSTALL_CHECK_VENV)/bin/python -m pip install .
	cd $(INSTALL_CHECK_VENV) && OMP_NUM_THREADS=1 bin/python -c "import mtp_ctrl; mtp_ctrl.quiet_known_warnings(); \
	mtp_ctrl.init_single_process('cpu'); model = mtp_ctrl.load_demo_model(device='cpu'); \
	assert mtp_ctrl.__file__.startswith('$(INSTALL_CHECK_VENV)'), mtp_ctrl.__file__; \
	print('load_demo_model():', type(model).__name__, sum(p.numel() for p in model.parameters()), 'parameters')"
	cd $(INSTALL_CHECK_VENV) && bin/mtp-ctrl-generate --help >/dev/null && echo "mtp-ctrl-generate --help: ok"

clean:
	rm -rf $(VENV) *.egg-info
