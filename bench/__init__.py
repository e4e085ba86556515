"""mmwire.bench: the benchmark harness (``mmwire-bench``)."""

__all__: list[str] = []
