"""An emulated cluster on one machine: K "hosts" as network namespaces, each joined to a bridge
by a veth pair whose two ends are shaped with tc (tbf: the rate; netem: a one-way delay, where
the kernel has sch_netem -- this VM's has not: CONFIG_NET_SCH_NETEM is off, no modules), one
MPI rank per namespace, MPI over TCP. This is where 1-bit SGD's byte savings meet a bandwidth-limited link
(on one machine without it, the "network" is memory copies: docs/benchmarks.md).

    bin/emucluster [--hosts K] [--gbps 1] [--delay-us 25] -- mpiexec-args...
    python -m hpcsgd.bench.emucluster --hosts 2 --gbps 1 -- -n 2 python -m mpi4py.bench helloworld
    hpcsgd bench exchange|train|machine --emulate 1,10,25 [--hosts K] ...   (cluster() below)

Needs root (ip netns, tc); exits 2 with a message otherwise. Everything it creates carries the
prefix `hpe` (namespaces hpe0..hpeK-1, bridge hpebr, veths hpeNh/emu0), and is removed on exit,
on an exception and on SIGINT/SIGTERM/SIGHUP (the launcher turns those into an exception so the
`finally` runs). `--down` removes leftovers of a killed run. One cluster at a time (an flock,
exclusive()): a second run exits 75 at once, or waits $EMUCLUSTER_WAIT seconds for it.

How MPI reaches the namespaces: MPICH's hydra `mpiexec` (in the root namespace, on the bridge
address 10.77.0.1) starts its proxies with the ssh launcher whose executable is
bin/emucluster-launch, which maps the host address to its namespace and runs the proxy there
under `ip netns exec`. Every rank is on its own host, so MPICH uses no shared memory between
ranks; libfabric's tcp provider is forced to the namespace's interface (FI_PROVIDER=tcp,
FI_TCP_IFACE=emu0).

Limits of the emulation (stated in docs/benchmarks.md): all ranks share this machine's cores,
memory bandwidth and the kernel's TCP stack, so compute-heavy phases slow each other down, and
the veth path itself tops out at ~6.5 Gbit/s of CPU-bound TCP on 2 cores: a "25 Gbit/s" link
is really "as fast as the kernel moves bytes".
"""
import argparse
import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import tempfile
import time

PREFIX = "hpe"
BRIDGE = PREFIX + "br"
SUBNET = "10.77.0"
ROOT_IP = SUBNET + ".1"
IFACE = "emu0"          # the interface's name inside every namespace
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH = os.path.join(ROOT, "bin", "emucluster-launch")


def host_ip(i):
    return f"{SUBNET}.{10 + i}"


def sh(*args, check=True):
    """Run one ip/tc command; a failure names the command and its stderr."""
    proc = subprocess.run(args, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"emucluster: `{' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


def netem_available():
    """This VM's kernel has no sch_netem (tc says "Specified qdisc kind is unknown"), so the
    one-way delay can be applied only where it exists; tbf (the rate) is always used."""
    sh("ip", "link", "add", PREFIX + "probe", "type", "veth", "peer", "name", PREFIX + "probe2")
    try:
        return sh("tc", "qdisc", "add", "dev", PREFIX + "probe", "root", "netem", "delay",
                  "1us", check=False).returncode == 0
    finally:
        sh("ip", "link", "del", PREFIX + "probe", check=False)


def shape(ns, dev, gbps, delay_us, netem):
    """One end of a host's link: egress rate `gbps` by a token bucket (tbf), and, when the
    kernel has netem, `delay_us` one-way delay in front of it. Bucket = 1 ms of the rate
    (>= 64 KiB, a GSO packet on veth): short bursts above the rate stay under 1 ms. tbf's
    `latency 100ms` is not a delay: it sizes the queue (rate x 100 ms + bucket) and drops what
    would wait longer; a packet that finds tokens leaves at once, so tbf emulates a link's rate
    and the queueing behind earlier bytes, never its propagation delay (netem's job)."""
    pre = ["ip", "netns", "exec", ns] if ns else []
    burst = max(65536, int(gbps * 1e9 / 8 * 1e-3))
    tbf = ["tbf", "rate", f"{gbps}gbit", "burst", str(burst), "latency", "100ms"]
    if netem and delay_us:
        sh(*pre, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
           f"{delay_us}us", "limit", "100000")
        sh(*pre, "tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf)
    else:
        sh(*pre, "tc", "qdisc", "add", "dev", dev, "root", *tbf)


def up(hosts, gbps, delay_us, netem):
    """Create the bridge, K namespaces and their shaped links. The host link is full duplex at
    `gbps`: each direction is shaped once (namespace side for sends, bridge side for receives),
    so a round trip costs 2 x delay_us."""
    sh("ip", "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "addr", "add", f"{ROOT_IP}/24", "dev", BRIDGE)
    sh("ip", "link", "set", BRIDGE, "up")
    lines = []
    for i in range(hosts):
        ns, hv = f"{PREFIX}{i}", f"{PREFIX}{i}h"
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", hv, "type", "veth", "peer", "name", IFACE, "netns", ns)
        sh("ip", "link", "set", hv, "master", BRIDGE)
        sh("ip", "link", "set", hv, "up")
        sh("ip", "-n", ns, "addr", "add", f"{host_ip(i)}/24", "dev", IFACE)
        sh("ip", "-n", ns, "link", "set", IFACE, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "route", "add", "default", "via", ROOT_IP)
        shape(ns, IFACE, gbps, delay_us, netem)
        shape(None, hv, gbps, delay_us, netem)
        lines.append(f"{host_ip(i)} {ns}")
    return lines


def down():
    """Remove everything with our prefix; safe to call twice and after a crash. Processes still
    inside our namespaces (an MPI proxy that outlived an interrupted mpiexec) are ended first:
    a deleted namespace would otherwise keep them running, unreachable."""
    names = [line.split()[0] for line in sh("ip", "netns", "list", check=False).stdout.splitlines()
             if line.strip()]
    names = [ns for ns in names if ns.startswith(PREFIX) and ns[len(PREFIX):].isdigit()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [int(p) for ns in names
                for p in sh("ip", "netns", "pids", ns, check=False).stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if pids and sig == signal.SIGTERM:
            time.sleep(0.5)
    for ns in names:
        sh("ip", "netns", "del", ns, check=False)   # deletes its veth end, and so the pair
    for line in sh("ip", "-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name == BRIDGE or name.startswith(PREFIX + "probe") or (
                name.startswith(PREFIX) and name.endswith("h")):
            sh("ip", "link", "del", name, check=False)


class Interrupted(Exception):
    pass


def _raise(signum, frame):
    raise Interrupted(f"signal {signum}")


def mpi_env(state_dir):
    """Environment for the root-namespace mpiexec; hydra passes it on to every rank."""
    return dict(os.environ,
                EMUCLUSTER_MAP=os.path.join(state_dir, "hosts.map"),
                FI_PROVIDER="tcp", FI_TCP_IFACE=IFACE,
                MPIR_CVAR_CH4_NETMOD="ofi",
                MPIR_CVAR_NOLOCAL="1",       # never shared memory between ranks
                HYDRA_IFACE=BRIDGE)


def mpiexec_args(hosts, launch=LAUNCH):
    """The hydra options that put rank i in namespace i."""
    return ["-launcher", "ssh", "-launcher-exec", launch,
            "-hosts", ",".join(host_ip(i) for i in range(hosts)), "-ppn", "1", "-iface", BRIDGE]


class NeedsRoot(RuntimeError):
    pass


class Busy(RuntimeError):
    pass


LOCK = "/run/lock/hpcsgd-emucluster.lock"
EXIT_BUSY = 75          # EX_TEMPFAIL: try again later


@contextlib.contextmanager
def exclusive(wait=None):
    """One emulated cluster at a time on this machine: its names (hpe*, 10.77.0.0/24) are
    fixed, and setting up removes leftovers, which would be another live run's cluster. An
    flock, so an owner that dies releases it (the descriptor is not inherited by children).
    wait: seconds to wait for a busy cluster (default $EMUCLUSTER_WAIT, else 0: Busy at once)."""
    wait = float(os.environ.get("EMUCLUSTER_WAIT", 0)) if wait is None else wait
    os.makedirs(os.path.dirname(LOCK), exist_ok=True)
    fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                    raise Busy(f"emucluster: in use by pid {owner} (another run's emulated "
                               f"cluster); set EMUCLUSTER_WAIT=SECONDS to wait for it") from None
                time.sleep(1)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def cluster(hosts, gbps, delay_us=0):
    """K shaped hosts for the duration of the with-block. Inside it os.environ carries what
    mpiexec needs ($EMUCLUSTER_MPIEXEC_ARGS: the hydra options; $EMUCLUSTER_MAP; libfabric and
    MPICH settings; $EMUCLUSTER_GBPS), so hpcsgd/bench/launch.py's mpirun lands rank i in
    namespace i. Torn down on exit, on an exception, and on SIGINT/SIGTERM/SIGHUP (raised
    here as Interrupted so that this `finally` runs)."""
    if os.geteuid() != 0:
        raise NeedsRoot("emucluster: needs root (ip netns, tc); run it as root, "
                        "e.g. sudo bin/emucluster")
    old = {s: signal.signal(s, _raise) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    saved = dict(os.environ)
    try:
        with exclusive():
            down()                      # leftovers of a killed run (no live one: we hold the lock)
            try:
                with tempfile.TemporaryDirectory(prefix="emucluster") as state:
                    netem = netem_available()
                    if delay_us and not netem:
                        print(f"emucluster: this kernel has no netem qdisc; the {delay_us} us "
                              f"delay is NOT applied (rate only; the veth path's own latency "
                              f"remains)", file=sys.stderr)
                        delay_us = 0
                    lines = up(hosts, gbps, delay_us, netem)
                    env = mpi_env(state)
                    with open(env["EMUCLUSTER_MAP"], "w") as f:
                        f.write("\n".join(lines) + "\n")
                    env.update(EMUCLUSTER_MPIEXEC_ARGS=" ".join(mpiexec_args(hosts)),
                               EMUCLUSTER_GBPS=str(gbps),
                               EMUCLUSTER_LINK=f"{gbps} Gbit/s, {delay_us} us one-way")
                    os.environ.update(env)
                    yield env
            finally:
                os.environ.clear()
                os.environ.update(saved)
                down()
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run(hosts, gbps, delay_us, argv, timeout=None):
    """Build the cluster, run `mpiexec <hydra options> argv`, tear down; returns the exit code.
    argv may also be a whole command (first word not starting with '-'), run with the hydra
    options in $EMUCLUSTER_MPIEXEC_ARGS and the map in $EMUCLUSTER_MAP."""
    from hpcsgd.bench.launch import MPIEXEC, run_group
    try:
        with cluster(hosts, gbps, delay_us) as env:
            cmd = argv if argv and not argv[0].startswith("-") \
                else [MPIEXEC] + mpiexec_args(hosts) + argv
            print(f"emucluster: {hosts} hosts, {gbps} Gbit/s, {delay_us} us; {' '.join(cmd)}",
                  file=sys.stderr, flush=True)
            return run_group(cmd, env, timeout)
    except NeedsRoot as e:
        print(e, file=sys.stderr)
        return 2
    except Busy as e:
        print(e, file=sys.stderr)
        return EXIT_BUSY
    except Interrupted as e:
        print(f"emucluster: interrupted ({e}); tearing down", file=sys.stderr)
        return 130


# ---- `hpcsgd bench NAME --emulate RATES`: any MPI benchmark across the emulated cluster ----
def add_bench_arguments(parser):
    parser.add_argument("--emulate", metavar="GBPS",
                        help="root: run the benchmark's MPI part across an emulated cluster, once "
                             "per link rate, e.g. 1,10,25 (bin/emucluster, docs/benchmarks.md)")
    parser.add_argument("--hosts", type=int, default=None,
                        help="--emulate: namespaces (default: the largest K of --ranks)")


def bench(run_once, args):
    """run_once() per link rate of args.emulate inside a cluster of args.hosts hosts (default:
    the largest of args.ranks); returns {"emulated": ..., "links": [{"link_gbps", **result}]}."""
    rates = [float(g) for g in args.emulate.split(",") if g]
    ranks = [int(k) for k in (getattr(args, "ranks", None) or "2").split(",")]
    hosts = args.hosts or max(ranks)
    links = []
    for gbps in rates:
        gbps = int(gbps) if gbps == int(gbps) else gbps
        with cluster(hosts, gbps, 0):
            print(f"\n=== emulated cluster: {hosts} hosts (network namespaces), {gbps} Gbit/s per "
                  f"host link (tc tbf), MPI over TCP ===", flush=True)
            links.append({**run_once(), "link_gbps": gbps})
    return {"emulated": {"hosts": hosts, "rates_gbps": rates, "delay_us": 0,
                         "netem": False,
                         "shaping": "tbf rate, both directions of each host's veth"},
            "links": links}


def main(argv=None):
    p = argparse.ArgumentParser(prog="emucluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=2, help="namespaces = MPI ranks (default 2)")
    p.add_argument("--gbps", type=float, default=1.0, help="link rate per host, Gbit/s")
    p.add_argument("--delay-us", type=int, default=25, help="one-way link delay, microseconds")
    p.add_argument("--timeout", type=float, default=None, help="seconds before the run is killed")
    p.add_argument("--down", action="store_true", help="only remove leftovers and exit")
    p.add_argument("cmd", nargs=argparse.REMAINDER,
                   help="after --: mpiexec options + program, or a whole command")
    a = p.parse_args(argv)
    if a.down:
        if os.geteuid() != 0:
            print("emucluster: needs root", file=sys.stderr)
            return 2
        try:
            with exclusive(0):          # never another live run's cluster
                down()
        except Busy as e:
            print(e, file=sys.stderr)
            return EXIT_BUSY
        return 0
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        p.error("nothing to run: give mpiexec options and a program after --, or use "
                "`hpcsgd bench NAME --emulate RATES` for a benchmark")
    gbps = int(a.gbps) if a.gbps == int(a.gbps) else a.gbps
    try:
        return run(a.hosts, gbps, a.delay_us, cmd, a.timeout)
    except subprocess.TimeoutExpired:
        print(f"emucluster: timed out after {a.timeout} s; torn down", file=sys.stderr)
        return 124


if __name__ == "__main__":
    sys.exit(main())
