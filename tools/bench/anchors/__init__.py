"""The anchors benchmark (tools/bench/bench_anchors.py), a module for each part it measures."""
