"""hpct: rootless, TCPStore-less and abortable collective start-up for PyTorch."""

__version__ = "0.1.0"
