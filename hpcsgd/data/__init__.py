"""Reading HDF5 feature archives and feeding minibatches to the trainer."""
