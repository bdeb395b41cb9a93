"""batchspec: offline batch generation with output-equivalent batched speculative decoding."""

from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("batchspec")  # the installed distribution's version (pyproject.toml)
except PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0.1.0+unknown"
