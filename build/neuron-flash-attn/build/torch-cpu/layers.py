"""The ``layers`` module of the neuron-flash-attn Hub repo.

The kernels library loads a repo's ``layers`` for ``kernelize``; attention needs no layer class:
transformers does not tag its attention classes, and models reach the kernel through their
attention function instead (``attn_implementation="kernels-neuron/neuron-flash-attn"``, or
``kernels_neuron.kernelize``, which registers ``flash_attn_forward`` with transformers'
``AttentionInterface`` and ``AttentionMaskInterface``).
"""

__all__: list[str] = []
