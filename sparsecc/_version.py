"""sparsecc's version, in a module of its own so that every layer can name it."""
__version__ = "0.1.0"
