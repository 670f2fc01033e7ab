"""hpcsgd: data-parallel training of speech acoustic models with compressed gradients."""

__version__ = "0.1.0"
