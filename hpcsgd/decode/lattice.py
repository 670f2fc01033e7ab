"""N-best word sequences from a decoder's lattice: Kaldi's lattice-to-nbest, in numpy.

kaldi-decoder's LatticeSimpleDecoder gives a raw state-level lattice: input labels the graph's
(one per frame), output labels words, weights (graph cost, acoustic cost). One word sequence
lies on many of its paths (every alignment within the lattice beam), so its N shortest paths
are mostly one hypothesis. Kaldi determinizes the lattice first (a CompactLattice keeps each
word sequence once, at its best path's cost) and then takes the N shortest paths. kaldifst
binds neither lattice determinization nor projection, only the tropical FST's, so:

    raw lattice -> acceptor over its words, each arc's cost graph + acoustic (tropical)
                -> determinize_star (epsilons removed; one path per word sequence, its cost
                   the minimum over the sequence's paths, as Kaldi's lattice determinization
                   keeps it) -> shortest_path(n) -> the linear paths, cheapest first

Kaldi determinizes with pruning at the lattice beam (DeterminizeLatticePruned); kaldifst's
determinize_star has none, and a rich lattice's determinization grows exponentially with the
beam: past MAX_STATES the caller decodes the utterance again at half the lattice beam.

The conversion goes through OpenFst's binary format (VectorFst: a header, then per state its
final weight, arc count and arcs) read and written with numpy: the text format prints 6
significant digits, the binary one the float32 costs the decoder summed, and per-arc Python
would cost more than the search (a 4-s demo utterance's word lattice held 600k arcs at lattice
beam 8, 65k at 4).
"""
import os
import struct
import tempfile

import numpy as np

from hpcsgd.decode import graph as graphs

MAGIC = 2125659606     # OpenFst's kFstMagicNumber
VERSION = 2            # VectorFst's file version
PROPERTIES = 0x3       # kExpanded | kMutable; every other property unknown: computed when asked
# arcs as OpenFst writes them: ilabel, olabel, weight (LatticeWeight: graph and acoustic cost;
# TropicalWeight: one cost), nextstate
LATTICE_ARC = np.dtype([("ilabel", "<i4"), ("olabel", "<i4"), ("graph", "<f4"),
                        ("acoustic", "<f4"), ("next", "<i4")])
STD_ARC = np.dtype([("ilabel", "<i4"), ("olabel", "<i4"), ("cost", "<f4"), ("next", "<i4")])
DELTA = 1.0 / 1024     # determinize_star's weight quantization (OpenFst's kDelta)
# The word acceptor determinizes into about one state per distinct word prefix within the
# lattice beam, which grows exponentially with the beam: the demo DNN's phone lattices give
# <800 states at lattice beam 4 and >50k at 6. Past this the utterance's lattice is made
# again at half the beam (search.Decoder.nbest)
MAX_STATES = 20_000


def _string(text):
    return struct.pack("<i", len(text)) + text.encode()


def _header(arc_type, start, states):
    return (struct.pack("<i", MAGIC) + _string("vector") + _string(arc_type)
            + struct.pack("<iiQqqq", VERSION, 0, PROPERTIES, start, states, 0))


def lattice_arrays(lat, scratch):
    """A kaldifst.Lattice -> (start state, (S, 2) final weights (graph, acoustic; inf: not
    final), source state per arc, the arcs as LATTICE_ARC), read from its binary file."""
    path = os.path.join(scratch, "lattice.fst")
    if not lat.write(path):
        raise RuntimeError(f"kaldifst could not write a lattice to {path}")
    with open(path, "rb") as f:
        buf = f.read()
    pos = 4
    (magic,) = struct.unpack_from("<i", buf, 0)
    names = []
    for _ in range(2):                       # fst type, arc type
        (n,) = struct.unpack_from("<i", buf, pos)
        names.append(buf[pos + 4:pos + 4 + n].decode())
        pos += 4 + n
    _, flags, _, start, states, _ = struct.unpack_from("<iiQqqq", buf, pos)
    pos += struct.calcsize("<iiQqqq")
    if magic != MAGIC or names != ["vector", "lattice4"] or flags:
        raise RuntimeError(f"not a plain lattice4 VectorFst: {names}, flags {flags} (a "
                           f"kaldifst whose file format this reader does not know)")
    # each state: final weight (2 float32), arc count (int64), arcs; the offsets are a chain
    offsets, counts = [], []
    count_at = struct.Struct("<q").unpack_from
    for _ in range(states):
        (n,) = count_at(buf, pos + 8)
        offsets.append(pos)
        counts.append(n)
        pos += 16 + n * LATTICE_ARC.itemsize
    data = np.frombuffer(buf, np.uint8)
    offsets = np.asarray(offsets, np.int64)
    counts = np.asarray(counts, np.int64)
    finals = data[offsets[:, None] + np.arange(8)].copy().view("<f4").reshape(-1, 2) \
        if states else np.zeros((0, 2), np.float32)
    src = np.repeat(np.arange(states), counts)
    first = np.cumsum(counts) - counts
    at = offsets[src] + 16 + (np.arange(len(src)) - first[src]) * LATTICE_ARC.itemsize
    arcs = data[at[:, None] + np.arange(LATTICE_ARC.itemsize)].copy().view(LATTICE_ARC)[:, 0] \
        if len(src) else np.zeros(0, LATTICE_ARC)
    return start, finals, src, arcs


def word_acceptor(start, finals, src, arcs, scratch, skip=()):
    """The lattice's arrays -> a kaldifst.StdVectorFst accepting its word sequences, each
    arc's cost graph + acoustic; words in `skip` (a phone graph's SIL) read as epsilons."""
    kf = graphs._fst()
    words = np.where(np.isin(arcs["olabel"], list(skip)), 0, arcs["olabel"])
    # arcs are grouped by state already (read in state order): only the byte layout changes
    out = np.zeros(len(arcs), STD_ARC)
    out["ilabel"] = out["olabel"] = words
    out["cost"] = arcs["graph"] + arcs["acoustic"]
    out["next"] = arcs["next"]
    states = len(finals)
    counts = np.bincount(src, minlength=states).astype(np.int64)
    size = 12 + counts * STD_ARC.itemsize           # final (float32), count (int64), arcs
    offsets = np.cumsum(size) - size
    body = np.zeros(int(size.sum()), np.uint8)
    final = (finals[:, 0] + finals[:, 1]).astype("<f4")      # inf + inf: not final
    heads = np.zeros(states, np.dtype([("final", "<f4"), ("count", "<i8")]))
    heads["final"], heads["count"] = final, counts
    body[offsets[:, None] + np.arange(12)] = heads.view(np.uint8).reshape(states, 12)
    first = np.cumsum(counts) - counts
    at = offsets[src] + 12 + (np.arange(len(src)) - first[src]) * STD_ARC.itemsize
    body[at[:, None] + np.arange(STD_ARC.itemsize)] = \
        out.view(np.uint8).reshape(len(out), STD_ARC.itemsize)
    path = os.path.join(scratch, "words.fst")
    with open(path, "wb") as f:
        f.write(_header("standard", start, states))
        f.write(body.tobytes())
    return kf.StdVectorFst.read(path)


def nbest(lat, n, beam, skip=()):
    """A raw kaldifst.Lattice pruned at lattice beam `beam` -> its n cheapest distinct word
    sequences within `beam` of the best (fewer when it holds fewer) as [(total cost,
    [word ids])], cheapest first; the cost graph + acoustic, the sum the decoder minimised.
    Words in `skip` are not part of a sequence. None when the word acceptor does not
    determinize within MAX_STATES states (the caller narrows the beam).

    Only sequences within the beam are exact: every arc of the lattice lies on a path within
    it, but a path joined from such arcs may not, and a sequence whose best path was pruned
    would show the cost of a worse one."""
    kf = graphs._fst()
    if lat.start < 0:      # an empty lattice: nothing survived
        return []
    with tempfile.TemporaryDirectory(prefix="hpcsgd_lattice_") as scratch:
        acceptor = word_acceptor(*lattice_arrays(lat, scratch), scratch, skip)
    try:   # kaldifst raises where Kaldi's fstdeterminizestar would return "stopped early"
        if kf.determinize_star(acceptor, delta=DELTA, max_states=MAX_STATES):
            return None
    except RuntimeError as err:
        if "aborted" not in str(err):
            raise
        return None
    out = []
    for path in kf.convert_nbest_to_vector(kf.shortest_path(acceptor, n=n)):
        ok, _, words, weight = kf.get_linear_symbol_sequence(path)
        if ok:
            out.append((float(weight.value), list(words)))
    out.sort(key=lambda item: item[0])   # shortest_path lists them in no promised order
    return [(cost, words) for cost, words in out if cost <= out[0][0] + beam + DELTA]
