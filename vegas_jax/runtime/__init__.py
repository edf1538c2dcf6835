"""The host side of a run: the Engine (the library API), what a run compiles and allocates (options, run_plan,
memory, compilation), prefill, pacing and serving, scoring, and what a run hands back (results, metrics)."""
