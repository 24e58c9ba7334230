"""The from-scratch implementations, one idea per file, each proven equal to its PyTorch twin."""
