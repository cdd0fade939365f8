"""The command line of a worker script launched by the multi-process tests: one or more jobs separated by "+",
run one after the other in the same processes. A launch's start-up (the launcher, then torch, transformers and
the trainer imported in every process) is most of a short test's time; every trainer seeds itself, so a job's
result does not depend on the jobs before it."""

import gc
import sys

from posttrain.cli import close_process_group


def run_jobs(main, *types) -> None:
    """Call `main` once per job of sys.argv, each argument converted by its type in `types`, then close the
    process group (see cli.close_process_group)."""
    words, jobs = sys.argv[1:], [[]]
    for word in words:
        jobs.append([]) if word == "+" else jobs[-1].append(word)
    try:
        for job in jobs:
            main(*(kind(word) for kind, word in zip(types, job, strict=True)))
            gc.collect()
    finally:
        close_process_group()
