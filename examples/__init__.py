"""Workflow examples: ``sft.py``, the training workflow on a kernelized model (``kernels-neuron examples sft``)."""
