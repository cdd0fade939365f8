"""Run by tests/test_close_process_group.py under torchrun (2 processes, gloo): a DDP model, then
`cli.close_process_group`; writes the names of the threads left in this process, per rank.

torch.distributed.nn.functional is imported after the group exists, as DDP's construction imports it in a
training run: its functions' defaults `group=group.WORLD` then hold the group.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from posttrain.cli import _group_threads_alive, close_process_group


def threads() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return names


def main(out_path: str, close: str):
    dist.init_process_group("gloo")
    import torch.distributed.nn.functional  # noqa: F401  (after the group: see the module docstring)

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1))
    model(torch.ones(2, 3)).sum().backward()
    before = threads()
    del model  # in a trainer run the model sits in reference cycles: close_process_group collects them
    if close == "close":
        close_process_group()
    else:
        dist.destroy_process_group()
    with open(f"{out_path}.{os.environ['RANK']}", "w") as f:
        json.dump({"before": before, "after": threads(), "alive_after": _group_threads_alive()}, f)
    if close == "destroy":
        # the group's threads outlive destroy_process_group (what the test records), and a process that leaves
        # them running into interpreter teardown now and then aborts ("terminate called without an active
        # exception"): end as cli.end_process ends such a run, without the teardown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])  # out.json, close | destroy (torch's destroy_process_group alone)
