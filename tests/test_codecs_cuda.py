"""CUDA kernels == CPU kernels bit for bit, run under the CUDA simulator.

NUMBA_ENABLE_CUDASIM must be set before numba is first imported, and other test modules
import numba earlier in the same process; so the parent test re-runs this file in a fresh
pytest process with the variable set (HPCSGD_CUDASIM_CHILD=1 selects the real tests there).
With HPCSGD_TEST_GPU=1 (tests/conftest.py) the child runs on the machine's GPU instead.
Inputs are small: the simulator runs every CUDA thread as a Python thread.
"""
import os

import numpy as np
import pytest

from conftest import run_cuda_tests_in_child

CHILD = os.environ.get("HPCSGD_CUDASIM_CHILD") == "1"

if not CHILD:
    def test_cuda_kernels_in_simulator_subprocess():
        run_cuda_tests_in_child(__file__)   # the simulator, or a GPU with HPCSGD_TEST_GPU=1

else:
    from numba import cuda

    from hpcsgd.codecs import make_codec
    from hpcsgd.codecs.dettmers import DTYPES

    CONFIGS = ([("onebit", {})]
               + [("kbit", {"bits": k}) for k in (2, 3, 5, 8)]
               + [("kbit", {"bits": 5, "range": "rms"})]
               + [("float16", {"scale": 2.0 ** 14})]   # values beyond 4 saturate
               + [("dettmers", {"dtype": d}) for d in DTYPES]
               + [("dettmers", {"dtype": "dynamic_tree", "block": 16, "refresh": 2}),
                  ("float32", {}), ("float16", {})])
    IDS = [n + "".join(f"-{k}={v}" for k, v in o.items()) for n, o in CONFIGS]

    def run(name, opts, backend, gs):
        codec = make_codec(name, backend=backend, **opts)
        shape = gs[0].shape
        put = cuda.to_device if backend == "cuda" else (lambda a: a)
        r = put(np.zeros(shape, np.float32))
        buf = put(np.zeros(codec.packed_nbytes(*shape), np.uint8))
        acc = put(np.ones(shape, np.float32))
        dec = put(np.zeros(shape, np.float32))
        bufs = []
        for g in gs:
            codec.encode(put(g), r, buf)
            codec.decode_accumulate(buf, acc)
            bufs.append(np.array(buf.copy_to_host() if backend == "cuda" else buf))
        codec.decode(buf, dec)
        get = (lambda a: a.copy_to_host()) if backend == "cuda" else (lambda a: a)
        return bufs, get(r), get(acc), get(dec)

    @pytest.mark.parametrize("shape", [(3, 70), (2, 1), (0, 9)])
    @pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
    def test_cuda_equals_cpu_bit_for_bit(name, opts, shape):
        assert cuda.is_available()  # the simulator counts
        rng = np.random.default_rng(0)
        gs = [rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
        if shape[0] > 1:
            gs[0][1] = 0.0
        a, b = run(name, opts, "cpu", gs), run(name, opts, "cuda", gs)
        for x, y in zip(a[0], b[0]):
            assert x.tobytes() == y.tobytes()
        for x, y in zip(a[1:], b[1:]):
            np.testing.assert_array_equal(x, y)

    def test_kbit_minmax_signed_zeros_cuda_equals_cpu():
        from test_codecs import signed_zero_columns
        g, r0 = signed_zero_columns()
        bufs = {}
        for backend in ("cpu", "cuda"):
            c = make_codec("kbit", bits=4, backend=backend)
            put = cuda.to_device if backend == "cuda" else (lambda a: a.copy())
            buf = put(np.zeros(c.packed_nbytes(*g.shape), np.uint8))
            c.encode(put(g), put(r0), buf)
            bufs[backend] = np.array(buf.copy_to_host() if backend == "cuda" else buf)
        assert bufs["cpu"].tobytes() == bufs["cuda"].tobytes()

    @pytest.mark.parametrize("shape", [(3, 70), (2, 1), (4, 64)])
    def test_onebit_decode_apply_cuda_equals_cpu_and_reference(shape):
        rng = np.random.default_rng(1)
        g = rng.standard_normal(shape).astype(np.float32)
        w0 = rng.standard_normal(shape).astype(np.float32)
        out = {}
        for backend in ("reference", "cpu", "cuda"):
            c = make_codec("onebit", backend=backend)
            put = cuda.to_device if backend == "cuda" else (lambda a: a.copy())
            buf = put(np.zeros(c.packed_nbytes(*shape), np.uint8))
            w = put(w0)
            c.encode(put(g), put(np.zeros(shape, np.float32)), buf)
            c.decode_apply(buf, w, 0.37)
            out[backend] = w.copy_to_host() if backend == "cuda" else w
        np.testing.assert_array_equal(out["cpu"], out["reference"])
        np.testing.assert_array_equal(out["cuda"], out["cpu"])
        assert not np.array_equal(out["cuda"], w0)

    @pytest.mark.parametrize("name,opts", [CONFIGS[0], CONFIGS[3], CONFIGS[-4]], ids=str)
    def test_cuda_nonfinite_is_an_error(name, opts):
        g = np.zeros((3, 40), np.float32)
        g[2, 5] = np.nan
        c = make_codec(name, backend="cuda", **opts)
        with pytest.raises(ValueError, match="column 2"):
            c.encode(cuda.to_device(g), cuda.to_device(np.zeros_like(g)),
                     cuda.device_array(c.packed_nbytes(3, 40), np.uint8))

    @pytest.mark.parametrize("name,opts", [CONFIGS[i] for i in (0, 3, 5, -4, -2, -1)], ids=str)
    def test_cuda_fault_flags_read_once_at_the_check(name, opts):
        """Deferred (the striped exchange's setting): encodes queue without reading their
        flags; check_flags reads them all in one copy and names the first faulty matrix."""
        from hpcsgd import census
        census.install()
        c = make_codec(name, backend="cuda", **opts)
        c.defer_checks = True
        clean = np.ones((2, 40), np.float32)
        g = np.zeros((3, 40), np.float32)
        g[2, 5] = np.nan
        bufs = [cuda.device_array(c.packed_nbytes(*a.shape), np.uint8) for a in (clean, g)]
        before = census.snapshot()
        for _ in range(2):
            c.encode(cuda.to_device(clean), cuda.to_device(np.zeros_like(clean)), bufs[0])
        assert census.since(before)["d2h_copies"] == 0   # nothing read back yet
        c.check_flags()
        assert census.since(before)["d2h_copies"] == 1   # both flags in one copy
        c.check_flags()                                   # nothing pending: no copy
        assert census.since(before)["d2h_copies"] == 1
        for a, buf in zip((clean, g, clean), bufs + bufs[:1]):
            c.encode(cuda.to_device(a), cuda.to_device(np.zeros_like(a)), buf)
        with pytest.raises(ValueError, match=r"matrix \(3, 40\), column 2"):
            c.check_flags()

    @pytest.mark.parametrize("name,opts", [CONFIGS[i] for i in (0, 2, 4, 5, -4)], ids=str)
    def test_cuda_decode_sum_of_three_sources_equals_cpu_in_one_launch(name, opts):
        """The owner's sum of K = 3 contributions laid out as in the striped exchange's
        receive buffer (stride apart, at an offset): the CPU's decode + 2 accumulates, bit for
        bit; the 1-bit and k-bit GPU codecs do it in one launch, the others one per source."""
        from hpcsgd import census
        census.install()
        rng = np.random.default_rng(3)
        shape, K = (3, 70), 3
        cpu, gpu = make_codec(name, backend="cpu", **opts), make_codec(name, backend="cuda", **opts)
        nb = cpu.packed_nbytes(*shape)
        at, stride = 8, nb + 12
        recv = np.zeros(K * stride, np.uint8)
        for src in range(K):
            g = rng.standard_normal(shape).astype(np.float32)
            cpu.encode(g, np.zeros(shape, np.float32), recv[src * stride + at:src * stride + at + nb])
        want = np.full(shape, np.nan, np.float32)
        cpu.decode_sum(recv, stride, at, nb, K, want)
        got = cuda.to_device(np.full(shape, np.nan, np.float32))
        before = census.snapshot()
        gpu.decode_sum(cuda.to_device(recv), stride, at, nb, K, got)
        launches = census.since(before)["launches"]
        np.testing.assert_array_equal(got.copy_to_host(), want)
        assert launches == (1 if name in ("onebit", "kbit") else K)

    @pytest.mark.parametrize("name,opts", [CONFIGS[0], CONFIGS[2], CONFIGS[-4]], ids=str)
    def test_cuda_many_matrices_in_one_launch_equal_cpu(name, opts):
        """The striped exchange's phases over several matrices (items: element offset,
        columns, rows, byte offset; here 3 x 70, 1 x 1 and 2 x 33 at gaps): encode_many,
        decode_sum_many over K = 2 sources and decode_many (set, and apply: w -= lr * d) on
        the GPU equal the CPU's per-matrix calls bit for bit; the 1-bit and k-bit codecs take
        one launch per call, the others theirs per matrix."""
        from hpcsgd import census
        census.install()
        rng = np.random.default_rng(5)
        cpu, gpu = make_codec(name, backend="cpu", **opts), make_codec(name, backend="cuda", **opts)
        shapes, items, a, off = [(3, 70), (1, 1), (2, 33)], [], 3, 8
        for cols, rows in shapes:
            items.append((a, cols, rows, off))
            a, off = a + cols * rows + 5, off + cpu.packed_nbytes(cols, rows) + 4
        n, nbytes = a, off
        g = rng.standard_normal(n).astype(np.float32)
        w0 = rng.standard_normal(n).astype(np.float32)
        packed = {}
        for codec, put, get in ((cpu, lambda v: v.copy(), lambda v: v),
                                (gpu, cuda.to_device, lambda v: v.copy_to_host())):
            r, out = put(np.zeros(n, np.float32)), put(np.zeros(2 * nbytes, np.uint8))
            before = census.snapshot()
            codec.encode_many(items, put(g), r, out)                   # source 0
            codec.encode_many([(i[0], i[1], i[2], i[3] + nbytes) for i in items], put(-g), r, out)
            launches = census.since(before)["launches"]
            sums, dec, w = (put(np.full(n, np.nan, np.float32)), put(np.zeros(n, np.float32)),
                            put(w0))
            codec.decode_sum_many(items, out, nbytes, 2, sums)
            codec.decode_many(items, out, dec)
            if codec.fused_apply:
                codec.decode_many(items, out, w, 0.37)
            packed[codec.backend] = (get(out), get(r), get(sums), get(dec), get(w), launches)
        for got, want in zip(packed["cuda"][:5], packed["cpu"][:5]):
            np.testing.assert_array_equal(got, want)
        # Dettmers: its scales and its encode, per matrix
        assert packed["cuda"][5] == (2 if name in ("onebit", "kbit") else 2 * len(items) * 2)

    def test_cuda_rejects_host_arrays():
        c = make_codec("onebit", backend="cuda")
        g = np.zeros((2, 8), np.float32)
        with pytest.raises(TypeError, match="device arrays"):
            c.encode(g, g.copy(), np.zeros(c.packed_nbytes(2, 8), np.uint8))
