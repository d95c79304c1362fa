"""A trivial worker for the launcher tests: ``python -m tests.parallel.launch_entry MODE [DIR]``.

Modes: ``ok`` (print a line, exit 0), ``fail-rank1`` (rank 1 raises ValueError), ``usererror-rank1`` (rank 1
prints a CLI-style error line and exits 2), ``wait-sigterm DIR`` (write DIR/ready.R, wait for SIGTERM, then
write DIR/saved.R and exit 0), ``dist DIR`` (init gloo from the launcher's env, all-reduce, write the sum).
"""

import os
import signal
import sys
import time


def main() -> int:
    mode = sys.argv[1]
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if mode == "ok":
        print(f"hello from rank {rank} of {world}", flush=True)
        return 0
    if mode == "fail-rank1":
        if rank == 1:
            raise ValueError("boom on purpose")
        time.sleep(30)  # the launcher must stop us once rank 1 fails
        return 0
    if mode == "usererror-rank1":
        if rank == 1:
            sys.stderr.write("some warning first\nlongspan: error: model.num_layers=-1 must be positive\n")
            return 2
        time.sleep(30)
        return 0
    if mode == "wait-sigterm":
        out = sys.argv[2]
        got = []
        signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
        open(os.path.join(out, f"ready.{rank}"), "w").close()
        deadline = time.monotonic() + 60
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        if got:
            with open(os.path.join(out, f"saved.{rank}"), "w") as fh:
                fh.write("saved")
            return 0
        return 3
    if mode == "dist":
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        with open(os.path.join(sys.argv[2], f"sum.{rank}"), "w") as fh:
            fh.write(str(t.item()))
        dist.destroy_process_group()
        return 0
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    raise SystemExit(main())
