"""mtp_ctrl: lossless MTP speculative decoding for megatron-core models.

Layers (imports point down only): ``controllers`` -> ``models`` -> ``state`` -> ``triton_ops``.
Nothing heavy happens at import time; submodules load when first used.
"""

__version__ = "0.1.0"
