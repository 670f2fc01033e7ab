"""Beam search through HLG or TLG: Kaldi's FasterDecoder (the `kaldi-decoder` package).

Hybrid models. The network gives log-posteriors log p(phone | x_t); a hybrid decoder needs
scaled log-likelihoods, by Bayes up to a per-frame constant:

    score(t, p) = acoustic_scale * (log p(p | x_t) - prior_scale * log p(p))

(the prior p(p) from the training archive's label counts). The acoustic scale weighs the
frames against the graph's LM and transition costs (Kaldi's --acoustic-scale, 0.1 in its DNN
recipes); a prior scale below 1 divides out only part of the prior. kaldi-decoder's
DecodableCtc scores input label i with column i - 1 of the matrix it is given: HLG's input
label of HMM state s of phone p is p * states + s + 1 (hpcsgd/decode/graph.py), so the
matrix is the scores with each phone's column repeated `states` times.

CTC models. The (T', V) log-posteriors over the tokens, blank column included, times the
acoustic scale, are the matrix as they are: TLG's input label of token k is k + 1. No prior
is divided out (the CTC posteriors are used as icefall's HLG decoding uses them); the
acoustic scale weighs them against G's costs (1 / the LM scale of icefall's recipes).

N-best lists (decode --nbest): the same graph and scores through Kaldi's LatticeSimpleDecoder,
whose lattice holds every path within `lattice_beam` of the best; hpcsgd/decode/lattice.py
turns it into the N cheapest distinct word sequences (lattice-to-nbest).
"""
import json
import math
import os

import numpy as np

from hpcsgd.data import archive
from hpcsgd.decode import graph as graphs
from hpcsgd.decode import lattice
from hpcsgd.errors import UserError
from hpcsgd.families import of_model

BEAM = 13.0          # Kaldi's decode.sh default for DNN systems
MAX_ACTIVE = 1000    # Kaldi says 7000; on so762 1000 loses nothing at 1/10 the time (docs/decode.md)
# N-best lists (Decoder.nbest) come from Kaldi's LatticeSimpleDecoder, the only lattice
# decoder kaldi-decoder binds. It has no max-active: at BEAM 13 the demo DNN's 40 CV
# utterances through its word HLG took >590 s (the best path 2 s), at 8 ~60 s. So it searches
# at NBEST_BEAM, and again at the best path's beam an utterance whose lattice's best comes out
# dearer than the best path (by more than COST_TOLERANCE: float sums, determinize's delta)
NBEST_BEAM = 8.0
COST_TOLERANCE = 0.01
# The n-best's paths lie within the lattice beam of the best. Kaldi's is 8 (steps/decode.sh),
# with a determinization pruned at it; kaldifst's has no pruning and grows exponentially with
# the beam (the demo DNN's phone lattices: <800 states at 4, >50k at 6): 4, and narrower for
# an utterance whose lattice still does not determinize (lattice.MAX_STATES)
LATTICE_BEAM = 4.0
NARROWINGS = 10      # halvings of it at most (4 -> 1/256)


class Graph:
    """A graph directory as decode reads it: HLG or TLG, the word table, graph.json."""

    def __init__(self, graph_dir):
        path = os.path.join(graph_dir, "graph.json")
        if not os.path.isfile(path):
            raise UserError(f"{graph_dir}: no graph.json (make the graph with `hpcsgd mkgraph "
                            f"TRAIN_ARCHIVE {graph_dir} --kind ...`)")
        with open(path) as f:
            self.info = json.load(f)
        self.dir = graph_dir
        self.kind = self.info["kind"]
        self.topology = self.info.get("topology", "hmm")
        # input labels per network output column: HMM states per phone, one per CTC token
        self.states = self.info["states"] if self.topology == "hmm" else 1
        self.labels = self.info.get("labels")
        self.tokens = self.info.get("tokens")     # CTC: {"kind", "inventory_hash", "symbols"}
        self.words = archive.read_inventory(os.path.join(graph_dir, "words.txt"))
        name = "HLG.fst" if self.topology == "hmm" else "TLG.fst"
        self.fst = graphs.read_fst(os.path.join(graph_dir, name))

    def check_archive(self, index, archive_dir):
        """An HLG's phones must be the archive's labels (the matrix columns); a TLG's columns
        are the model's tokens (check_model)."""
        if self.topology != "hmm":
            return
        if index["label_inventory_hash"] != self.info["label_inventory_hash"]:
            raise UserError(f"{archive_dir}: label inventory {index['label_inventory_hash']} "
                            f"differs from the graph's phone table "
                            f"({self.info['label_inventory_hash']}, {self.dir}/phones.txt): "
                            f"build the graph from an archive with the same labels.txt")

    def check_model(self, meta):
        """The graph's topology must be the model's: HLG for a hybrid frame classifier, TLG
        over the model's own token inventory for a CTC model."""
        tlg = of_model(meta["model"]).GRAPH_TOPOLOGY == "ctc"   # its outputs feed a TLG
        path = meta.get("path", "the model")
        if tlg != (self.topology == "ctc"):
            hint = (f"hpcsgd mkgraph TRAIN_ARCHIVE GRAPH_DIR --kind {self.kind} --topology ctc "
                    f"--tokens {meta.get('tokens', {}).get('kind', 'KIND')}"
                    if tlg else
                    f"hpcsgd mkgraph TRAIN_ARCHIVE GRAPH_DIR --kind {self.kind}")
            raise UserError(f"{self.dir}: a {self.topology} graph, but {path} is a "
                            f"{'CTC' if tlg else 'hybrid'} model: make its "
                            f"graph with `{hint}`")
        if tlg:
            self.check_tokens(meta["tokens"], path)

    def check_tokens(self, meta_tokens, model_path="the model"):
        """A TLG reads the matrix columns as the tokens it was made with: the model must
        output the same kind over the same inventory."""
        mine = self.tokens
        if mine["kind"] != meta_tokens["kind"]:
            raise UserError(f"{self.dir}: a graph over {mine['kind']} tokens, but {model_path} "
                            f"outputs {meta_tokens['kind']} tokens: make the graph with "
                            f"--tokens {meta_tokens['kind']}")
        if mine["inventory_hash"] != meta_tokens["inventory_hash"]:
            raise UserError(f"{model_path}: {meta_tokens['kind']} token inventory "
                            f"{meta_tokens['inventory_hash']} differs from the graph's "
                            f"({mine['inventory_hash']}, {self.dir}/graph.json, made from "
                            f"{self.info['archive']}/"
                            f"{archive.token_inventory_name(mine['kind'])}): make the graph from "
                            f"the archive the model was trained on")


def scaled_loglikelihoods(logpost, log_priors, acoustic_scale, prior_scale, states):
    """(T, P) log-posteriors -> the decoder's (T, P * states) float32 score matrix."""
    scores = logpost - np.float32(prior_scale) * log_priors
    scores *= np.float32(acoustic_scale)
    return np.repeat(scores, states, axis=1)


def ctc_scores(logpost, acoustic_scale):
    """(T', V) CTC log-posteriors -> the decoder's (T', V) float32 score matrix (no prior)."""
    return np.ascontiguousarray(logpost * np.float32(acoustic_scale), np.float32)


class Decoder:
    """One FasterDecoder on a graph, reused for every utterance (and for N-best lists, a
    LatticeSimpleDecoder on the same graph, made when first asked)."""

    def __init__(self, graph, beam=BEAM, max_active=MAX_ACTIVE, insertion_penalty=0.0,
                 lattice_beam=LATTICE_BEAM, nbest_beam=NBEST_BEAM):
        try:
            import kaldi_decoder
            import kaldifst
        except ImportError:
            raise UserError("decoding needs the `kaldi-decoder` and `kaldifst` packages "
                            "(pip install kaldi-decoder kaldifst)") from None
        self.graph = graph
        self.beam, self.max_active = beam, max_active
        self.insertion_penalty = float(insertion_penalty)
        self.lattice_beam = lattice_beam
        self.nbest_beam = min(nbest_beam, beam)      # the lattice search's, first
        self._lattice = {}      # (beam, lattice beam) -> LatticeSimpleDecoder, made when asked
        self._kd, self._kf = kaldi_decoder, kaldifst
        # the decoder keeps a pointer to its graph: the copy lives as long as it does
        self._fst = graph.fst if not self.insertion_penalty else \
            graphs.with_insertion_penalty(graph.fst, self.insertion_penalty)
        options = kaldi_decoder.FasterDecoderOptions(beam=beam, max_active=max_active)
        self.decoder = kaldi_decoder.FasterDecoder(self._fst, options)

    def with_penalty(self, insertion_penalty):
        """This decoder's search on the same graph with another insertion penalty."""
        if float(insertion_penalty) == self.insertion_penalty:
            return self
        return Decoder(self.graph, self.beam, self.max_active, insertion_penalty,
                       self.lattice_beam, self.nbest_beam)

    def decode(self, scores):
        """(T, P * states) scores (a TLG: (T', V)) -> (word ids of the best path, whether it
        reached a final state, its phone per frame; a TLG's token per frame, blanks included).
        A path that ends in no final state (an utterance shorter than the graph's shortest
        word sequence, or a beam too narrow) is taken as it is, as Kaldi's decoders do with a
        warning; the caller counts them."""
        decodable = self._kd.DecodableCtc(np.ascontiguousarray(scores, np.float32))
        self.decoder.decode(decodable)
        final = self.decoder.reached_final()
        ok, path = self.decoder.get_best_path(use_final_probs=final)
        if not ok:
            return [], False, np.zeros(0, np.int64)
        ok, states, words, _ = self._kf.get_linear_symbol_sequence(path)
        # input labels are HMM states, one per frame: p * states + s + 1 (TLG: token + 1)
        phones = (np.asarray(states, np.int64) - 1) // self.graph.states
        return list(words), final and ok, phones

    def nbest(self, scores, n, skip=()):
        """The same scores through Kaldi's LatticeSimpleDecoder on the same graph (insertion
        penalty included) -> (the n cheapest distinct word sequences within the lattice beam
        of the best, as [(total cost, word ids)] cheapest first, fewer when the lattice holds
        fewer; whether it reached a final state; the lattice beam; whether the search was
        widened from nbest_beam to beam). The cost is graph + acoustic (minus the scaled
        log-likelihoods), what decode()'s best path minimises. Words in `skip` (a phone
        graph's SIL) are left out before distinct sequences are counted.

        The lattice search runs at nbest_beam; where its best is dearer than decode()'s best
        path (the narrower beam lost that path) again at decode()'s beam. Having no
        max-active, it then finds decode()'s best path or a cheaper one that max-active
        pruned (docs/decode.md#n-best-lists). A lattice too rich to determinize
        (lattice.MAX_STATES) is made again at half the lattice beam."""
        decodable = self._kd.DecodableCtc(np.ascontiguousarray(scores, np.float32))
        ranked, final, lattice_beam = self._lattice_nbest(decodable, n, skip, self.nbest_beam)
        widen = self.nbest_beam < self.beam and (
            not ranked or ranked[0][0] > self._best_cost(decodable) + COST_TOLERANCE)
        if widen:
            ranked, final, lattice_beam = self._lattice_nbest(decodable, n, skip, self.beam)
        return ranked, final, lattice_beam, widen

    def _best_cost(self, decodable):
        """decode()'s best path's total cost (graph + acoustic)."""
        self.decoder.decode(decodable)
        ok, path = self.decoder.get_best_path(use_final_probs=self.decoder.reached_final())
        if not ok:
            return math.inf
        weight = self._kf.get_linear_symbol_sequence(path)[3]
        return weight.value1 + weight.value2

    def _lattice_nbest(self, decodable, n, skip, search_beam):
        beam = self.lattice_beam
        for _ in range(NARROWINGS):
            key = (search_beam, beam)
            if key not in self._lattice:    # each keeps a pointer to the graph, as decoder
                config = self._kd.LatticeSimpleDecoderConfig(beam=search_beam,
                                                             lattice_beam=beam)
                self._lattice[key] = self._kd.LatticeSimpleDecoder(self._fst, config)
            decoder = self._lattice[key]
            decoder.decode(decodable)
            final = math.isfinite(decoder.final_relative_cost())
            # after decode() (finalized) only with final probs; where no final state was
            # reached every last-frame token ends a path at cost 0, as in decode()
            ok, lat = decoder.get_raw_lattice(use_final_probs=True)
            ranked = lattice.nbest(lat, n, beam, skip) if ok else []
            if ranked is not None:
                return ranked, final, beam
            beam /= 2
        raise RuntimeError(f"a lattice at beam {beam * 2:g} still did not determinize within "
                           f"{lattice.MAX_STATES} states")
