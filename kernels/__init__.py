"""mmwire.kernels: CuPy raw CUDA kernels for the owner's GPU pixel pipeline."""

__all__: list[str] = []
