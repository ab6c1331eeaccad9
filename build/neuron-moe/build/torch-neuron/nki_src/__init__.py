"""NKI kernel sources, as in the kernels-neuron nki_src/ folder."""
