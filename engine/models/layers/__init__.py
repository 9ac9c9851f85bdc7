"""The model's layers over a flat token batch: attention (paged, through prefixflow.kernels),
embedding and LM head, linear (oneDNN-prepacked on the CPU), MLP, norm, rotary."""
