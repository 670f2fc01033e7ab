"""Every relative link in the README, docs/ and experiments/README.md reaches a file that
exists, and every #anchor a heading of that file (GitHub's slugs): docs that move between pages
must not leave a reader at a dead link."""
import glob
import os
import re

import pytest

from conftest import REPO

PAGES = sorted(glob.glob(os.path.join(REPO, "docs", "*.md"))
               + [os.path.join(REPO, "README.md"), os.path.join(REPO, "experiments", "README.md"),
                  os.path.join(REPO, "data_prep", "demo", "ATTRIBUTION.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    found, seen = set(), {}
    in_code = False
    for line in open(path, encoding="utf-8"):
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        base = slug(line.lstrip("#"))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path):
    text = open(path, encoding="utf-8").read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)      # commands, not links
    return [m.group(1) for m in LINK.finditer(text)]


@pytest.mark.parametrize("page", [os.path.relpath(p, REPO) for p in PAGES if os.path.exists(p)])
def test_every_relative_link_and_anchor_resolves(page):
    path = os.path.join(REPO, page)
    bad = []
    for target in links(path):
        if re.match(r"[a-z]+:", target):          # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(dest):
            bad.append(f"{target}: no file {os.path.relpath(dest, REPO)}")
        elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
            bad.append(f"{target}: no heading with anchor #{anchor} in {os.path.relpath(dest, REPO)}")
    assert not bad, "\n".join(bad)


def test_slugs_are_githubs():
    assert slug(" The test suite's time (2026-11-25, Zen 4)") == "the-test-suites-time-2026-11-25-zen-4"
    assert slug(" GPU ranks (`train.device: cuda`)") == "gpu-ranks-traindevice-cuda"
    assert slug(" Adaptive bit width (`exchange.bits = mqgrad | oland_raj`)") == \
        "adaptive-bit-width-exchangebits--mqgrad--oland_raj"
