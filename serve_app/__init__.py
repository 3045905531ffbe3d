"""serve_app: Hugging Face models served over HTTP on Ray Serve, batched, cached and scaled."""

__version__ = "0.1.0"
