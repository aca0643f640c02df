"""moelora: serve many LoRA adapters of one Mixture-of-Experts model at once, with Triton kernels."""
