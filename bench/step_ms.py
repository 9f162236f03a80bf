"""Milliseconds per optimizer step of a tk-run, from its metrics.jsonl: the wall time between the
records of step FROM and step TO, divided by TO - FROM.

usage: python3 step_ms.py METRICS FROM TO
"""
import json
import sys

wall = {r["step"]: r["wall_time"] for r in map(json.loads, open(sys.argv[1])) if "wall_time" in r}
first, last = int(sys.argv[2]), int(sys.argv[3])
print(f"{1000 * (wall[last] - wall[first]) / (last - first):.4f}")
