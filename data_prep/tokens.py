"""Token sequences for sequence criteria (CTC, RNN-T): the inventories and each utterance's ids.

Every inventory starts with the blank (archive.BLANK, id 0); an utterance's tokens are 1..V-1.

    phones  with alignments: the decoder's phone references (hpcsgd/decode/mkgraph.py): runs of
            equal frame labels merged, then SIL dropped (two equal phones either side of a
            dropped SIL stay two tokens). Without: each word's first pronunciation (--lexicon,
            then CMUdict: hpcsgd/decode/lexicon.py). Inventory: <blk>, then the frame-label
            inventory without SIL, in its order.
    chars   the transcript's characters as written (no case folding), <space> between words.
            Inventory: <blk>, <space>, the training transcripts' characters sorted.
    bpe     sentencepiece BPE pieces (trained on the training transcripts only, one thread, a
            fixed seed, sorted utterance order: deterministic). Inventory: <blk>, then the
            pieces in sentencepiece's id order; a piece's token id is its sentencepiece id + 1.

Per utterance (prep's skip reasons): "unknown token" (a character, piece or phone outside the
inventory, e.g. a held-out speaker's character the training text never had), "no
pronunciation" (a word the lexicon lacks).
"""
import io
import os

import numpy as np
import sentencepiece as spm

from data_prep.kaldi_dir import BadUtterance
from hpcsgd.data import archive
from hpcsgd.decode import lexicon, mkgraph
from hpcsgd.errors import UserError

SIL = mkgraph.SIL   # dropped from phone tokens, as the decoder's references drop it
SPACE = "<space>"   # the chars inventory's word boundary
BPE_SEED = 0        # sentencepiece's random generator (BPE itself draws nothing; set for safety)


# ---------------------------------------------------------------- inventories

def phone_inventory(label_symbols):
    return [archive.BLANK] + [s for s in label_symbols if s != SIL]


def char_inventory(transcripts):
    return [archive.BLANK, SPACE] + sorted({c for t in transcripts for c in t if c != " "})


def train_bpe(transcripts, size, where):
    """A sentencepiece BPE model (serialized bytes) of `size` pieces trained on `transcripts`
    (list of str, in the caller's order). Identity normalization, so pieces spell the text as
    written; every character of the text is a piece (character_coverage 1)."""
    sentences = [t for t in transcripts if t]
    if not sentences:
        raise UserError(f"{where}: no training transcript to learn BPE pieces from")
    model = io.BytesIO()
    spm.set_random_generator_seed(BPE_SEED)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences), model_writer=model, model_type="bpe",
            vocab_size=size, character_coverage=1.0, normalization_rule_name="identity",
            num_threads=1, shuffle_input_sentence=False, input_sentence_size=0,
            bos_id=-1, eos_id=-1, minloglevel=2)
    except RuntimeError as err:   # e.g. "Vocabulary size too high (256). Please set it to a value <= 90."
        raise UserError(f"{where}: sentencepiece cannot learn --bpe-size {size} pieces from the "
                        f"{len(sentences)} training transcripts ({str(err).split('] ')[-1]}); "
                        f"lower --bpe-size") from None
    return model.getvalue()


def bpe_processor(model_bytes):
    return spm.SentencePieceProcessor(model_proto=model_bytes)


def bpe_inventory(model_bytes):
    sp = bpe_processor(model_bytes)
    return [archive.BLANK] + [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


def load_inventories(archive_dir, kinds):
    """{kind: symbols} and the bpe model bytes (None without bpe) of an existing archive, each
    checked against its index (archive.read_tokens): a test set prepared for a trained model."""
    inventories = {k: archive.read_tokens(archive_dir, k) for k in kinds}
    model = None
    if "bpe" in kinds:
        path = os.path.join(archive_dir, archive.BPE_MODEL)
        if not os.path.isfile(path):
            raise UserError(f"{path}: missing (the bpe model of {archive_dir})")
        with open(path, "rb") as f:
            model = f.read()
        if bpe_inventory(model) != inventories["bpe"]:
            raise UserError(f"{path}: its pieces differ from "
                            f"{os.path.join(archive_dir, archive.token_inventory_name('bpe'))}")
    return inventories, model


# ---------------------------------------------------------------- one utterance

def chars(utt, words, ids):
    """Token ids of the transcript's characters, <space> between words."""
    out = []
    for k, word in enumerate(words):
        if k:
            out.append(ids[SPACE])
        for c in word:
            if c not in ids:
                raise BadUtterance("unknown token", f"{utt}: character {c!r} (in {word!r}) is "
                                                    f"not in the chars inventory")
            out.append(ids[c])
    return out


def bpe(utt, words, sp):
    """Token ids (sentencepiece ids + 1) of the space-joined transcript."""
    text = " ".join(words)
    pieces = sp.encode(text)
    if sp.unk_id() in pieces:
        surface = sp.encode(text, out_type=str)[pieces.index(sp.unk_id())]
        raise BadUtterance("unknown token", f"{utt}: {surface!r} is not in the bpe pieces "
                                            f"(characters the training transcripts never had)")
    return [p + 1 for p in pieces]


def phones_of_words(utt, words, prons, ids):
    """Token ids of each word's first pronunciation (SIL dropped, as in the references)."""
    out = []
    for word in words:
        if word not in prons:
            raise BadUtterance("no pronunciation", f"{utt}: word {word!r} has no pronunciation "
                                                   f"(--lexicon, CMUdict)")
        out += [ids[p] for p in prons[word][0] if p != SIL]
    return out


def phones_of_labels(utt, frame_labels, label_symbols, ids):
    """Token ids of the decoder's phone reference for these frame labels (mkgraph's own code)."""
    runs, _ = mkgraph.segments(frame_labels)
    out = []
    for phone in mkgraph.phone_sequence(label_symbols, runs, keep_sil=False):
        if phone not in ids:
            raise BadUtterance("unknown token", f"{utt}: phone {phone!r} is not in the phones "
                                                f"inventory")
        out.append(ids[phone])
    return out


def concatenate(per_utt):
    """[list of ids per utterance] -> (ids int32, offsets int64 (U+1,)), the shard's layout."""
    offsets = np.zeros(len(per_utt) + 1, dtype=np.int64)
    np.cumsum([len(t) for t in per_utt], out=offsets[1:])
    ids = np.fromiter((i for t in per_utt for i in t), dtype=np.int32, count=int(offsets[-1]))
    return ids, offsets


def pronunciations(words, phone_symbols, lexicon_path):
    """{word: [phone tuples]} for the words found (the user's lexicon, then CMUdict, as the
    word graphs look them up) and how many of `words` have none."""
    prons, lacking = lexicon.pronunciations(sorted(set(words)), [SIL, *phone_symbols],
                                            lexicon_path)
    return prons, len(lacking)
