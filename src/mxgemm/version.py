"""mxgemm's version, in a module of its own: the tuning store records it, below everything that imports the package."""

__version__ = "0.1.0"
