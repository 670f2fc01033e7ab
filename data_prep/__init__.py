"""Offline feature preparation: Kaldi-style data directory + alignments -> sharded HDF5 archive."""
