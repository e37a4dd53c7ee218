from setuptools import find_packages, setup

setup(
    name="mtp_ctrl",
    version="0.1.0",
    description="Lossless MTP speculative decoding for megatron-core models, with Triton step kernels.",
    packages=find_packages(include=["mtp_ctrl", "mtp_ctrl.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.6", "triton>=3.3", "megatron-core>=0.16,<0.17", "tqdm>=4.60", "safetensors>=0.4"],
    extras_require={"test": ["pytest>=8", "pytest-xdist>=3", "hypothesis>=6"]},
)
