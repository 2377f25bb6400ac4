"""Wire formats: codecs, their kernels and the coded exchange over any point-to-point transport."""
