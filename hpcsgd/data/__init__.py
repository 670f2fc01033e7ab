"""Reading HDF5 feature archives and feeding minibatches to the trainer."""

BLOCK_FRAMES = 8192        # unit dealt to ranks: ~80 s of speech at 10 ms
BUFFER_FRAMES = 1 << 18    # frames shuffled together in RAM: 262k x 40 x 4 B = 42 MB
