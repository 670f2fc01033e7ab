"""The process grid: which ranks hold the same parameters, which split one model.

    grid = Grid(MPI.COMM_WORLD, model_size=1)
    grid.world   every rank of the job (stop signals, divergence checks, checkpoint manifest)
    grid.data    the D ranks that hold the same parameters and exchange gradients: the loader
                 shards over it, the exchange sums over it, replica checksums compare within
                 it, optimizer stripes and residuals are re-dealt over it
    grid.model   the M ranks that split one model (model.parallel; hpcsgd/model/parallel.py)
    grid.node    the ranks on this node (GPU binding, threads per rank)

World rank w is model rank w % M of data rank w // M: a model group is M consecutive ranks,
which launchers place on one node (block placement), so model-parallel traffic stays inside a
node while the data-parallel exchange crosses nodes (Seide et al. 2014, Table 5's 4 x 2).

Each communicator comes with its rank and size as plain attributes (grid.data_rank,
grid.data_size, ...), read once. With M = 1 the data communicator is the world communicator
itself (no split: the collectives run on the same communicator as before the grid existed).
"""


class Grid:
    def __init__(self, comm, model_size=1):
        from mpi4py import MPI
        self.world = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        if model_size < 1 or self.size % model_size:
            raise ValueError(f"model_size {model_size}: the {self.size} ranks of the job are "
                             f"not a whole number of model groups")
        self.model_size, self.data_size = model_size, self.size // model_size
        self.model_rank, self.data_rank = self.rank % model_size, self.rank // model_size
        if model_size == 1:
            self.data, self.model = comm, MPI.COMM_SELF
        else:   # same model rank -> one data group; same data rank -> one model group
            self.data = comm.Split(color=self.model_rank, key=self.data_rank)
            self.model = comm.Split(color=self.data_rank, key=self.model_rank)
        self.node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.node_rank, self.node_size = self.node.Get_rank(), self.node.Get_size()

    def describe(self):
        return (f"{self.size} rank(s) = {self.data_size} data x {self.model_size} model, "
                f"{self.node_size} on this node")

    def free(self):
        """Release the communicators this grid created (not the world's)."""
        from mpi4py import MPI
        for comm in (self.data, self.model, self.node):
            if comm not in (self.world, MPI.COMM_SELF):
                comm.Free()
