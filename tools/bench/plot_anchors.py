"""Plot an anchors result (bench_anchors.py's JSON) as one PNG beside it.

    python tools/bench/plot_anchors.py bench-results/anchors-cpu.json

The plot itself is tools/bench/anchors/plot.py (needs matplotlib).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from anchors.plot import plot

if __name__ == "__main__":
    for arg in sys.argv[1:] or ["bench-results/anchors-cpu.json"]:
        print(plot(arg))
