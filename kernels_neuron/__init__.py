"""kernels-neuron: NKI kernels for AWS Trainium in the Hugging Face Kernels Hub format.

Subpackages: ``sim`` (the CPU NKI simulator).
"""

__version__ = "0.1.0"
