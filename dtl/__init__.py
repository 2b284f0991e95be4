"""dtl: the distributed-training-lessons kit that every day imports.

dist (init, cleanup, ParallelGrid), config, model (the small GPT), data, metrics, comm
(CommCounter), testing (run_distributed), registry and tour (lessons.toml). Never imports a day.
"""
