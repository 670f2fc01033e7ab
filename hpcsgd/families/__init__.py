"""Model families: one module per model.type, holding what the trainer, eval, infer, decode and
the config ask about a kind of model, so that none of them asks "which type is this?".

    from hpcsgd.families import family
    fam = family(cfg["model.type"])              # or of_model(meta["model"]) for a checkpoint
    loader = fam.make_loader(cfg, grid, rows)
    shape = fam.shape(cfg, loader, qat)          # the checkpoint's meta["model"]

What every family module provides (tests/test_families.py checks it):

    UTTERANCES         whole utterances against token sequences (True), or frame labels
    SPLITS             model.parallel may split its layers over a model group (hpcsgd.model.build)
    SEQUENCES          a batch is whole sequences, chunks or utterances, none split between
                       ranks (False: frames, split anywhere)
    FIRST_LAYER_FLOAT  qat.first_layer=auto keeps the first layer in float
    OVERLAP_BLOCKER    why exchange.overlap cannot run with it, or None
    EVAL_ROWS          the fewest rows eval, infer and decode give a pass (0: any)
    CRITERION          the training sums' name: "ce", "ctc", "rnnt"
    SEARCHES           what decode may run: "graph" (HLG or TLG), "greedy", "beam"
    TIMESTAMPS         decode --ctm can time its words from the search (CTC's emissions)
    GRAPH_TOPOLOGY     the decoding graph its outputs feed: "hmm" (an HLG over HMM states),
                       "ctc" (a TLG over its tokens), None (no graph: "graph" not in SEARCHES)
    check_config(config)                  its config rules (config.load calls them)
    make_loader(cfg, grid, rows)          this data rank's training loader
    check_cv(cfg, cv_index, loader), check_train(cfg, loader)     the archives fit it
    model_rows(loader)                    (rows of the model's buffers, most sequences)
    shape(cfg, loader, qat), describe(shape)   the checkpoint's model, one line of it
    static_meta(cfg, loader), data_meta(cfg)   what else the checkpoint keeps
    training_settings(model, cfg)         the output layer's training-only settings
    init_from_part(theirs, path)          train.init_from: "all" or "encoder" of a checkpoint
                                          whose model.type is `theirs` (or a refusal)
    window_measures(totals), epoch_measures(epoch, seconds, totals, cv)
                                          the sums' names and lines in the log and metrics
    divergence(cfg, ce)                   the loss an untrained model has ln(V) of, its name
    share(minibatch, grid, loader), log_data(log, cfg, loader), finish(log, cfg, model)
                                          its lines in the training log
    cross_validate(cfg, model, params, grid, data, heartbeat)    the trainer's CV
    evaluate(model, params, archive_dir, data, rank, world, comm, heartbeat)   `hpcsgd eval`
    priors(meta), outputs(...), infer_note(model, whole), posteriors(...)
                                          `hpcsgd infer` and recognition's inputs
    search(model, params, outputs, tokens, beam, **options), describe_search(beam, kind)
                                          decode without a graph (families that offer it;
                                          options: runs= for timestamps, lm=, lm_weight=,
                                          bonus=, nbest= for a beam search; others ignored)

A new family is one module here (and its name in FAMILIES) plus its layers in model/ and
their builder in hpcsgd.model.build. What several families share lives in hybrid.py (the
frame classifiers), ctc.py (models of whole utterances: rnnt takes it) and common.py.
"""
from hpcsgd.errors import UserError
from hpcsgd.families import ctc, dnn, lstm, rnnt, tdnn

# model.type -> its module; "dnn" first: the default, and the type of checkpoints written
# before there was a choice (their meta["model"] has no "type")
FAMILIES = {"dnn": dnn, "lstm": lstm, "tdnn": tdnn, "ctc": ctc, "rnnt": rnnt}
DEFAULT = "dnn"


def family(name):
    """The module of model.type `name`; an unknown one refused by name."""
    if name not in FAMILIES:
        raise UserError(f"model type {name!r}: expected one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def of_model(describe):
    """The family of a model description (a checkpoint's meta["model"], Network.describe)."""
    return family(describe.get("type", DEFAULT))
