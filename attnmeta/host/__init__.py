"""Pure host derivations: numpy in, numpy out, numba-compiled loops. Never imports torch."""
