"""CTC forced alignment: the best path of an utterance's reference tokens through a CTC model's
log-posteriors (Viterbi over the CTC topology), on the CPU (Numba), and the float64 NumPy
reference it is tested against.

The states of U tokens l1..lU are CTC's 2U + 1: blank, l1, blank, l2, ..., lU, blank (state s
is labelled l'_s: the blank for even s, l_{(s+1)/2} for odd s). A path starts in state 0 or 1
and ends in state 2U or 2U - 1; from state s it stays, moves to s + 1, or skips the blank to
s + 2 between two different tokens. Its score is the sum of lp[t, l'_{s_t}]:

    delta_0(0) = lp[0, blank], delta_0(1) = lp[0, l1], delta_0(s > 1) = -inf
    delta_t(s) = max(delta_{t-1}(s), delta_{t-1}(s-1), [delta_{t-1}(s-2)]) + lp[t, l'_s]

(CTC's alpha recursion with max for log-sum-exp: kernels_ctc.py), the best final state, then
the back-pointers back to t = 0. Ties go to the earliest predecessor in the order stay, s - 1,
s - 2 (the kernel and the reference alike), so a path is a pure function of lp. The scores
are summed in float64. An utterance with fewer frames than tokens plus adjacent repeats has no
path: the kernels return -1 for every frame and a score of -inf.

Cost: T * (2U + 1) three-way maxima and a byte of back-pointer each (the only memory beyond the
path): a 20 s LibriSpeech utterance at 40 ms (500 frames, 100 pieces) is 10^5 cells, far below
the model's forward pass.
"""
import numba
import numpy as np

NO_PATH = -1   # every frame's label when no path exists


@numba.njit(cache=True)
def ctc_viterbi(lp, ids, blank):
    """lp (T, V) float32 log-posteriors, ids (U,) int token ids (never the blank) -> (path
    (T,) int32: each frame's label on the best path, the blank or a token; its score, float64).
    No path: every frame NO_PATH, score -inf."""
    T, U = lp.shape[0], len(ids)
    S = 2 * U + 1
    path = np.full(T, NO_PATH, np.int32)
    if T == 0:
        return path, -np.inf
    delta = np.full(S, -np.inf)
    new = np.empty(S)
    back = np.zeros((T, S), np.int8)   # 0 stay, 1 from s - 1, 2 from s - 2
    delta[0] = lp[0, blank]
    if U > 0:
        delta[1] = lp[0, ids[0]]
    for t in range(1, T):
        for s in range(S):
            best, arg = delta[s], 0
            if s >= 1 and delta[s - 1] > best:
                best, arg = delta[s - 1], 1
            if s >= 3 and s % 2 == 1 and ids[s // 2] != ids[s // 2 - 1] and delta[s - 2] > best:
                best, arg = delta[s - 2], 2
            label = blank if s % 2 == 0 else ids[s // 2]
            new[s] = best + lp[t, label]
            back[t, s] = arg
        delta[:] = new
    s = S - 1
    if U > 0 and delta[S - 2] > delta[S - 1]:
        s = S - 2
    score = delta[s]
    if score == -np.inf:
        return path, score
    for t in range(T - 1, -1, -1):
        path[t] = blank if s % 2 == 0 else ids[s // 2]
        s -= back[t, s]
    return path, score


def ctc_viterbi_reference(lp, ids, blank=0):
    """The float64 NumPy reference of ctc_viterbi: the same recursion, one time step at a time
    over all states (the same tie order), from the float64 log-posteriors."""
    lp = np.asarray(lp, np.float64)
    ids = np.asarray(ids, np.int64)
    T, U = lp.shape[0], len(ids)
    S = 2 * U + 1
    if T == 0:
        return np.full(0, NO_PATH, np.int32), -np.inf
    labels = np.full(S, blank, np.int64)
    labels[1::2] = ids
    skip = np.zeros(S, bool)   # s - 2 -> s: a token after a different one
    skip[3::2] = ids[1:] != ids[:-1]
    delta = np.full(S, -np.inf)
    delta[0] = lp[0, blank]
    if U:
        delta[1] = lp[0, ids[0]]
    back = np.zeros((T, S), np.int64)
    for t in range(1, T):
        prev = np.full((3, S), -np.inf)
        prev[0] = delta
        prev[1, 1:] = delta[:-1]
        prev[2, 2:] = np.where(skip[2:], delta[:-2], -np.inf)
        back[t] = np.argmax(prev, axis=0)        # the first maximum: stay, s - 1, s - 2
        delta = prev[back[t], np.arange(S)] + lp[t, labels]
    s = S - 2 if U and delta[S - 2] > delta[S - 1] else S - 1
    if delta[s] == -np.inf:
        return np.full(T, NO_PATH, np.int32), -np.inf
    score, path = delta[s], np.empty(T, np.int32)
    for t in range(T - 1, -1, -1):
        path[t] = labels[s]
        s -= back[t, s]
    return path, score
