"""batchspec: offline batch generation with output-equivalent batched speculative decoding."""

__version__ = "0.1.0"
