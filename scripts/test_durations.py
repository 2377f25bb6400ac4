"""Writes ``tests/durations.json`` from a suite run's ``--durations=0`` report, for ``tests/conftest.py``'s order.

    .venv/bin/python -m pytest -q --durations=0 > /tmp/suite.txt
    .venv/bin/python scripts/test_durations.py /tmp/suite.txt

Each test that took 4 s or more (setup, call and teardown together), in whole seconds; the rest count as cheap.
"""

import json
import re
import sys
from pathlib import Path

seconds: dict[str, float] = {}
for line in Path(sys.argv[1]).read_text().splitlines():
    match = re.match(r"([\d.]+)s (?:call|setup|teardown)\s+(tests/\S+)", line)
    if match:
        seconds[match.group(2)] = seconds.get(match.group(2), 0.0) + float(match.group(1))
kept = {test: round(s) for test, s in sorted(seconds.items(), key=lambda kv: -kv[1]) if s >= 4}
out = Path(__file__).resolve().parents[1] / "tests" / "durations.json"
out.write_text(json.dumps(kept, indent=0) + "\n")
print(f"wrote {out}: {len(kept)} tests of {len(seconds)}, {sum(kept.values())} of {round(sum(seconds.values()))} s")
