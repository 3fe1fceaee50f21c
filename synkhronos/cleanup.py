"""``python -m synkhronos.cleanup``: list and remove the shared memory of runs killed whole.

A run ended by SIGKILL together with its resource trackers (``kill -9`` of the
process group, the OOM killer, a scheduler's cancel) leaves its segments in
``/dev/shm`` until reboot. ``fork()`` removes those of runs whose master no
longer runs; this command does the same without starting anything.

Examples
--------
    python -m synkhronos.cleanup            # list them and remove them
    python -m synkhronos.cleanup --dry-run  # only list them
"""

import argparse
import os

from .ipc.segments import SEGMENT_DIRECTORY, remove_stale_segments, stale_segments


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m synkhronos.cleanup",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="list them, remove nothing")
    args = parser.parse_args(argv)
    names = stale_segments() if args.dry_run else remove_stale_segments()
    size = 0
    for name in names if args.dry_run else []:
        try:
            size += os.stat(os.path.join(SEGMENT_DIRECTORY, name)).st_size
        except OSError:
            pass
    verb = "left by runs that no longer run" if args.dry_run else "removed"
    for name in names:
        print(name)
    print(f"{len(names)} segment(s) {verb}" + (f", {size / 2**20:.1f} MiB" if args.dry_run else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
