"""Profiling.

- profiler.py: TorchProfiler (per-rank gzip traces), mark_modules, CUDA-graph capture traces.
- conventions.py: the range names the engine emits and the parser reads.
- trace_parser.py / breakdown.py / report.py: `atomctl parse-trace` (kernel attribution,
  per-phase tables, xlsx / rich / PNG output).

Kept import-free so that the engine importing profiler.py does not pull in pandas.
"""
