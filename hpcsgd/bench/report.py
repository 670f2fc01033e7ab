"""What every `hpcsgd bench` subcommand shares: `--json FILE` (the result with a header naming
the run) and `--compare OLD.json` (each headline figure of this run beside the same figure of an
earlier run, and the change). One implementation, called by the dispatcher (bench/__init__.py)
after the subcommand's run(args) returned its result dict.

Headline figures: a bench module may define figures(result) -> {label: number}; without it
every numeric leaf of the result is one (dotted path as label, lists left out); an --emulate
result has them per link rate. Old JSON written before the header existed compares too: only
the figures both runs have are shown.
"""
import datetime
import json
import math
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def add_arguments(parser):
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--compare", metavar="OLD.json",
                        help="print each headline figure beside the one in OLD.json and the change")


def load_average():
    """1-minute load average: how many runnable processes shared the cores."""
    return os.getloadavg()[0]


def header(name, argv):
    """Where and when a figure was measured, and how busy the machine was at the start."""
    try:
        rev = subprocess.run(["git", "-C", REPO, "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    return {"bench": name, "command": "hpcsgd bench " + " ".join([name, *argv]),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "git_revision": rev or "unknown", "cpus": os.cpu_count(),
            "load_average_start": load_average()}


def clean(obj):
    """JSON-safe copy: numpy scalars to Python, non-finite floats to the strings 'inf'/'nan'
    (strict JSON has no Infinity; a reader sees what the value meant)."""
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):   # numpy scalar
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    return obj


def flatten(obj, prefix=""):
    """{dotted path: number} of every int/float leaf outside lists (the fallback figures)."""
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        out[prefix[:-1]] = obj
    return out


def headline(module, result):
    """The run's headline figures; an --emulate run's per link rate, prefixed with the rate."""
    if "links" in result:
        return {f"{link['link_gbps']:g} Gbit/s {k}": v for link in result["links"]
                for k, v in headline(module, link).items()}
    fn = getattr(module, "figures", None)
    if fn is None:
        return flatten(result)
    try:
        return fn(result)
    except (KeyError, TypeError, IndexError):   # an OLD.json of an earlier format
        return flatten(result)


def compare(module, new, old, old_path):
    """Print old, new and the change of every figure the two runs share; returns the rows."""
    a, b = headline(module, old), headline(module, new)
    shared = [k for k in b if k in a]
    when = old.get("date", "?")
    load = old.get("load_average_start")
    print(f"\ncompare with {old_path} (measured {when}"
          f"{f', load average {load:.2f}' if isinstance(load, (int, float)) else ''}; this run: "
          f"load average {new.get('load_average_start', float('nan')):.2f})")
    width = max([len(k) for k in shared] + [6])
    print(f"{'figure':{width}s} {'old':>14s} {'new':>14s} {'change':>9s}")
    rows = []
    for k in shared:
        x, y = a[k], b[k]
        change = (y / x - 1) * 100 if isinstance(x, (int, float)) and x != 0 \
            and isinstance(y, (int, float)) else None
        rows.append((k, x, y, change))
        print(f"{k:{width}s} {_fmt(x):>14s} {_fmt(y):>14s} "
              f"{(f'{change:+.1f}%' if change is not None else 'n/a'):>9s}")
    for label, keys in (("only in OLD", [k for k in a if k not in b]),
                        ("only in this run", [k for k in b if k not in a])):
        if keys:
            print(f"{label}: {', '.join(keys[:12])}{' ...' if len(keys) > 12 else ''}")
    return rows


def _fmt(x):
    if not isinstance(x, (int, float)):
        return str(x)
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def finish(head, module, result, args):
    """header() taken before the run + result -> --json; --compare prints the changes."""
    out = {**head, **result}
    out["load_average_end"] = load_average()
    out = clean(out)
    rc = 0
    if args.compare:   # read before --json is written: the same path compares with the last run
        try:
            with open(args.compare) as f:
                old = json.load(f)
        except (OSError, ValueError) as err:
            print(f"--compare {args.compare}: cannot read it ({err})", file=sys.stderr)
            rc = 2
        else:
            compare(module, out, old, args.compare)
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1, allow_nan=False)
        os.replace(tmp, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    return rc
