"""A command's wall time on an idle machine and beside N busy processes (pure-Python loops,
standing in for the other test worker or other ranks), alternated over rounds:
    python experiments/busy_neighbours.py N ROUNDS -- COMMAND...
e.g. Numba's CUDA simulator with and without lazy_cuda's one core per launch:
    NUMBA_ENABLE_CUDASIM=1 python experiments/busy_neighbours.py 2 2 -- \
        python -m hpcsgd.bench.cuda --record /tmp/launches.json
"""
import subprocess
import sys
import time

BURN = "import time\nend = time.time() + 3600\nwhile time.time() < end:\n    pass\n"

n, rounds = int(sys.argv[1]), int(sys.argv[2])
command = sys.argv[sys.argv.index("--") + 1:]
for rnd in range(rounds):
    for busy in (0, n):
        burners = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(busy)]
        try:
            t0 = time.perf_counter()
            proc = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True)
            wall = time.perf_counter() - t0
        finally:
            for b in burners:
                b.kill()
                b.wait()
        if proc.returncode != 0:
            sys.exit(f"exit {proc.returncode}: {proc.stderr[-2000:]}")
        print(f"round {rnd}: {busy} busy process(es): {wall:.2f} s", flush=True)
